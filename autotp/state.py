"""A wrapped model's tensor-parallel state, and the one way to reach it.

`wrap` attaches a `TPState` to the model. Helpers such as `autotp.tp_group(model)` take the model;
without one they use the only wrapped model alive in the process, and refuse when there are
several (a policy model and a reference model in one RL script), rather than guess.
"""

from __future__ import annotations

import copy
import gc
import os
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Protocol, TypeVar, cast

from torch import nn
from transformers import PreTrainedModel

from .mesh import AXIS_TABLE, Group, Mesh
from .options import WrapOptions
from .planning.plan import Plan

_ATTR = "autotp_state"
Hook = TypeVar("Hook", bound=Callable)


class _Axis(Protocol):
    name: str  # the mesh axis a dimension (`autotp.runtime.dimension.Dimension`) is kept under in `TPState.dims`


D = TypeVar("D", bound=_Axis)
_live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # wrapped model -> the pid that wrapped it


@dataclass
class TPState:
    """What `wrap` attached to a model (as `model.autotp_state`): plan, groups, rank, gathered or not."""

    plan: Plan
    mesh: Mesh  # this rank's groups, by axis (autotp.mesh)
    tp_rank: int
    options: WrapOptions = field(default_factory=WrapOptions)  # what wrap was asked for, its timeout resolved
    gathered: bool = False
    regions: list = field(default_factory=list)  # ShardedRegion and VocabParallelEmbedding: gather_/partition_
    replica_groups: dict = field(default_factory=dict)  # TP ranks holding one replicated KV row -> their group
    swap_guards: list = field(
        default_factory=list
    )  # autotp.integrations.guards.SwapGuard: the slots of sharded modules watched
    vocab_hooks: list = field(default_factory=list)  # removable hooks vocab parallelism added
    full_loss: Callable | None = None  # the model's own loss function, for full-width logits
    forwards: int = 0  # the model's forwards running now (`entered`); outside them its LM head gathers its logits
    dp_cp_mesh: Any = None  # the DeviceMesh over dp_cp_group (autotp.dp.fsdp.dp_cp_mesh), built when first asked for
    fsdp: bool = False  # autotp.fully_shard applied: parameters are DTensors sharded over DP
    root: weakref.ref | None = None  # the wrapped model (`attach`), to tell a copy of the model from one of a part
    fsdp_sharded: frozenset = frozenset()  # names of TP-sharded parameters (FSDP's unsharded copies lack the tag)
    mesh_guard: Any = None  # autotp.integrations.guards.MeshGuard, kept alive by the model it watches
    dims: dict = field(default_factory=dict)  # the active dimensions by axis (autotp.runtime.dimension.Dimension)
    found: dict = field(default_factory=dict)  # what each dimension's split_plan found, by axis (the pipeline's cut)
    whole: tuple[str, ...] = ()  # modules a dimension keeps whole and splits itself (the experts at ep > 1)
    replaced: Any = None  # runtime.replaced.ReplacedParameters: an optimizer made before wrap is refused at its step

    def dim(self, kind: type[D]) -> D | None:
        """The active dimension of class `kind` (None: inactive), typed for its own package's use."""
        found = self.dims.get(kind.name)
        return found if isinstance(found, kind) else None

    def split_groups(self) -> list[Group]:
        """The groups the active dimensions split their own tensors over besides TP (the experts' EP group), which
        saving and exporting gather over."""
        return [group for group in (d.split_group() for d in self.dims.values()) if group is not None]

    def splits_sequence(self) -> bool:
        """Whether each rank's decoder layers hold part of the sequence (sequence or context parallelism)."""
        return any(d.splits_sequence for d in self.dims.values())

    def batch_groups(self) -> list[tuple[str, Group]]:
        """The groups besides TP whose ranks are each given the same whole batch (the CP group), by their label."""
        return [(AXIS_TABLE[d.name].label, g) for d in self.dims.values() if (g := d.batch_group()) is not None]

    def allows_ddp(self) -> bool:
        """Whether DDP can sync every gradient (not under expert parallelism: `autotp.allreduce_gradients` must)."""
        return all(d.allows_ddp for d in self.dims.values())

    @property
    def tp_group(self) -> Group:
        return self.mesh.tp

    @property
    def cp_group(self) -> Group:
        """The ranks splitting one sequence (None: cp_size 1)."""
        return self.mesh.cp

    @property
    def dp_group(self) -> Group:
        """The data-parallel replicas, which read different batches."""
        return self.mesh.dp

    @property
    def dp_cp_group(self) -> Group:
        """DP x CP, the ranks holding the same shards: gradients average here and FSDP shards here."""
        return self.mesh.dp_cp

    @property
    def timeout(self) -> timedelta:
        """What every group autotp creates for this model waits for a peer (resolved by `wrap`)."""
        return cast(timedelta, self.options.timeout)  # `wrap` resolved it to a timedelta

    # Gathered mode (GatherReplacedLayerParams): `gathered` is switched by `autotp.tp.apply.set_gathered` and
    # read only here, so no hook has to remember it.

    def sharded_only(self, hook: Hook) -> Hook:
        """`hook` (a module forward or pre-hook, or a tensor gradient hook) doing nothing while the model is gathered:
        it returns None then, which every kind of hook reads as "leave it as it is". Every autotp hook goes through
        this, since a gathered model computes as the original one, with no collective."""
        return ShardedOnly(self, hook)  # type: ignore[return-value]

    def __deepcopy__(self, memo: dict) -> TPState:
        """`copy.deepcopy(model)` (an EMA or reference model): the copy gets its own state, sharing the process groups
        (handles, not data), and counts as a wrapped model of its own. A part of the model copied alone (PEFT's
        modules_to_save) keeps this state: it still lives in this model."""
        root = None if self.root is None else self.root()
        if root is None or id(root) not in memo:
            return self
        self.refuse_gathered("copy.deepcopy of a wrapped model")
        for shared in (self.mesh, *self.mesh.groups.values(), self.dp_cp_mesh, *self.replica_groups.values()):
            memo[id(shared)] = shared
        new = copy.copy(self)
        memo[id(self)] = new
        _copy_parameter_tags(root, memo)
        for name, value in vars(self).items():
            if name != "root":
                setattr(new, name, copy.deepcopy(value, memo))
        new.root = weakref.ref(memo[id(root)])
        _live[memo[id(root)]] = os.getpid()
        return new

    def entered(self, module: nn.Module, args, kwargs) -> None:
        """The model's first forward pre-hook: one more of its forwards runs (the model may call itself). The count
        lives here, not on a hook's object, so a copy of one layer (PEFT's modules_to_save) reads the model's."""
        self.forwards += 1

    def left(self, module: nn.Module, args, kwargs, output) -> None:
        """The model's last forward hook, always called (a forward that raised included): one fewer runs."""
        self.forwards -= 1

    def is_gathered(self) -> bool:
        """Whether the model holds full weights now, for the entry points that act differently inside the context."""
        return self.gathered

    def refuse_gathered(self, action: str) -> None:
        """Stop `action`, which needs the sharded model, inside GatherReplacedLayerParams."""
        if self.gathered:
            raise RuntimeError(
                f"{action} inside GatherReplacedLayerParams: call it outside the context, on the sharded model"
            )


