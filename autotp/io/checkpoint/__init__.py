"""Training checkpoints (DCP-style chunks, layout-free): save, restore at any layout, consolidate, the old format.

It imports io's shared pieces and io.hf, the dimensions' state and compat.
"""
