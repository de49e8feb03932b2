"""Everything a wrap installs outside the model's own modules and parameters, in one module; `live()` lists it.

Process-wide, shared by the wrapped models of the process (`hold`): installed for the first model that needs it,
removed once the last is rolled back or garbage-collected (owners are held weakly):
- `watch_optimizer_steps`: one torch optimizer-step pre-hook (`register_optimizer_step_pre_hook`) running each live
  owner's check: context parallelism's refusal of a step on gradients not summed over CP (`autotp.cp.apply`), and
  the mesh guard's refusal of torch's `fully_shard` or a mesh mixing TP ranks (`autotp.integrations.guards.MeshGuard`).
  Never removed while a step iterates the hooks (`compat.torch.optimizer_step_running`): then at the next call here;
- `register_attention`: CP's attention and mask functions in transformers' `ALL_ATTENTION_FUNCTIONS` and
  `ALL_MASK_ATTENTION_FUNCTIONS` (`autotp_cp_<implementation>`, shared by the CP models of that implementation);
- `module_forward_pre_hook`: torch's process-wide module forward pre-hook, by which `DDPGuard` checks DDP's group at
  its first forward when DDP's constructor frame cannot be read (one per guard, removed once it has run);
- `patch_class_attribute`: PEFT's `PeftModel.save_pretrained` and `lora.Linear.update_layer`
  (`autotp.io.rollout.adapters`).

On the model's own objects, gone with the model and undone by a rollback (`patch_attribute`, `replace_ddp_ignored`):
`model.generate` (`autotp.ep.apply`, `autotp.pp.dimension`), an experts module's `forward` (`autotp.ep.dispatch`), each decoder layer's
`__class__` (`autotp.sp.sequence`), `loss_function` (`autotp.vocab.apply`, `autotp.cp.apply`), `save_pretrained`
and `resize_token_embeddings` (`autotp.integrations.hf_methods`), and DDP's ignore list (`DDPGuard`,
`compat.torch.set_ddp_ignored`).

`wrap`'s rollback (`runtime.rollback.Snapshot`) undoes every entry made since its `mark()`. autotp's own caches of
classes (`autotp.sp.sequence`, `autotp.runtime.lazy_logits`) hold types, never a model, and are not listed.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..compat.hf import register_function
from ..compat.torch import optimizer_step_running, set_ddp_ignored

OPTIMIZER_STEP_PRE_HOOK = "optimizer step pre-hook"
MODULE_FORWARD_PRE_HOOK = "module forward pre-hook"
ATTENTION_FUNCTION = "attention function"
MASK_FUNCTION = "mask function"
CLASS_ATTRIBUTE = "class attribute"
ATTRIBUTE = "attribute"
Owner = TypeVar("Owner")


@dataclass(frozen=True, eq=False)
class Effect:
    """One live effect: its kind, where it is (the registry key or attribute name) and the object installed (a hook
    or function), or, for an attribute, the object patched."""

    kind: str
    where: str
    value: Any


_serials = itertools.count()


class _Entry:
    """Something installed that a rollback (`undo_since`) or its owner's end takes out again."""

    def __init__(self) -> None:
        self.serial, self.removed = next(_serials), False
        _ENTRIES[self.serial] = self

    def remove(self) -> None:
        if not self.removed:
            self.removed = True
            _ENTRIES.pop(self.serial, None)
            self._undo()

    def _undo(self) -> None:
        raise NotImplementedError

    def effects(self) -> list[Effect]:
        return []


_ENTRIES: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()  # live entries by serial


class _Shared:
    """A process-wide effect installed once for all its holders: `install()` returns its undo and what it listed."""

    def __init__(
        self, key: str, install: Callable[[], tuple[Callable[[], None], list[Effect]]], safe: Callable[[], bool]
    ):
        self.key, self.safe, self.holds = key, safe, 0
        self.undo, self.effects = install()


_SHARED: dict[str, _Shared] = {}
_RETIRED: list[_Shared] = []  # shared effects no one holds, waiting for a moment when removing them is safe


