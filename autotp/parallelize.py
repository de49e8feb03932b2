"""The parallelisms applied to a planned model, in one place and in order; all or nothing.

`parallelize` runs after every check (planning, the ranks' agreement, the process groups), so the
model is changed only here, and a failure at any step puts it back exactly as it was
(`runtime.rollback.Snapshot`; each step that adds hooks on tensors the model keeps returns them).
The order, and why:

1. `tensor_parallel`: the plan's layers, experts and heads (`autotp.tp`); under expert parallelism without the
   experts, which step 4 takes whole;
2. `vocab_parallel`: the LM head and embedding by vocabulary, after the layers (`autotp.vocab`);
3. `sequence_parallel`: around the decoder layers just made parallel (`autotp.sp`);
4. `expert_parallel`: each MoE layer keeps its EP rank's experts and dispatches tokens to them (`autotp.ep`);
   before `materialize`, so that a load reads only this rank's experts;
5. `materialize`: `from_pretrained` reads each rank's slices into the sharded parameters (its experts whole);
6. `register_grad_hooks`: gradient sums, on the parameters once they are final;
7. `context_parallel`: after vocab parallelism's loss, which it wraps (`autotp.cp`);
8. `hf_methods`: transformers' `save_pretrained` and `resize_token_embeddings`;
9. `ddp_guard`: DDP over a wrong group refused;
10. `input_check`: prepended, so it sees the caller's inputs;
11. `guards`: layers swapped, adapters loaded, state dicts, FSDP meshes (only with a TP group);
12. `replica_broadcast`: last, as it writes once every rank has arrived; under CP at tp 1 too, as nothing else
    makes the CP ranks' weights equal; the experts over their expert-DP group.

`wrap` lifts PEFT's LoRA out before and puts it back after. FSDP2 is not a step: `autotp.fully_shard(model)`
stays the user's own call after `wrap`, as torch's `fully_shard` is.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .compat.torch import ddp_ignored
from .ep.apply import broadcast_experts, dense_plan, expert_parallel, expert_paths
from .integrations.guards import ContextDDPGuard, DDPGuard, InputCheck, MeshGuard, SwapGuard
from .integrations.hf_methods import ResizeTokenEmbeddings, SavePretrained
from .io.rollout.adapters import slice_adapters_on_load
from .cp import apply as context
from .tp.apply import apply_plan, register_grad_hooks
from .mesh import Mesh
from .runtime.process_hooks import patch_attribute, replace_ddp_ignored
from .runtime.replicas import broadcast_replicated
from .runtime.rollback import Snapshot, Removable
from .sp.sequence import apply_sequence_parallel
from .state import TPState, detach
from .tp.state_dict import guard_state_dicts
from .vocab.apply import vocab_parallel
from .options import WrapOptions
from .planning.plan import Plan


def parallelize(model: nn.Module, plan: Plan, mesh: Mesh, options: WrapOptions,
                materialize: Callable[[TPState], None] | None = None) -> TPState:
    """Apply `plan` and every parallelism `options` asks for to `model`, in the order the module docstring gives;
    returns the model's state. `materialize` replaces meta parameters once the plan is applied (`from_pretrained`)."""
    snapshot = Snapshot(model)
    try:
        dense = dense_plan(plan, options)
        state = tensor_parallel(model, dense, mesh, options)
        vocab_parallel(model, dense, state)
        snapshot.track(sequence_parallel(model, dense, state, options, expert_paths(model, plan, options)))
        expert_parallel(model, plan, mesh, state)
        if materialize is not None:
            materialize(state)
        snapshot.track(register_grad_hooks(model, state))
        snapshot.track(context_parallel(model, state, options))
        hf_methods(model, state)
        ddp_guard(model, state)
        input_check(model, options)
        guards(model, dense, state)
        replica_broadcast(model, state)
    except BaseException:
        snapshot.restore()
        detach(model)
        raise
    return state


def tensor_parallel(model: nn.Module, plan: Plan, mesh: Mesh, options: WrapOptions) -> TPState:
    """The plan's parallel layers; the state every later step reads."""
    return apply_plan(model, plan, mesh, options)


def sequence_parallel(model: nn.Module, plan: Plan, state: TPState, options: WrapOptions,
                      experts: tuple[str, ...]) -> list[Removable]:
    if not options.sequence_parallel:
        return []
    return apply_sequence_parallel(model, plan, state.tp_group, state, experts)


def context_parallel(model: nn.Module, state: TPState, options: WrapOptions) -> list[Removable]:
    state.context = context.install(model, state.cp_group, state, options.cp_size)
    return [] if state.context is None else [state.context]


def hf_methods(model: nn.Module, state: TPState) -> None:
    patch_attribute(model, "save_pretrained", SavePretrained(model, state))
    patch_attribute(model, "resize_token_embeddings", ResizeTokenEmbeddings(model, state))


def ddp_guard(model: nn.Module, state: TPState) -> None:
    guard = DDPGuard if state.cp_group is None else ContextDDPGuard
    replace_ddp_ignored(model, guard(model, ddp_ignored(model)))


def input_check(model: nn.Module, options: WrapOptions) -> None:
    if options.check_inputs:
        model.register_forward_pre_hook(InputCheck(), with_kwargs=True, prepend=True)  # the caller's inputs


def guards(model: nn.Module, plan: Plan, state: TPState) -> None:
    """At tp 1 nothing is sharded, so an adapter sees whole weights and no guard is needed."""
    if state.tp_group is None:
        return
    guarded = [layer.path for layer in plan.layers]
    if plan.vocab is not None and plan.vocab.embedding is not None:
        guarded.append(plan.vocab.embedding)
    SwapGuard.install(model, {path: model.get_submodule(path) for path in guarded}, state)
    slice_adapters_on_load(model, state)
    guard_state_dicts(model, state)
    MeshGuard(model)


def replica_broadcast(model: nn.Module, state: TPState) -> None:
    """Replicated tensors from the group's first rank: over TP, and over DP x CP whenever any group exists; each
    expert from the first rank of its expert-DP group."""
    broadcast_replicated(model, state.tp_group, state.grad_group if state.mesh.grid is not None else None)
    broadcast_experts(model, state)
