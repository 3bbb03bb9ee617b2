"""Verifiers: loading (transformers, GGUF, Mistral format), FP8, vision-language inputs, tiny test models."""
