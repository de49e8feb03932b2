"""`wrap`: one call that makes a Hugging Face model tensor-parallel."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .comm import build_groups, dp_group_for, group_size, init_from_env, launched_by_torchrun
from .data_parallel import DDPGuard, input_check_hook
from .plan import Plan, build_plan
from .policy import Policy
from .sequence import apply_sequence_parallel, sequence_layout
from .walker import apply_plan, parallel_layers

PolicyArg = Policy | str | Path | Mapping[str, Any] | None


_last: weakref.ref | None = None


def last_wrapped() -> nn.Module | None:
    """The model most recently wrapped in this process (what `autotp.tp_group()` and friends default to)."""
    return None if _last is None else _last()


def wrap(
    model: nn.Module,
    tp_size: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    policy: PolicyArg = None,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    check_inputs: bool = False,
) -> nn.Module:
    """Shard `model` over `tp_size` ranks in place and return it.

    TP groups are consecutive ranks; the rest of the world is data parallel. Under torchrun or
    accelerate, torch.distributed is initialised here if the script has not done it (NCCL on GPUs,
    gloo otherwise). `tp_size=1` needs no process group. Every check runs before the model is
    touched, so a refused call leaves it unchanged. `vocab_parallel` splits the embedding and LM head
    by vocabulary where the model allows (the plan says). `sequence_parallel=True` also splits the
    residual stream between blocks along the sequence. `check_inputs=True` verifies on every
    forward that all TP ranks of a replica got the same tensors.
    """
    _validate_tp_size(tp_size)
    if getattr(model, "autotp_state", None) is not None or parallel_layers(model):
        raise RuntimeError(f"{type(model).__name__} is already wrapped by autotp; wrap it once")
    plan = build_plan(model, tp_size, policy, vocab_parallel)
    if sequence_parallel:
        sequence_layout(model, plan)  # refuses before anything changes
    tp_group, dp_group = _groups(tp_size, tp_group)
    state = apply_plan(model, plan, tp_group, dp_group)
    if sequence_parallel:
        apply_sequence_parallel(model, plan, tp_group, state)
    finish(model, check_inputs)
    if tp_group is not None and dist.get_backend(tp_group) == "nccl" and torch.cuda.is_available():
        model.to(torch.device("cuda", torch.cuda.current_device()))
    return model


def finish(model: nn.Module, check_inputs: bool) -> None:
    """What every wrapped model gets besides its plan: the DDP guard, the optional input check, and
    becoming the default of `autotp.tp_group()` and friends."""
    global _last
    _last = weakref.ref(model)
    ignored = tuple(getattr(model, "_ddp_params_and_buffers_to_ignore", ()) or ())
    model._ddp_params_and_buffers_to_ignore = DDPGuard(model, ignored)
    if check_inputs:
        model.register_forward_pre_hook(input_check_hook, with_kwargs=True)


def _validate_tp_size(tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int):
        raise TypeError(f"tp_size must be an int, got {type(tp_size).__name__} {tp_size!r}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")


def _groups(tp_size: int, tp_group: dist.ProcessGroup | None):
    """This rank's (TP, DP) groups, initialising torch.distributed from launcher variables if needed."""
    if not dist.is_initialized() and (tp_size > 1 or tp_group is not None) and launched_by_torchrun():
        init_from_env()
    if not dist.is_initialized():
        if tp_size > 1 or tp_group is not None:
            raise RuntimeError(
                f"tp_size={tp_size} needs torch.distributed, which is not initialised and no launcher variables "
                f"(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are set. Launch with "
                f"`torchrun --nproc-per-node {tp_size} your_script.py` or `accelerate launch`, "
                f"or call torch.distributed.init_process_group first."
            )
        return None, None
    world = dist.get_world_size()
    if tp_group is not None:
        if group_size(tp_group) != tp_size:
            raise ValueError(f"tp_group has {group_size(tp_group)} ranks but tp_size={tp_size}")
        return tp_group, dp_group_for(tp_group)
    if world % tp_size:
        raise ValueError(
            f"tp_size={tp_size} must divide the world size {world} (world = data parallel x tensor parallel)"
        )
    return build_groups(tp_size)


def explain(model: nn.Module, tp_size: int, policy: PolicyArg = None, vocab_parallel: bool = True) -> Plan:
    """The plan `wrap` would apply, without a process group; works on a meta-device model."""
    return build_plan(model, tp_size, policy, vocab_parallel)
