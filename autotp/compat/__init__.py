"""Dependency boundaries: every touch of transformers', PEFT's and torch's internals, one module per dependency.

Each module keeps a version table and fails with the missing piece named when a dependency moves.
It imports nothing from autotp, so any tier may import it.
"""
