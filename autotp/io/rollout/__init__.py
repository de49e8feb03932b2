"""Weights out to a rollout engine: export in checkpoint names, sync, LoRA adapters.

It imports io's shared pieces and io.hf, the dimensions' state and compat.
"""
