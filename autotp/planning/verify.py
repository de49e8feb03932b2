"""Verification by emulation: a derived plan keeps only the blocks whose sharded computation is provably exact."""

from __future__ import annotations

import copy
import inspect
import re
import traceback
from dataclasses import replace
from typing import Any, Collection, Mapping

import torch
from torch import nn

from ..compat.hf import failed_experts_kernel, is_conv1d, is_transformers_class
from ..compat.torchao import high_precision
from .plan import Plan, Replicated, Why
from .probe import probe_inputs

Verdicts = dict[tuple[str, type], str | None]  # (block pattern, class) -> None if exact, else why not


def verify_by_emulation(
    model: nn.Module, plan: Plan, only_custom: bool = False, example: Mapping[str, Any] | None = None
) -> Plan:
    """Keep only the blocks whose sharded computation provably reproduces the original (see `verdicts`)."""
    return apply_verdicts(model, plan, verdicts(model, plan, only_custom, example), only_custom, "")


def verdicts(
    model: nn.Module, plan: Plan, only_custom: bool = False, example: Mapping[str, Any] | None = None
) -> Verdicts:
    """For each (block pattern, class) the plan shards: None if its sharding is exact, else why not.

    The model runs once on a short random input while hooks record each block's inputs and output.
    Then, in this one process, every rank's shard of the block is computed from a copy holding
    only that rank's rows; the sum of those partial outputs must equal the recorded output. A
    block whose row projection is not its last step, or that holds parameters besides its
    projections (whose gradients would be partial), or whose sum differs, fails. One instance per
    (pattern, class) is checked, the first the probe reached: instances of one class run the same code. `only_custom` checks
    just blocks whose class is not transformers' own (a shipped policy is tested on those).
    Dropout is off while it runs; every module's mode is restored afterwards.

    The forward runs on `example` (the user's `example_inputs=`), else on `autotp.planning.probe` inputs. When it
    fails, a derived plan keeps every block replicated; an explicit one (the user's policy, a shipped one or
    transformers' `base_model_tp_plan`) is the user's decision, so that is refused with what to pass instead.
    """
    modules = dict(model.named_modules())
    blocks = _checked_blocks(modules, plan, only_custom)
    instances: dict[tuple, list[str]] = {}
    for block in blocks:
        instances.setdefault(_key(block, modules), []).append(block)
    if not instances:
        return {}
    modes = {m: m.training for m in model.modules()}
    model.eval()  # dropout would make the replays differ from the recording
    try:
        with high_precision(model):  # float8 layers checked in their weights' dtype (autotp.compat.torchao)
            records, problem = _record(model, set(blocks), plan, example)
            found = {}
            for key, members in instances.items():
                # the first instance the probe reached: a router may send no token to some experts
                block = next((b for b in members if records.get(b)), members[0])
                found[key] = problem or _check_block(modules[block], block, plan, records.get(block))
        return found
    finally:
        for module, training in modes.items():
            module.training = training


def apply_verdicts(model: nn.Module, plan: Plan, found: Verdicts, only_custom: bool, missing: str) -> Plan:
    """`plan` without the blocks that failed verification, or that have no verdict (`missing` says why)."""
    modules = dict(model.named_modules())
    reasons = {}
    for block in _checked_blocks(modules, plan, only_custom):
        key = _key(block, modules)
        reason = found[key] if key in found else missing or "it was never checked"
        if reason:
            reasons[block] = reason
    return without_blocks(plan, reasons)


def without_blocks(plan: Plan, reasons: dict[str, str]) -> Plan:
    """`plan` without the blocks in `reasons` (their layers replicated, with the reason) and what it plans inside."""
    if not reasons:
        return plan
    rejected = set(reasons)
    kept = tuple(layer for layer in plan.layers if layer.block not in rejected)
    replicated = plan.replicated + tuple(
        (layer.path, Why(Replicated.NOT_VERIFIED, reasons[layer.block]))
        for layer in plan.layers
        if layer.block in rejected
    )
    all_blocks = sorted({layer.block for layer in plan.layers}, key=len, reverse=True)

    def inside(path: str) -> bool:
        """Whether the innermost planned block holding `path` was rejected (blocks nest: a layer holds its attention)."""
        owner = next((b for b in all_blocks if path == b or path.startswith(b + ".")), None)
        return owner in rejected

    return replace(
        plan,
        layers=kept,
        replicated=replicated,
        attrs=tuple(a for a in plan.attrs if not inside(a.path)),
        head_norms=tuple(h for h in plan.head_norms if not inside(h)),
        params=tuple(p for p in plan.params if p.block not in rejected and not inside(p.path)),
        states=tuple(s for s in plan.states if s.path not in rejected),
        whole=tuple(w for w in plan.whole if not inside(w)),
        gathered_outputs=tuple(g for g in plan.gathered_outputs if g in {layer.path for layer in kept}),
        head_inputs=tuple(h for h in plan.head_inputs if not inside(h.path)),
        attention=tuple(a for a in plan.attention if not inside(a.path)),
        norms=tuple(n for n in plan.norms if not inside(n.path)),
    )


