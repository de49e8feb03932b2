"""Sequence parallelism: the activations between TP blocks split by sequence, around tp's layers.

It imports tp's layers, the runtime, the mesh and the state; no other dimension.
"""
