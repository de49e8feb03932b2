"""2-D parallelism on PyTorch's FSDP2: each TP shard is sharded again over the data-parallel group.

`fully_shard` applies `torch.distributed.fsdp.fully_shard` over the DP mesh (`dp_cp_mesh`) to each
decoder layer, then to the root, exactly as a user would; nothing of FSDP is reimplemented. Under context
parallelism the mesh is DP x CP (the ranks holding the same TP shard), as torchtitan shards: FSDP's average over
it sums each CP rank's gradient share (`autotp.cp.apply`) and averages over DP. The
parameters FSDP builds keep their partition metadata (`autotp_shard`), and autotp's gradient
corrections (replicated KV rows, per-head and sequence-parallel norms) run on the unsharded
parameters FSDP computes with, before FSDP reduce-scatters over DP (`autotp.runtime.grad_hooks.GradHook`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..compat.hf import adapter_module
from ..compat.torch import is_fsdp_hook
from ..mesh import device_of, group_size
from ..runtime.replaced import track_replaced
from ..runtime.rows import local_rows
from ..state import TPState, state_of, wrapped_model


def dp_cp_mesh(model: nn.Module | None = None) -> DeviceMesh:
    """The 1-D device mesh over the ranks holding `model`'s shards, which `autotp.fully_shard` shards over (DTensor
    work over DP can use it too): the data-parallel group, or DP x CP (`autotp.dp_cp_group`) under context
    parallelism. torch's own `fully_shard` on a wrapped model is refused: use `autotp.fully_shard`."""
    state = state_of(model)
    if state.dp_cp_mesh is None:
        state.dp_cp_mesh = DeviceMesh.from_group(state.dp_cp_group, device_of(state.dp_cp_group).type)
    return state.dp_cp_mesh


dp_mesh = dp_cp_mesh  # its name before DP x CP had one name everywhere; kept for scripts that use it


