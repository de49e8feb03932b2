"""The parallelisms applied to a planned model, in one place and in order; all or nothing.

`parallelize` runs after every check (planning, the ranks' agreement, the process groups), so the
model is changed only here, and a failure at any step puts it back exactly as it was
(`runtime.rollback.Snapshot`; each step that adds hooks on tensors the model keeps returns them).
Two lists, each step `step.apply(model, plan, state)` or `step(model, plan, state)`, returning what it installed:
`steps` (each dimension's step, `autotp.runtime.dimension.Dimension`, one line each, and the two steps between
them), then `integrations`, which act on the model all dimensions made. The order, and why:

1. `TensorParallelism`: the plan's layers, experts and heads (`autotp.tp`); under expert parallelism without the
   experts, which step 4 takes whole (`state.plan`, `autotp.runtime.dimension.base_plan`);
2. `VocabParallelism`: the LM head and embedding by vocabulary, after the layers (`autotp.vocab`);
3. `SequenceParallelism`: around the decoder layers just made parallel (`autotp.sp`);
4. `ExpertParallelism`: each MoE layer keeps its EP rank's experts and dispatches tokens to them (`autotp.ep`);
   before `materialize`, so that a load reads only this rank's experts;
5. `materialize`: `from_pretrained` reads each rank's slices into the sharded parameters (its experts whole), after
   each dimension's `before_load` (a pipeline drops the layers other stages run);
6. `GradientHooks`: gradient sums, on the parameters once they are final (`autotp.tp`);
7. `ContextParallelism`: after vocab parallelism's loss, which it wraps (`autotp.cp`);
8. `PipelineParallelism`: this rank's stages keep their layers, the others' pass through (`autotp.pp`); last, on
   the model the other dimensions made (their plan holds only this rank's layers: its `split_plan`);
9. `hf_methods`: transformers' `save_pretrained` and `resize_token_embeddings`;
10. `ddp_guard`: DDP over a wrong group refused (each dimension's `check_ddp`);
11. `input_check`: prepended, so it sees the caller's inputs;
12. `guards`: layers swapped, adapters loaded, state dicts, FSDP meshes (only with a TP group);
13. `float8_over_dp`: torchao float8 casts spanning the tokens scaled over DP (`autotp.tp.float8.scale_over_dp`);
14. `replica_broadcast`: last, as it writes once every rank has arrived; under CP at tp 1 too, as nothing else
    makes the CP ranks' weights equal; the experts over their expert-DP group (each dimension's part).

The active dimensions are kept by axis in `TPState.dims`, which the gradient sync, the norm, FSDP, the DDP guard,
saving and exporting loop over.

What the steps install outside the model's modules and parameters goes through `autotp.runtime.process_hooks`,
whose `live()` lists it; a rollback undoes it and none of it outlives the model:
- process-wide: one optimizer-step pre-hook (step 7's unsynced-step refusal, step 12's `MeshGuard`), CP's entries in
  transformers' attention and mask registries (step 7), torch's module forward pre-hook (step 10's `DDPGuard`, when
  DDP's constructor frame cannot be read), PEFT's `save_pretrained` and `update_layer` (step 12's adapters);
- on the model's objects: `generate` and the experts' `forward` (step 4), the decoder layers' `__class__` (step 3), the LM head's `__class__` (step 2: the chunked loss), the model's `forward` at pp > 1 (step 8),
  `loss_function` (steps 2 and 7), `save_pretrained` and `resize_token_embeddings` (step 9), DDP's ignore list
  (step 10), an unsharded torchao `Float8Linear`'s `forward` (step 13). `wrap` lifts PEFT's LoRA out before and puts it back after. FSDP2 is not a step:
`autotp.fully_shard(model)` stays the user's own call after `wrap`, as torch's `fully_shard` is.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .compat.torch import ddp_ignored
from .cp.dimension import ContextParallelism
from .ep.dimension import ExpertParallelism
from .integrations.guards import DDPGuard, InputCheck, MeshGuard, SwapGuard
from .integrations.hf_methods import ResizeTokenEmbeddings, SavePretrained
from .io.rollout.adapters import slice_adapters_on_load
from .mesh import Mesh, group_rank
from .options import WrapOptions
from .planning.plan import Plan
from .pp.dimension import PipelineParallelism
from .runtime.dimension import Dimension, Step, base_plan
from .runtime.process_hooks import patch_attribute, replace_ddp_ignored
from .runtime.replicas import broadcast_replicated
from .runtime.rollback import Removable, Snapshot
from .sp.dimension import SequenceParallelism
from .state import TPState, detach
from .tp.dimension import GradientHooks, TensorParallelism
from .tp.float8 import scale_over_dp
from .tp.state_dict import guard_state_dicts
from .vocab.dimension import VocabParallelism


def parallelize(
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    options: WrapOptions,
    materialize: Callable[[TPState, tuple[str, ...]], None] | None = None,
) -> TPState:
    """Apply `plan` and every parallelism `options` asks for to `model`, in the order the module docstring gives;
    returns the model's state. `materialize` replaces meta parameters once the plan is applied (`from_pretrained`),
    given the name prefixes of the tensors it need not read (each dimension's `before_load`)."""
    snapshot = Snapshot(model)
    ordered = steps(materialize)
    try:
        tp_plan, whole, found = base_plan([s for s in ordered if isinstance(s, Dimension)], model, plan, options)
        state = TPState(tp_plan, mesh, group_rank(mesh.tp), options, whole=whole, found=found)
        for step in ordered:
            snapshot.track(step.apply(model, plan, state))
        for integration in integrations():
            snapshot.track(integration(model, plan, state))
    except BaseException:
        snapshot.restore()
        detach(model)
        raise
    return state


def steps(materialize: Callable[[TPState, tuple[str, ...]], None] | None = None) -> list[Step]:
    """The dimensions' steps in order, new objects for one wrap: a dimension is one line here."""
    ordered: list[Step] = []
    ordered += [  # in place: `Materialize` reads the dimensions of this list
        TensorParallelism(),
        VocabParallelism(),
        SequenceParallelism(),
        ExpertParallelism(),
        Materialize(materialize, ordered),
        GradientHooks(),
        ContextParallelism(),
        PipelineParallelism(),
    ]
    return ordered


def dimensions() -> list[Dimension]:
    """The dimensions, in `steps`' order (their refusals run in `autotp.api`'s planning)."""
    return [step for step in steps() if isinstance(step, Dimension)]


def integrations() -> list[Callable[[nn.Module, Plan, TPState], list[Removable]]]:
    """The steps after the dimensions', in order, each acting on the model they all made."""
    return [hf_methods, ddp_guard, input_check, guards, float8_over_dp, replica_broadcast]


class Materialize:
    """`from_pretrained`'s load into the sharded parameters (nothing for `wrap`), after each dimension of `steps` has
    dropped what this rank will not hold (`before_load`)."""

    def __init__(self, load: Callable[[TPState, tuple[str, ...]], None] | None, steps: list[Step]):
        self.load, self.steps = load, steps

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        if self.load is not None:
            dims = [step for step in self.steps if isinstance(step, Dimension)]
            self.load(state, tuple(prefix for d in dims for prefix in d.before_load(model, state)))
        return []


def hf_methods(model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
    patch_attribute(model, "save_pretrained", SavePretrained(model, state))
    patch_attribute(model, "resize_token_embeddings", ResizeTokenEmbeddings(model, state))
    return []


def ddp_guard(model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
    replace_ddp_ignored(model, DDPGuard(model, ddp_ignored(model)))
    return []


def input_check(model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
    if state.options.check_inputs:
        model.register_forward_pre_hook(InputCheck(), with_kwargs=True, prepend=True)  # the caller's inputs
    return []


def guards(model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
    """At tp 1 nothing is sharded, so an adapter sees whole weights and no guard is needed."""
    if state.tp_group is None:
        return []
    tp_plan = state.plan
    guarded = [layer.path for layer in tp_plan.layers]
    if tp_plan.vocab is not None and tp_plan.vocab.embedding is not None:
        guarded.append(tp_plan.vocab.embedding)
    SwapGuard.install(model, {path: model.get_submodule(path) for path in guarded}, state)
    slice_adapters_on_load(model, state)
    guard_state_dicts(model, state)
    MeshGuard(model)
    return []


def float8_over_dp(model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
    scale_over_dp(model, state)
    return []


def replica_broadcast(model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
    """Replicated tensors from the group's first rank: over TP, and over DP x CP whenever any group exists; then each
    dimension's own copies (each expert from the first rank of its expert-DP group)."""
    broadcast_replicated(model, state.tp_group, state.dp_cp_group if state.mesh.grid is not None else None)
    for dimension in state.dims.values():
        dimension.broadcast_replicas(model, state)
    return []
