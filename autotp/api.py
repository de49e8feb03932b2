"""The entry points: `wrap` a loaded model, or `from_pretrained` straight into shards; `explain` either plan.

Both run one pipeline (`_shard`): plan, check, create the process groups, then `autotp.parallelize`,
which changes the model, in order. `from_pretrained` only adds reading each rank's slices between
applying the plan and registering the gradient hooks.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Unpack, cast

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, GenerationConfig

from .compat import check_versions
from .compat.hf import build_model
from .integrations.guards import refuse_adapters, refuse_meta, refuse_quantized
from .io.errors import CheckpointError, agree, outcomes, world
from .io.hf.load import checkpoint_files, load_params
from .mesh import (
    DEFAULT_TIMEOUT,
    Mesh,
    build_mesh,
    device_of,
    group_size,
    init_from_env,
    is_global_rank0,
    launched_by_torchrun,
    named_failure,
    world_mesh,
    world_timeout,
)
from .options import OPTION_NAMES, WrapKwargs, WrapOptions, takes_wrap_options, wrap_options
from .parallelize import dimensions as parallelize_dimensions
from .parallelize import parallelize
from .planning.plan import Plan
from .planning.planner import plan_for
from .runtime.agreement import check_agreement, check_sizes
from .runtime.dimension import base_plan
from .runtime.replaced import track_replaced
from .sp.sequence import sequence_layout
from .state import TPState, find_state
from .tp import lora_lift
from .tp.apply import parallel_layers
from .tp.float8 import refuse_torchao
from .tp.hooked import refuse_hooked_layers

log = logging.getLogger("autotp")


@takes_wrap_options
def wrap(model: nn.Module, tp_size: int, **kw: Unpack[WrapKwargs]) -> nn.Module:
    """Shard `model` over `tp_size` ranks in place and return it.

    TP groups are consecutive ranks; the rest of the world is data parallel. Under torchrun or
    accelerate, torch.distributed is initialised here if the script has not done it (NCCL on GPUs,
    gloo otherwise). `tp_size=1` needs no process group. Every check runs before the model is
    touched, so a refused call leaves it unchanged. The keyword options are documented once, on
    `autotp.options.WrapOptions`.
    """
    options = _options("wrap", tp_size, kw)
    check_versions()
    if find_state(model) is not None or parallel_layers(model):
        raise RuntimeError(f"{type(model).__name__} is already wrapped by autotp; wrap it once")
    before = dict(model.named_parameters())  # what an optimizer made before wrap holds
    lifted = lora_lift.lift(model)  # PEFT's LoRA before wrap: sharded as the layers it wraps, then put back around them
    try:
        refuse_adapters(model, options)
        state = _shard(model, tp_size, options)
    except BaseException:
        lora_lift.put_back(lifted)
        raise
    lora_lift.attach(model, lifted, state)
    state.replaced = track_replaced(
        before, model, "autotp.wrap"
    )  # such an optimizer's step refused where wrap put a new object
    adapters = frozenset(id(lora) for _, _, lora in lifted)
    for dimension in state.dims.values():
        dimension.after_wrap(model, state, adapters)
    device = device_of(state.tp_group)
    if device.type == "cuda":  # under NCCL: the shards to this rank's GPU
        model.to(device)
    return model


@takes_wrap_options
def from_pretrained(
    path: str | Path,
    tp_size: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    task: str | None = None,
    **hf_kwargs: Any,
) -> nn.Module:
    """A tensor-parallel model read straight into shards; equal to `wrap(AutoModelFor<task>.from_pretrained(path))`.

    The model is built on the meta device, planned like `wrap` plans it, and each rank reads only
    its rows of every sharded tensor (including its parts of fused ones). Only safetensors load.
    `task` is a key of `autotp.compat.hf.TASKS` ("causal-lm", "seq2seq", "image-text", ...); by
    default the one of the class named in the checkpoint's `config.architectures`. `dtype` and `device`
    place the shards; the keywords that are `wrap`'s options (`autotp.options.WrapKwargs`) are taken as `wrap` takes
    them, and the others (`hf_kwargs`) passed to transformers' `AutoConfig.from_pretrained`. (Typed `Any`: a type
    checker cannot type both; `help(autotp.from_pretrained)` lists the options.)
    """
    options = _options("from_pretrained", tp_size, {k: v for k, v in hf_kwargs.items() if k in OPTION_NAMES})
    hf_kwargs = {k: v for k, v in hf_kwargs.items() if k not in OPTION_NAMES}
    check_versions()
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    files = checkpoint_files(path)
    config = AutoConfig.from_pretrained(path, **hf_kwargs)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with init_empty_weights(include_buffers=False):
        model = build_model(config, task, dtype=dtype)
    model.tie_weights()  # tied parameters become one object, loaded once under whichever name the file has

    def load(state: TPState, unread: tuple[str, ...]) -> None:
        """`unread`: what the dimensions dropped before the read (at pp > 1, the layers other stages run)."""
        target = device_of(state.tp_group) if device is None else device
        load_params(model, files, torch.device(target), dtype, show=is_global_rank0(), unread=unread)
        model.to(target)  # buffers built at init

    _shard(model, tp_size, options, materialize=load, call="from_pretrained")
    if (path / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()  # as transformers' from_pretrained leaves it
    return model


@takes_wrap_options
def explain(model: nn.Module, tp_size: int, **kw: Unpack[WrapKwargs]) -> Plan:
    """The plan `wrap` would apply given the same arguments, without a process group; works on a meta-device model.

    It raises every refusal of `wrap`'s planning (`sequence_parallel` or `cp_size` the model cannot take included),
    so a call to `wrap` can be checked as is, before a launch. `tp_group`, `check_inputs`, `timeout`, `overlap` and
    `recompute_glu` shape the wrapped layers, not the plan: they are accepted and change nothing here.
    """
    return _plan(model, tp_size, _options("explain", tp_size, kw))


def _shard(
    model: nn.Module,
    tp_size: int,
    options: WrapOptions,
    materialize: Callable[[TPState, tuple[str, ...]], None] | None = None,
    call: str = "wrap",
) -> TPState:
    """The one sharding pipeline, all or nothing: every check runs before `parallelize` changes the model, and a
    failure in it puts the model back as it was.

    `materialize` replaces meta parameters once the plan is applied (`from_pretrained`).
    """
    error, plan = None, None
    try:
        if materialize is None:  # from_pretrained's model is on the meta device until `materialize`
            refuse_meta(model, call)
        plan = _plan(model, tp_size, options)
    except Exception as err:  # every rank must still hear of it below
        error = err
    if options.tp_group is not None or any(n > 1 for n in options.sizes().values()):
        if not dist.is_initialized() and launched_by_torchrun():  # the ranks then compare their plans over the world
            init_from_env(cast(timedelta | None, options.timeout) or DEFAULT_TIMEOUT)  # seconds made a timedelta
    _planned_everywhere(error, options, call)
    assert plan is not None  # always: planning that failed here (`error`) made `_planned_everywhere` raise
    mesh, timeout = _mesh(options)
    if mesh.grid is not None:  # at tp 1 (and every size 1) no collective: some ranks only may wrap
        check_agreement(model, tp_size, options, plan, mesh.compared(), call)
    state = parallelize(model, plan, mesh, replace(options, timeout=timeout), materialize)
    if is_global_rank0():
        log.info(plan.summary())
        for warning in plan.warnings():
            log.warning(warning)
    return state


def _plan(model: nn.Module, tp_size: int, options: WrapOptions) -> Plan:
    """The plan, and every refusal that needs no process group; nothing is changed."""
    refuse_quantized(model)
    refuse_torchao(model)  # float8 under a dimension not composed with it: that dimension's `refuse`
    plan = plan_for(model, tp_size, options)
    refuse_hooked_layers(model, plan)
    dimensions = parallelize_dimensions()
    for dimension in dimensions:  # each dimension's refusals (cp's and ep's), in `parallelize.steps`' order
        dimension.refuse(model, plan, options)
    if options.sequence_parallel:
        tp_plan, whole, _ = base_plan(dimensions, model, plan, options)
        sequence_layout(model, tp_plan, whole, full=plan)
    return plan


def _planned_everywhere(error: Exception | None, options: WrapOptions, call: str) -> None:
    """Raise on every rank if the ranks' sizes differ, or planning failed on any (`error`: this rank's), before the
    groups are created.

    A call that creates groups is collective over the world: a rank that refused alone, or built other groups, would
    leave the others waiting in the group creation until the timeout, with an error that names nothing. So every
    rank reports its sizes and its outcome first (one all-gather); on different sizes every rank raises one error that
    names them, else the failed rank raises its own error, the others one that names it. At tp 1 and cp 1 without a
    tp_group there is no collective (some ranks only may wrap), so the others can only name the likely cause.
    """
    collective = options.tp_group is not None or any(n > 1 for n in options.sizes().values())
    group = world() if collective else None
    sizes = (tuple(options.sizes().items()), options.tp_group is not None)
    with (
        nullcontext()
        if group is None
        else named_failure(
            group,
            f"comparing the ranks' sizes and plans in {call}",
            f"Every rank must call {call} with the same {options.size_words()}: a rank at "
            f"{options.size_words(1)} without tp_group runs no collective, and goes on alone (this rank called "
            f"{call} with {', '.join(f'{axis}_size={n}' for axis, n in options.sizes().items())}"
            f"{', tp_group given' if options.tp_group is not None else ''}). Nothing was changed.",
        )
    ):
        failed, sizes_by_rank = outcomes(error, group, sizes)
    check_sizes(cast(dict[int, tuple[tuple[tuple[str, int], ...], bool]], sizes_by_rank), call)  # each rank's `sizes`
    agree(
        error,
        group,
        f"{call} stopped on every rank because planning",
        f". Every rank must build the same model and call {call} with the same arguments: correct them on the rank "
        f"named. Nothing was changed.",
        failed,
    )


def _options(call: str, tp_size: int, keywords: Mapping[str, Any]) -> WrapOptions:
    """The entry point's `tp_size` and keyword options as `WrapOptions` (`autotp.options.wrap_options`: a keyword that
    is no field is refused), its sizes checked."""
    options = wrap_options(call, tp_size, keywords)
    for axis, size in options.sizes().items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"{axis}_size must be an int, got {type(size).__name__} {size!r}")
        if size < 1:
            raise ValueError(f"{axis}_size must be at least 1, got {size}")
    return options


def _mesh(options: WrapOptions) -> tuple[Mesh, timedelta]:
    """This rank's mesh and the timeout of its groups; torch.distributed was initialised from launcher variables, if
    needed, by `_shard`."""
    timeout, tp_group, sizes = cast(timedelta | None, options.timeout), options.tp_group, options.sizes()
    # (`WrapOptions.__post_init__` made a number of seconds a timedelta)
    if not dist.is_initialized():
        if tp_group is not None or any(n > 1 for n in sizes.values()):
            needs = next(
                (f"{axis}_size={n}" for axis, n in reversed(sizes.items()) if n > 1), f"tp_size={options.tp_size}"
            )
            raise RuntimeError(
                f"{needs} needs torch.distributed, which is "
                f"not initialised and no "
                f"launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are set. Launch with "
                f"`torchrun --nproc-per-node {math.prod(sizes.values())} your_script.py` or `accelerate launch`, "
                f"or call torch.distributed.init_process_group first."
            )
        return Mesh(), timeout or DEFAULT_TIMEOUT
    timeout = timeout or world_timeout()
    if tp_group is None and all(n == 1 for n in sizes.values()):  # no group and no collective: some ranks only may wrap
        return world_mesh(), timeout
    if tp_group is not None and group_size(tp_group) != options.tp_size:
        raise ValueError(f"tp_group has {group_size(tp_group)} ranks but tp_size={options.tp_size}")
    return build_mesh(sizes, timeout, tp_group), timeout