class Hold(_Entry):
    """One owner's claim on a shared process-wide effect: ends on `remove()` or when the owner is collected."""

    def __init__(self, shared: _Shared, owner: object):
        super().__init__()
        self.shared = shared
        shared.holds += 1
        self._finalizer = weakref.finalize(owner, self.remove)
        self._finalizer.atexit = False

    def _undo(self) -> None:
        self._finalizer.detach()
        self.shared.holds -= 1
        if self.shared.holds == 0:
            _RETIRED.append(self.shared)
            _flush()


def _flush() -> None:
    for shared in list(_RETIRED):
        if shared.holds == 0 and shared.safe():
            _RETIRED.remove(shared)
            del _SHARED[shared.key]
            shared.undo()
        elif shared.holds:
            _RETIRED.remove(shared)  # held again meanwhile


def hold(
    key: str,
    owner: object,
    install: Callable[[], tuple[Callable[[], None], list[Effect]]],
    safe: Callable[[], bool] = lambda: True,
    kind: type[Hold] = Hold,
) -> Hold:
    """The process-wide effect `key` held by `owner` (installed by `install` if no one holds it yet; removed, once
    no one does, when `safe()`)."""
    _flush()
    if key not in _SHARED:
        _SHARED[key] = _Shared(key, install, safe)
    return kind(_SHARED[key], owner)


# --- the optimizer-step pre-hook -----------------------------------------------------------------------------------

_STEP_CHECKS: dict[Hold, tuple[weakref.ref, Callable[[Any, torch.optim.Optimizer], None]]] = {}


class _StepWatch(Hold):
    def _undo(self) -> None:
        _STEP_CHECKS.pop(self, None)
        super()._undo()


def _before_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for owner, check in list(_STEP_CHECKS.values()):
        live = owner()
        if live is not None:
            check(live, optimizer)


def _install_step_hook() -> tuple[Callable[[], None], list[Effect]]:
    handle = register_optimizer_step_pre_hook(_before_any_step)
    return handle.remove, [Effect(OPTIMIZER_STEP_PRE_HOOK, "torch.optim.optimizer", _before_any_step)]


def watch_optimizer_steps(owner: Owner, check: Callable[[Owner, torch.optim.Optimizer], None]) -> Hold:
    """`check(owner, optimizer)` before every optimizer step of the process while `owner` lives, through the one
    process-wide pre-hook, registered once (a check raises to refuse the step)."""
    watch = hold(OPTIMIZER_STEP_PRE_HOOK, owner, _install_step_hook, lambda: not optimizer_step_running(), _StepWatch)
    _STEP_CHECKS[watch] = (weakref.ref(owner), check)
    return watch


# --- torch's and transformers' registries ---------------------------------------------------------------------------


def module_forward_pre_hook(owner: Owner, hook: Callable[[Owner, nn.Module, tuple], None]) -> Hold:
    """`hook(owner, module, args)` before every module forward of the process, until removed or `owner` is collected
    (torch copies its global hooks before running them, so a hook may remove itself)."""
    ref = weakref.ref(owner)

    def before(module: nn.Module, args: tuple) -> None:
        live = ref()
        if live is not None:
            hook(live, module, args)

    def install() -> tuple[Callable[[], None], list[Effect]]:
        return register_module_forward_pre_hook(before).remove, [Effect(MODULE_FORWARD_PRE_HOOK, "torch.nn", before)]

    return hold(f"{MODULE_FORWARD_PRE_HOOK} {id(before)}", owner, install)


