"""Checkpoints: the sharded on-disk format, Hugging Face conversion, initial weights."""
