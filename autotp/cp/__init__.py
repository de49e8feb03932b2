"""Context parallelism: the sequence split across ranks for attention (zigzag layout, ring-free gathers), loss, dropout.

It imports tp's streams, the runtime, the mesh and the state; no other dimension.
"""
