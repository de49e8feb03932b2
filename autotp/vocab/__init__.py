"""Vocabulary parallelism: the LM head and embedding split by vocabulary, the sharded loss, logits on demand.

It imports tp's layers (the head is a column layer), the runtime, the mesh and the state; no other dimension.
"""
