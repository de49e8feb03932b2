"""Data parallelism: the DDP helpers (gradient all-reduce, clipping, the sampler), FSDP2 over TP.

It imports the runtime, the mesh and the state; no other dimension.
"""
