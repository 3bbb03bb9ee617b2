"""Evaluation: offline acceptance and the lossless check (`evaluate`), the GuideLLM benchmark (`bench`)."""
