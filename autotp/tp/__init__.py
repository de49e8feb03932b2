"""Tensor parallelism, the base dimension: column/row layers, their block entry, overlap, GLU, heads, LoRA, streams.

It imports the runtime, the mesh, the state, planning and compat; never another dimension package.
"""