def register_attention(owner: object, name: str, attention: Callable[..., Any], mask: Callable[..., Any]) -> Hold:
    """`attention` and `mask` under `name` in transformers' attention and mask registries while any owner of `name`
    lives (the registries are process-wide; every model of that name uses the same functions)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def install() -> tuple[Callable[[], None], list[Effect]]:
        unregister_attention = register_function(ALL_ATTENTION_FUNCTIONS, name, attention)
        unregister_mask = register_function(ALL_MASK_ATTENTION_FUNCTIONS, name, mask)

        def undo() -> None:
            unregister_mask()
            unregister_attention()

        return undo, [Effect(ATTENTION_FUNCTION, name, attention), Effect(MASK_FUNCTION, name, mask)]

    return hold(f"{ATTENTION_FUNCTION} {name}", owner, install)


def patch_class_attribute(
    owner: object, key: str, install: Callable[[], Callable[[], None]], effects: list[Effect]
) -> Hold:
    """Class attributes of a library (`effects`) replaced by `install` (which returns their undo) while any owner of
    `key` lives."""
    return hold(key, owner, lambda: (install(), effects))


# --- attributes of the model's own objects ---------------------------------------------------------------------------


class Patch(_Entry):
    """An attribute of one of the model's objects replaced; `remove()` puts back what was there (a property's
    value through its setter, an instance attribute's, or none), unless it was replaced since. The object keeps its
    patches (so they go with it); a deep copy of the object lists its own, which are never undone."""

    def __init__(self, obj: object, name: str, value: Any, restore: Callable[[], None] | None = None):
        super().__init__()
        self.obj: Callable[[], object | None] = weakref.ref(obj)  # a deep copy's: its object, or nothing
        self.name, self.value = name, value
        self.restore = restore if restore is not None else _setter(obj, name, value)
        vars(obj).setdefault(_KEPT, []).append(self)

    def _undo(self) -> None:
        self.restore()

    def effects(self) -> list[Effect]:
        obj = self.obj()
        return [] if obj is None else [Effect(ATTRIBUTE, self.name, obj)]

    def __deepcopy__(self, memo: dict) -> Patch:
        new = Patch.__new__(Patch)
        _Entry.__init__(new)
        obj = copy.deepcopy(self.obj(), memo)
        new.obj = weakref.ref(obj) if obj is not None else lambda: None
        new.name, new.value, new.restore = self.name, copy.deepcopy(self.value, memo), lambda: None
        return new


_KEPT = "_autotp_patches"


def _setter(obj: object, name: str, value: Any) -> Callable[[], None]:
    own = vars(obj)
    had, before = name in own, own.get(name)
    descriptor = isinstance(getattr(type(obj), name, None), property) or name == "__class__"
    if descriptor:
        before = getattr(obj, name)
    setattr(obj, name, value)
    ref = weakref.ref(obj)

    def restore() -> None:
        target = ref()
        if target is None:
            return
        if descriptor or had:
            setattr(target, name, before)
        elif vars(target).get(name) is value:
            delattr(target, name)

    return restore


def patch_attribute(obj: object, name: str, value: Any) -> Patch:
    """`obj.name = value`, listed and undone by `remove()` or a rollback."""
    return Patch(obj, name, value)


def patched(obj: object, name: str) -> Any:
    """What autotp last set `obj.name` to (`patch_attribute`) and has not undone, or None: a caller that finds another
    value there now knows the user replaced it."""
    for patch in reversed(vars(obj).get(_KEPT, ())):
        if patch.name == name and not patch.removed:
            return patch.value
    return None


def replace_ddp_ignored(model: nn.Module, ignored: Any) -> Patch:
    """DDP's ignore list of `model` replaced by `ignored` (an iterable DDP reads while it is built: `DDPGuard`)."""
    return Patch(model, "DDP's ignore list", ignored, set_ddp_ignored(model, ignored))


# --- the list, and rollback ------------------------------------------------------------------------------------------


def live() -> list[Effect]:
    """Every effect installed now, process-wide ones first."""
    _flush()
    return [e for shared in _SHARED.values() for e in shared.effects] + [
        e for _, entry in sorted(_ENTRIES.items()) for e in entry.effects()
    ]


def mark() -> int:
    """A point to roll back to (`undo_since`)."""
    _flush()
    return next(_serials)


def undo_since(point: int) -> None:
    """Remove every entry made since `point`, the latest first (a failed wrap's)."""
    for serial, entry in sorted(_ENTRIES.items(), reverse=True):
        if serial > point:
            entry.remove()
