"""Every file concern of autotp: safetensors files, full HF checkpoints, sliced loading, resumable checkpoints.

It depends on the plan and sharding data, the state a wrapped model carries and the collectives,
never on the entry points (`autotp.api`). Writes go to a staging directory renamed into place only
when every rank finished (`staging`), so a crash never leaves a half-written checkpoint.
"""
