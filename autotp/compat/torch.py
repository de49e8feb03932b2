"""Every place autotp relies on PyTorch beyond its documented API, in one module.

| piece                                                    | used for                                 | checked on |
|----------------------------------------------------------|------------------------------------------|------------|
| `ProcessGroup._get_backend(device).options._timeout`     | the world's timeout, for autotp's groups | 2.13       |
| `sys._getframe`: DDP's `__init__` frame, its `self`      | DDP's group while DDP is being built     | 2.13       |
| `Module._ddp_params_and_buffers_to_ignore`               | DDP reads it during `__init__`           | 2.13       |
| FSDP2's module hooks defined in `torch.distributed.fsdp` | pausing FSDP's hooks (no public marker)  | 2.13       |
| `dist.all_gather_single` / `all_gather_into_tensor`      | the one-tensor all-gather (renamed)      | 2.13       |
| `dist.reduce_scatter_single` / `reduce_scatter_tensor`   | the one-tensor reduce-scatter (renamed)  | 2.13       |
| `Tensor._make_wrapper_subclass`, `_disabled_torch_function_impl` | a tensor DCP sees, holding no data (as DTensor) | 2.13 |
| `torch.testing._internal.distributed.fake_pg.FakeStore` | one rank of a larger world (benchmarks) | 2.13 |
| `sys._current_frames`: torch's optimizer `step` wrapper  | a global step hook not removed mid-step  | 2.13       |
| `distributed_c10d._world.pg_map`, `ProcessGroupGloo._set_default_timeout` | every gloo group bounded during a weight sync | 2.13 |
| `PipelineStage._post_metadata_inference_cleanup` (overridden) | FSDP's gradients kept over pipeline steps | 2.13 |

torch has no public getter for a group's timeout; a missing piece raises `versions.missing`'s error. The DDP
frame read returns None instead, as `autotp.integrations.guards.DDPGuard` then checks the group at DDP's first forward.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from .versions import missing, require

_DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


def backend_timeout(group: Any = None) -> timedelta | None:
    """The timeout `group` (the world by default) was created with, read from its backend for the world's device
    type; None without torch.distributed or without a backend for that device."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group or dist.group.WORLD
    get_backend = require(group, "_get_backend", "torch.distributed.ProcessGroup._get_backend")
    try:
        backend = get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
    except RuntimeError:  # no backend for that device type
        return None
    timeout = require(getattr(backend, "options", None), "_timeout", "torch.distributed.Backend.Options._timeout")
    return timeout if isinstance(timeout, timedelta) else None


@contextmanager
def gloo_timeouts_at_most(seconds: float | None) -> Iterator[None]:
    """Every gloo group of this process waits at most `seconds` meanwhile, then gets its own timeout back (None:
    nothing changes). NCCL groups are left as they are: their timeout aborts the process."""
    lowered = []
    if seconds is not None and dist.is_initialized():
        bound, cpu = timedelta(seconds=seconds), torch.device("cpu")
        for group in list(dist.distributed_c10d._world.pg_map):
            backend = group._get_backend(cpu) if cpu in group._device_types else None
            if isinstance(backend, dist.ProcessGroupGloo) and backend.options._timeout > bound:
                lowered.append((backend, backend.options._timeout))
                backend._set_default_timeout(bound)
    try:
        yield
    finally:
        for backend, timeout in lowered:
            backend._set_default_timeout(timeout)


def ddp_under_construction(frames_up: int) -> DistributedDataParallel | None:
    """The DDP whose `__init__` runs `frames_up` frames above the caller, once it holds its process group; None if
    that frame is not such a constructor or this Python cannot read frames."""
    try:
        frame = sys._getframe(frames_up + 1)
    except (AttributeError, ValueError):  # not CPython, or a shallower stack
        return None
    ddp = frame.f_locals.get("self")
    return ddp if isinstance(ddp, DistributedDataParallel) and hasattr(ddp, "process_group") else None


def ddp_ignored(model: nn.Module) -> tuple[str, ...]:
    """The parameter and buffer names DDP is told to leave out of `model` (DDP's private attribute)."""
    return tuple(getattr(model, _DDP_IGNORE, ()) or ())