def _checked_blocks(modules: dict[str, nn.Module], plan: Plan, only_custom: bool) -> list[str]:
    blocks = sorted({layer.block for layer in plan.layers if layer.block})
    if only_custom:
        blocks = [b for b in blocks if not is_transformers_class(modules[b])]
    return blocks


def _key(block: str, modules: dict[str, nn.Module]) -> tuple[str, type]:
    return _pattern(block), type(modules[block])


def _pattern(path: str) -> str:
    """`path` with its indices as `*`: layer numbers, and numbered siblings such as `experts.expert_3`."""
    return ".".join(re.sub(r"\d+$", "*", part) for part in path.split("."))


def _first_tensor(value):
    if torch.is_tensor(value):
        return value
    if isinstance(value, (tuple, list)) and value and torch.is_tensor(value[0]):
        return value[0]
    return getattr(value, "last_hidden_state", None)


def _record(
    model: nn.Module, blocks: set[str], plan: Plan, example: Mapping[str, Any] | None
) -> tuple[dict, str | None]:
    """Each block's (args, kwargs, output, its row projection's output) from one forward on probe inputs."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return {}, "the model is on the meta device, so nothing could be run"
    modules = dict(model.named_modules())
    row_layers = {layer.block: layer.path for layer in plan.layers if layer.style == "row" and layer.block in blocks}
    records: dict[str, dict] = {b: {} for b in blocks}
    handles = []
    for block in blocks:

        def on_block(module, args, kwargs, output, block=block):
            if "output" not in records[block]:
                records[block].update(args=args, kwargs=kwargs, output=_first_tensor(output))

        handles.append(modules[block].register_forward_hook(on_block, with_kwargs=True))
        if block in row_layers:

            def on_row(module, args, output, block=block):
                records[block].setdefault("row_output", output)

            handles.append(modules[row_layers[block]].register_forward_hook(on_row))
    try:
        with torch.no_grad():
            inputs = probe_inputs(model) if example is None else _on_device(example, model)
            try:
                model(**inputs, use_cache=False)  # a cache would be mutated by the replays
            except TypeError:
                model(**inputs)
    except Exception as err:  # any failure means we cannot verify, so nothing derived is sharded
        if plan.origin.checked_by_hand or plan.origin.from_hf_plan or example is not None:
            raise ValueError(_unverifiable(model, plan, example, err)) from err
        return {}, f"a probe forward failed ({_what(err, 120)})"
    finally:
        for handle in handles:
            handle.remove()
    return records, None


def _on_device(example: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    device = next(model.parameters()).device
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in example.items()}


def _unverifiable(model: nn.Module, plan: Plan, example: Mapping[str, Any] | None, err: Exception) -> str:
    """Why an explicit plan cannot be applied: the forward that verifies it failed, and what to pass instead."""
    try:
        signature = str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        signature = "(...)"
    tried = "autotp's probe inputs (token ids)" if example is None else "your example_inputs"
    kernel = failed_experts_kernel(model, err)
    if kernel is not None:
        return (
            f"{type(model).__name__}: the forward that verifies the plan from the {plan.origin.value} failed "
            f"inside transformers' {kernel} experts kernel, not in autotp: {_what(err, 300)} ({_raised_at(err)}). "
            f'The model fails the same way in one process. Load it with experts_implementation="eager" '
            f'(from_pretrained(..., experts_implementation="eager"), or model.set_experts_implementation('
            f'"eager")), then wrap it. Nothing was changed.'
        )
    return (
        f"{type(model).__name__}: the plan from the {plan.origin.value} shards blocks that autotp must verify by "
        f"running the model once, and that forward on {tried} failed ({_what(err, 160)}). "
        f"{type(model).__name__}.forward takes {signature}: pass example_inputs={{name: tensor, ...}} (forward "
        f"keyword arguments for a small batch) to autotp.wrap or autotp.from_pretrained. Nothing was changed."
    )


def _raised_at(err: BaseException) -> str:
    """Where `err` was raised: the innermost frame of its traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    return f"raised in {frames[-1].name}, {frames[-1].filename}:{frames[-1].lineno}" if frames else "raised"


def _what(err: Exception, width: int) -> str:
    """An exception as one short line: its type, and its message's first line if it has one."""
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0][:width]}" if lines else type(err).__name__