class ShardedOnly:
    """A hook that does nothing while the model is gathered (`TPState.sharded_only`). An object, not a closure, so
    that `copy.deepcopy(model)` binds the copy's hooks to the copy's state and objects (functions are not copied)."""

    # `wrapped`, not `hook`: torch's _WrappedHook (load pre-hooks) copies this object's attributes onto itself, and a
    # `hook` attribute would replace its own, so the hook would run unwrapped while the model is gathered.

    def __init__(self, state: TPState, hook: Callable):
        self.state, self.wrapped = state, hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return None if self.state.gathered else self.wrapped(*args, **kwargs)


def _copy_parameter_tags(model: nn.Module, memo: dict) -> None:
    """Give each parameter's deep copy the original's autotp attributes (`Parameter.__deepcopy__` drops them)."""
    for param in model.parameters():
        if vars(param):
            twin = copy.deepcopy(param, memo)
            for key, value in vars(param).items():
                if key not in vars(twin):
                    setattr(twin, key, copy.deepcopy(value, memo))


def attach(model: nn.Module, state: TPState) -> None:
    """Record `state` on `model` and count the model among the live wrapped ones."""
    setattr(model, _ATTR, state)
    state.root = weakref.ref(model)
    _live[model] = os.getpid()


def detach(model: nn.Module) -> None:
    """Forget `model` (its wrap was rolled back)."""
    _live.pop(model, None)
    vars(model).pop(_ATTR, None)