def set_ddp_ignored(model: nn.Module, names: Iterable[str]) -> Callable[[], None]:
    """What DDP will iterate as the names to leave out of `model` while it is built (any iterable of str); returns
    what puts back the model's own (or none), unless it was replaced since."""
    had, before = _DDP_IGNORE in vars(model), vars(model).get(_DDP_IGNORE)
    setattr(model, _DDP_IGNORE, names)

    def restore() -> None:
        if vars(model).get(_DDP_IGNORE) is names:
            if had:
                setattr(model, _DDP_IGNORE, before)
            else:
                delattr(model, _DDP_IGNORE)

    return restore


_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *args: None).__code__


def optimizer_step_running() -> bool:
    """Whether a thread is inside torch's optimizer `step` wrapper (`Optimizer.profile_hook_step`), which iterates
    the process-wide step pre-hooks: removing one then would break that step. False where frames cannot be read."""
    frames = getattr(sys, "_current_frames", None)
    for frame in (frames() if frames is not None else {}).values():
        while frame is not None:
            if frame.f_code is _STEP_WRAPPER:
                return True
            frame = frame.f_back
    return False


def is_fsdp_hook(hook: Any) -> bool:
    """Whether a module hook is one FSDP2 registered (a bound method, closure or lambda of FSDP's code)."""
    for _ in range(3):  # unwrap torch's _WrappedHook, functools.partial, bound methods
        hook = getattr(hook, "hook", None) or getattr(hook, "func", None) or getattr(hook, "__func__", None) or hook
    return (getattr(hook, "__module__", None) or "").startswith("torch.distributed.fsdp")


def all_gather_single() -> Callable[..., Any]:
    """torch's all-gather of one tensor into one output tensor, `(out, x, group=, async_op=)`, under either name."""
    return getattr(dist, "all_gather_single", None) or require(
        dist, "all_gather_into_tensor", "torch.distributed.all_gather_single"
    )


def reduce_scatter_single() -> Callable[..., Any]:
    """torch's reduce-scatter of one tensor into one output tensor, `(out, x, group=)`, under either name."""
    return getattr(dist, "reduce_scatter_single", None) or require(
        dist, "reduce_scatter_tensor", "torch.distributed.reduce_scatter_single"
    )


def storageless_tensor(cls: type, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An instance of the tensor subclass `cls` with a shape and no storage, as DTensor is built: DCP looks up the
    pieces of a tensor in a state dict only for `torch.Tensor` instances."""
    make = require(torch.Tensor, "_make_wrapper_subclass", "torch.Tensor._make_wrapper_subclass")
    return make(cls, shape, dtype=dtype, device=device, requires_grad=False)


def subclass_alias(cls: type, tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """`tensor` (its storage and strides) seen as an instance of the tensor subclass `cls`."""
    make = require(torch.Tensor, "_make_subclass", "torch.Tensor._make_subclass")
    return make(cls, tensor, requires_grad)


def no_torch_function() -> Callable[..., Any]:
    """The `__torch_function__` of a subclass that opts out of torch-function handling (what DTensor sets)."""
    return require(torch._C, "_disabled_torch_function_impl", "torch._C._disabled_torch_function_impl")


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """torch.distributed on torch's fake backend: every collective returns at once and moves no data, so one process
    runs one rank's share of the compute of a `world_size`-rank job (collectives' outputs hold garbage)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the backend
    except ImportError:
        raise missing("torch.testing._internal.distributed.fake_pg.FakeStore") from None
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class StaticStage(PipelineStage):
    """torch's `PipelineStage` for stages given their metadata (input and output shapes), so never inferred by a run
    on real tensors. torch's cleanup after that inference, run whenever a schedule sets its stages up (a new batch
    shape, a switch between training and evaluation), sets every gradient of an FSDP module to None: it would drop
    the gradients accumulated over earlier steps (the Trainer's gradient accumulation) under `autotp.fully_shard`.
    With nothing inferred there is nothing to clean."""

    def _post_metadata_inference_cleanup(self) -> None:
        pass


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Raise `message` where the one-element `condition` is false: on CUDA a device-side assert, with no host sync
    (torch's private `_assert_async`)."""
    torch._assert_async(condition, message)
