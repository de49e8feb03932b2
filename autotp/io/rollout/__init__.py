"""Weights out to a rollout engine: export in checkpoint names (the ranks' rows gathered one bucket per message), sync over a process group, LoRA adapters, and
vLLM's own weight-transfer API (`vllm_*`: optional; those modules import vLLM, so `import autotp` never loads them).

It imports io's shared pieces and io.hf, the dimensions' state and compat.
"""
