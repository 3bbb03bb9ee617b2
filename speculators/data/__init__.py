"""The data stages: prompt sources, on-policy regeneration, tokenization, hidden-state capture and its store."""
