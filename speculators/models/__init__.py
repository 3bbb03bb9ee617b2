"""Draft model implementations, one module per model."""