def fully_shard(
    model: nn.Module, *, reshard_after_forward: bool = True, mp_policy: Any = None, offload_policy: Any = None
) -> nn.Module:
    """FSDP2 over the data-parallel group (DP x CP under context parallelism) on a wrapped model: each decoder layer,
    then the root; returns the model. Under expert parallelism each experts module is first sharded over its
    expert-DP group (`autotp.ep.fsdp`).

    Parameters, gradients and optimizer state are then split over TP and DP. `reshard_after_forward=False`
    keeps the gathered parameters from forward to backward (ZeRO-2). `mp_policy` and `offload_policy` are
    FSDP's (`MixedPrecisionPolicy`, `CPUOffloadPolicy`). Build the optimizer after this call.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    root = wrapped_model(model)
    if root is None:
        raise RuntimeError(
            f"autotp.fully_shard: {type(model).__name__} is not wrapped by autotp. Call "
            f"autotp.wrap(model, tp_size) first, then autotp.fully_shard(model)"
        )
    state = state_of(root)
    if state.fsdp:
        raise RuntimeError(f"{type(root).__name__} is already sharded by autotp.fully_shard; call it once")
    if state.is_gathered():
        raise RuntimeError("autotp.fully_shard inside GatherReplacedLayerParams: call it on the sharded model")
    found = adapter_module(root)
    if found is not None:
        raise NotImplementedError(
            f"autotp.fully_shard: {found[0]} is a {found[1]}; PEFT adapters under FSDP are not "
            f"supported yet. An adapter's trainable state is small: train it with DDP over "
            f"autotp.dp_group (AutoTPTrainer does)"
        )
    mesh = dp_cp_mesh(root)
    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    before = dict(root.named_parameters())  # what an optimizer made before this call holds
    shards = {
        name: p.autotp_shard for name, p in root.named_parameters(remove_duplicate=False) if hasattr(p, "autotp_shard")
    }
    experts: dict = {}  # each dimension's own (the experts, over expert-DP: autotp.ep.fsdp), before the layers
    for dimension in state.dims.values():
        experts.update(dimension.fully_shard(options, state))
    for unit in decoder_layers(root, state):
        torch_fully_shard(unit, **options)
    torch_fully_shard(root, **options)
    tagged = []
    for name, param in root.named_parameters(remove_duplicate=False):
        if name in shards:
            param.autotp_shard = shards[name]
        if id(param) in experts:  # an EP rank's experts, sharded over expert-DP first (autotp.ep.fsdp)
            param.autotp_expert = experts[id(param)]
            tagged.append(name)
    state.fsdp, state.fsdp_sharded = True, frozenset(shards) | frozenset(tagged)
    state.replaced = track_replaced(before, root, "autotp.fully_shard", state.replaced)  # its step refused by name
    return model


def decoder_layers(model: nn.Module, state: TPState) -> list[nn.Module]:
    """The modules FSDP wraps one by one: each list element (decoder layer) holding sharded layers, in model order."""
    found: dict[str, nn.Module] = {}
    for layer in state.plan.layers:
        parts = layer.path.split(".")
        for end in range(1, len(parts)):  # the outermost list: decoder layers, not the MoE experts inside one
            if isinstance(model.get_submodule(".".join(parts[: end - 1])), nn.ModuleList):
                path = ".".join(parts[:end])
                found[path] = model.get_submodule(path)
                break
    order = {id(module): i for i, module in enumerate(model.modules())}
    return sorted(found.values(), key=lambda module: order[id(module)])


def check_mesh(param: torch.Tensor, tp_group: Any) -> None:
    """Refuse an FSDP/DTensor mesh that holds two ranks of one TP group: it would average different shards."""
    if not isinstance(param, DTensor) or group_size(tp_group) == 1:
        return
    members = set(param.device_mesh.mesh.flatten().tolist())
    shared = sorted(members & set(dist.get_process_group_ranks(tp_group)))
    if len(shared) > 1:
        raise RuntimeError(
            f"FSDP over ranks {sorted(members)} would shard and average different tensor-parallel shards together "
            f"(ranks {shared} hold different shards of the same tensors). Wrap the model again and shard it with "
            f"autotp.fully_shard(model), which uses the data-parallel group and keeps autotp's partition metadata"
        )


_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)  # where FSDP2 hooks into a module


class Unsharded:
    """Inside, a model under `fully_shard` holds plain parameters, each rank's whole TP shard, and FSDP's module
    hooks are paused, so the model runs and loads as without FSDP (`GatherReplacedLayerParams` then gathers over
    TP as usual). On exit, values and gradients go back into this rank's DP rows of FSDP's parameters, and FSDP's
    hooks return in their order. Collective over DP on entry; every rank enters together."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.swaps: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        self.paused: list[tuple[dict, dict]] = []

    def __enter__(self) -> None:
        plain: dict[int, nn.Parameter] = {}
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if not isinstance(param, DTensor):
                    continue
                if id(param) not in plain:  # a tied parameter is one tensor again
                    with torch.no_grad():
                        whole = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
                    if hasattr(param, "autotp_shard"):
                        whole.autotp_shard = param.autotp_shard
                    plain[id(param)] = whole
                module._parameters[name] = plain[id(param)]
                self.swaps.append((module, name, param, plain[id(param)]))
        for module in self.model.modules():
            for attr in _HOOKS:
                hooks = getattr(module, attr)
                ours = [key for key, hook in hooks.items() if is_fsdp_hook(hook)]
                if ours:
                    self.paused.append((hooks, dict(hooks)))
                    for key in ours:
                        del hooks[key]

    def __exit__(self, *exc: Any) -> None:
        for hooks, before in self.paused:
            added = {key: hook for key, hook in hooks.items() if key not in before}
            hooks.clear()
            hooks.update(before)
            hooks.update(added)
        done: set[int] = set()
        for module, name, sharded, whole in self.swaps:
            module._parameters[name] = sharded
            if id(sharded) in done:
                continue
            done.add(id(sharded))
            local, first = local_rows(sharded)
            with torch.no_grad():
                local.copy_(whole.detach().narrow(0, first, local.shape[0]))
            if whole.grad is not None:
                rows = whole.grad.narrow(0, first, local.shape[0])
                if sharded.grad is None:
                    sharded.grad = DTensor.from_local(
                        rows.clone(),
                        sharded.device_mesh,
                        sharded.placements,
                        run_check=False,
                        shape=sharded.shape,
                        stride=sharded.stride(),
                    )
                else:
                    sharded.grad.to_local().add_(rows)
        self.swaps, self.paused = [], []