def _check_block(block: nn.Module, path: str, plan: Plan, record: dict | None) -> str | None:
    """None if the per-rank partial outputs of `block` sum to its recorded output, else why not."""
    if not record or record.get("output") is None:
        return "the probe forward never reached this block"
    if not _scaled_row_output(record):
        return (
            "its output is not the row projection's output (nor a constant multiple of it), so the reduction point "
            "cannot be checked"
        )
    layers = [layer for layer in plan.layers if layer.block == path]
    sharded = {id(p) for layer in layers for p in block.get_submodule(layer.path[len(path) + 1 :]).parameters()}
    extra = [name for name, p in block.named_parameters() if id(p) not in sharded]
    # per-head norms (gradients summed), and what the mixer computes whole on its replicated input: the column
    # projections reading it all-reduce their input's gradient, so its gradient is whole on every rank
    allowed = {h[len(path) + 1 :] for h in (*plan.head_norms, *plan.whole) if h.startswith(path + ".")}
    in_place = {p.path[len(path) + 1 :] for p in plan.params if p.block == path}
    extra = [name for name in extra if not under(name.rsplit(".", 1)[0], allowed) and name not in in_place]
    if extra:
        return f"it holds parameters besides its projections ({extra[0]}), whose gradients would be partial"
    attrs = [a for a in plan.attrs if a.path == path or a.path.startswith(path + ".")]
    dtype = record["output"].dtype  # before the sum is taken in fp32: it picks the tolerance
    expected = record["output"].float()
    total = torch.zeros_like(expected)
    for rank in range(plan.tp_size):
        try:
            total += _partial(block, path, layers, attrs, rank, record, plan).float()
        except Exception as err:  # the block cannot run on a shard at all: keep it whole
            return f"a shard of it fails to run ({_what(err, 100)})"
    gap = (total - expected).abs().max().item()
    scale = expected.abs().max().item() or 1.0
    tolerance = _relative_tolerance(dtype) * scale
    if not gap <= tolerance:
        return f"the sum of the emulated shards differs from the block's output by {gap:.3g} (scale {scale:.3g})"
    return None


def _scaled_row_output(record: dict) -> bool:
    """Whether the block's recorded output is its row projection's (that very tensor, or it times a constant c).

    The row layer all-reduces its own output, so what the block does after it runs on the whole sum. A constant
    factor (Falcon-H1's MLP multiplies down_proj's output by `down_multiplier`) is elementwise and linear: the
    emulated sum of the shards' outputs still proves the column side exact, and a factor that depends on the
    partial sums (a non-linear mix of them) makes that sum differ, so the block is refused there.
    """
    output, row = record.get("output"), record.get("row_output")
    if row is output:
        return True
    if not isinstance(row, torch.Tensor) or not isinstance(output, torch.Tensor) or row.shape != output.shape:
        return False
    row64, output64 = row.double(), output.double()
    norm = (row64 * row64).sum().item()
    factor = (output64 * row64).sum().item() / norm if norm else 0.0  # c by least squares
    gap = (output64 - factor * row64).abs().max().item()
    return bool(factor) and gap <= _relative_tolerance(output.dtype) * (output64.abs().max().item() or 1.0)


def under(path: str, paths: Collection[str]) -> bool:
    """Whether the module `path` is one of `paths`, or lies under one of them."""
    return any(path == p or path.startswith(p + ".") for p in paths)


def _relative_tolerance(dtype: torch.dtype) -> float:
    """How far the summed shards may stray, relative to the output's largest entry: the rounding of `dtype`.

    A partial output is rounded to `dtype` on each rank before the sum, so the sum differs from the whole block's
    by a few units in the last place: 2e-2 covers bf16's 2**-8 (and fp16's); fp32 and wider need 1e-4. A wrong
    sharding is off by a good part of the scale.
    """
    return 1e-4 if torch.finfo(dtype).bits >= 32 else 2e-2


def _partial(block: nn.Module, path: str, layers, attrs, rank: int, record: dict, plan: Plan) -> torch.Tensor:
    """One rank's partial output: a copy of `block` holding only that rank's rows (row bias on rank 0)."""
    clone = copy.deepcopy(block)
    for param in (p for p in plan.params if p.block == path):
        owner, _, name = param.path[len(path) + 1 :].rpartition(".")
        module = clone.get_submodule(owner)
        setattr(module, name, nn.Parameter(param.partition.shard(getattr(module, name).detach(), rank)))
    for layer in layers:
        linear = clone.get_submodule(layer.path[len(path) + 1 :])
        linear.weight = nn.Parameter(layer.partition.shard(linear.weight.detach(), rank))
        if linear.bias is not None:
            bias = linear.bias.detach()
            bias = (
                layer.partition.with_dim(0).shard(bias, rank)
                if layer.style == "column"
                else (bias if rank == 0 else torch.zeros_like(bias))
            )
            linear.bias = nn.Parameter(bias)
        if is_conv1d(linear):
            linear.nf = linear.weight.shape[1]
        else:
            linear.out_features, linear.in_features = linear.weight.shape
    for attr in attrs:
        target = clone.get_submodule(attr.path[len(path) + 1 :]) if attr.path != path else clone
        if attr.name.startswith("config."):
            target.config = copy.copy(target.config)  # the clone's own head counts
        attr.assign(target, attr.local[rank])
    with torch.no_grad():
        return _first_tensor(clone(*record["args"], **record["kwargs"]))
