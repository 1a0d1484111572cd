"""Hugging Face <-> Megatron checkpoint conversion with TP/PP resharding."""