def find_state(model: nn.Module) -> TPState | None:
    """The model's state, or None for a model autotp has not wrapped; seen through the wrappers that hold a wrapped
    model (DDP's and Trainer's `.module`, PEFT's `PeftModel.base_model.model`)."""
    holder = wrapped_model(model)
    if holder is None:
        return None
    state = vars(holder)[_ATTR]
    refuse_torch_fsdp(holder, state)
    return state


def refuse_torch_fsdp(model: nn.Module, state: TPState, deep: bool = False) -> None:
    """Refuse a wrapped model that torch's own `fully_shard` sharded rather than `autotp.fully_shard`.

    FSDP's parameters lose `autotp_shard`, so the gradient norm, a saved checkpoint and the TP gradient
    corrections would be silently wrong. FSDP2 turns each module it shards into an `FSDPModule`: the
    root is checked by every helper taking the model, each submodule (`deep`) at a forward, clip or step.
    """
    from torch.distributed.fsdp import FSDPModule

    if state.fsdp:
        return
    modules = model.named_modules() if deep else [("", model)]
    path = next((name for name, module in modules if isinstance(module, FSDPModule)), None)
    if path is None:
        return
    name = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule)).__name__
    where = "the model" if path == "" else f"its submodule {path}"
    raise RuntimeError(
        f"autotp: torch.distributed.fsdp.fully_shard was applied directly to {where} ({name}, wrapped by autotp). "
        f"That drops autotp's partition metadata (autotp_shard) from the parameters, so clip_grad_norm_, "
        f"save_pretrained and the tensor-parallel gradient corrections would be silently wrong. Wrap the model "
        f"again and call autotp.fully_shard(model) instead: it applies torch's fully_shard over the data-parallel "
        f"group and keeps the metadata"
    )


def wrapped_model(model: nn.Module) -> nn.Module | None:
    """The model `wrap` sharded: `model` itself, or the one its wrappers hold (see `find_state`); else None."""
    for _ in range(4):
        if _ATTR in vars(model):  # its own: PEFT's wrappers pass attribute lookups on to the model inside
            return model
        if isinstance(model, PreTrainedModel):
            return None
        children = vars(model).get("_modules", {})  # registered children only, not attribute look-ups passed on
        model = next((children[name] for name in ("module", "base_model", "model") if name in children), None)
        if model is None:
            return None
    return None


def outside_module_holders(model: nn.Module) -> nn.Module:
    """`model` without the wrappers that hold it as `.module` (DDP, `AutoTPTrainer`'s `model_wrapped`): the names a
    checkpoint or an engine reads are the model's own, not their `module.`-prefixed state-dict keys."""
    while not isinstance(model, PreTrainedModel) and "module" in vars(model).get("_modules", {}):
        model = vars(model)["_modules"]["module"]
    return model


def state_of(model: nn.Module | None = None) -> TPState:
    """The state of `model`, or of the one wrapped model alive in this process when `model` is None."""
    if model is None:
        model = _only_wrapped_model()
    state = find_state(model)
    if state is None:
        raise RuntimeError(f"{type(model).__name__} is not wrapped by autotp: call autotp.wrap(model, tp_size) first")
    return state


def _only_wrapped_model() -> nn.Module:
    count = len(_wrapped_here())
    if count > 1:
        gc.collect()  # wrapped models hold reference cycles; count only the reachable ones
        count = len(_wrapped_here())
    if count == 1:
        return _wrapped_here()[0]
    # no model in this frame: a caught error's traceback must not keep any of them alive
    raise RuntimeError(
        f"{count} models wrapped by autotp are alive in this process; pass the model "
        f"(for example autotp.tp_group(model))"
        if count
        else "no model wrapped by autotp: call autotp.wrap first, or pass the wrapped model"
    )


def _wrapped_here() -> list[nn.Module]:
    """Wrapped models alive in this process, not counting those a forked parent wrapped."""
    pid = os.getpid()
    return [model for model, owner in list(_live.items()) if owner == pid]
