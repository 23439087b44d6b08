"""Checkpoints: what `model=` names (a directory or a GGUF file) and how each rank reads
its slice of the weights."""
