"""Hugging Face checkpoints: safetensors files written and read by slice, the full save, the per-rank load.

It imports io's shared pieces (errors, streaming, staging), the dimensions' state (the pipeline's stage cut) and
compat.
"""
