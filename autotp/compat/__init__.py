"""Dependency boundaries: the private or undocumented pieces of autotp's dependencies, one module per dependency.

- `hf`: transformers' model internals (weight conversion on load, auto-class mappings, init of missing keys).
- `trainer`: transformers' Trainer private methods AutoTPTrainer replaces or calls, and accelerate's one.
- `peft`: PEFT's classes (recognised by isinstance, PEFT imported lazily) and its LoRA layers' private methods.
- `torch`: torch.distributed's group timeout, DDP's constructor frame and ignore list, FSDP2's hooks, and the
  collectives renamed across versions.
- `versions`: the tested versions, the error naming a piece a dependency moved, and `check_versions`, a
  once-per-process warning for an untested major version of torch, transformers or PEFT.

Each module opens with a table of its pieces and the versions they were checked on. Outside this package
autotp still touches nn.Module's own dicts (`_modules`, `_parameters`, its hook dicts), which torch keeps
stable; tests/package/test_compat.py fails on any of the private names in those tables used elsewhere.

It imports nothing from autotp, so any tier may import it.
"""

from .versions import check_versions

__all__ = ["check_versions"]
