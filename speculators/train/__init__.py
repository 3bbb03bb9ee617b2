"""Training: the EAGLE-3 training loop with training-time test, packing of the store, the draft vocabulary."""
