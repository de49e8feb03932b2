"""Nothing a wrap installs outside the model is hidden or outlives it: torch's process-wide optimizer-step and module
pre-hooks, transformers' attention and mask registries, PEFT's patched methods and the attributes patched on the
model's objects are each listed by `autotp.runtime.process_hooks.live()`; after `del model` and `gc.collect()`, and
after a wrap that fails in its last step, none of the process-wide ones stays."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from torch import nn
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import autotp
from autotp.compat.torch import ddp_ignored
from autotp.testing import run_ranks
from ep_workers import moe_model
from models import tiny_model

# name: (build the model, wrap's arguments); every dimension: TP, vocab and SP; CP; EP
CASES: dict[str, tuple[Callable[[], nn.Module], dict]] = {
    "tp_vocab_sp": (lambda: tiny_model("llama"), {"tp_size": 2, "sequence_parallel": True, "check_inputs": True}),
    "cp": (lambda: tiny_model("llama", attn_implementation="sdpa"), {"tp_size": 1, "cp_size": 2}),
    "ep": (lambda: moe_model("qwen3_moe"), {"tp_size": 1, "ep_size": 2}),
}
# where transformers' `loss_function` setter and torch's DDP keep what was set
STORED_AS = {"_loss_function": "loss_function", "_ddp_params_and_buffers_to_ignore": "DDP's ignore list"}


def process_wide() -> dict[str, Any]:
    """What the process holds outside any model: the hooks by identity, the registries' names, PEFT's methods."""
    return {
        "optimizer step pre-hooks": list(torch_optimizer._global_optimizer_pre_hooks.values()),
        "module forward pre-hooks": list(torch_module._global_forward_pre_hooks.values()),
        "attention functions": sorted(ALL_ATTENTION_FUNCTIONS.keys()),
        "mask functions": sorted(ALL_MASK_ATTENTION_FUNCTIONS.keys()),
        "PEFT methods": [PeftModel.save_pretrained, LoraLinear.update_layer],
    }


def added(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list]:
    return {key: [x for x in after[key] if not any(x is y or x == y for y in before[key])] for key in after}


def patched(model: nn.Module, before: dict[int, tuple[type, set[str]]]) -> set[tuple[str, int]]:
    """(attribute, id of its object) for each attribute set on a module the model had before wrap that overrides its
    class's (a method, a property's storage) or its class itself; modules wrap put in are the model's own."""
    found = set()
    for module in model.modules():
        if id(module) not in before:
            continue
        cls, names = before[id(module)]
        if type(module) is not cls:
            found.add(("__class__", id(module)))
        for name in set(vars(module)) - names:
            if hasattr(cls, name) or name in STORED_AS:
                found.add((STORED_AS.get(name, name), id(module)))
    return found


def wrapped_effects(rank: int, world: int, case: str) -> dict:
    """Wrap `case`, walk what it changed outside the model, compare it with `process_hooks.live()`; then drop it."""
    from autotp.runtime import process_hooks

    build, options = CASES[case]
    model = build()
    before, own = process_wide(), {id(m): (type(m), set(vars(m))) for m in model.modules()}
    autotp.wrap(model, options.pop("tp_size"), **options)
    ddp_ignored(model)  # read outside DDP's constructor: the guard waits for DDP's first forward (a global pre-hook)
    new, attributes = added(before, process_wide()), patched(model, own)
    live = process_hooks.live()
    listed = {
        kind: [e.value for e in live if e.kind == kind]
        for kind in (process_hooks.OPTIMIZER_STEP_PRE_HOOK, process_hooks.MODULE_FORWARD_PRE_HOOK)
    }
    names = {e.where for e in live if e.kind in (process_hooks.ATTENTION_FUNCTION, process_hooks.MASK_FUNCTION)}
    unlisted = [
        h
        for h in new["optimizer step pre-hooks"]
        if not any(h is x for x in listed[process_hooks.OPTIMIZER_STEP_PRE_HOOK])
    ]
    unlisted += [
        h
        for h in new["module forward pre-hooks"]
        if not any(h is x for x in listed[process_hooks.MODULE_FORWARD_PRE_HOOK])
    ]
    unlisted += [k for k in new["attention functions"] + new["mask functions"] if k not in names]
    peft = {e.where for e in live if e.kind == process_hooks.CLASS_ATTRIBUTE}
    unlisted += [m.__name__ for m in new["PEFT methods"] if m.__name__ not in peft]
    patches = {(e.where, id(e.value)) for e in live if e.kind == process_hooks.ATTRIBUTE}
    report = {
        "unlisted": [repr(x) for x in unlisted],
        "unlisted attributes": sorted(a for a, _ in attributes - patches),
        "found": {k: len(v) for k, v in new.items()},
        "attributes": sorted({a for a, _ in attributes}),
    }
    del model, own, new, attributes, live
    gc.collect()
    report["left"] = {k: repr(v) for k, v in added(before, process_wide()).items() if v}
    report["listed after"] = [repr(e) for e in process_hooks.live()]
    return report


EXPECTED = {  # what each case installs outside the model, found by the walk (so the walk sees them)
    "tp_vocab_sp": (
        {"optimizer step pre-hooks", "module forward pre-hooks", "PEFT methods"},
        {"__class__", "loss_function", "save_pretrained", "resize_token_embeddings", "DDP's ignore list"},
    ),
    "cp": (
        {"optimizer step pre-hooks", "module forward pre-hooks", "attention functions", "mask functions"},
        {"loss_function", "save_pretrained", "DDP's ignore list"},
    ),
    "ep": (  # at tp 1: no PEFT guard; the experts replaced: an optimizer made before wrap is refused at its step
        {"optimizer step pre-hooks", "module forward pre-hooks"},
        {"generate", "forward", "DDP's ignore list"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_effect_outside_the_model_is_listed_and_none_outlives_it(case: str) -> None:
    kinds, attributes = EXPECTED[case]
    for report in run_ranks(wrapped_effects, 2, case):
        assert {k for k, n in report["found"].items() if n} == kinds, report
        assert attributes <= set(report["attributes"]), report
        assert report["unlisted"] == [] and report["unlisted attributes"] == [], report
        assert report["left"] == {} and report["listed after"] == [], report


def failing_wrap(rank: int, world: int, case: str) -> dict:
    """A wrap that fails in its last step (the replicas' broadcast), after everything else was installed."""
    from autotp import parallelize

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected")

    build, options = CASES[case]
    model = build()
    before = process_wide()
    parallelize.broadcast_replicated = broken
    with pytest.raises(RuntimeError, match="injected"):
        autotp.wrap(model, options.pop("tp_size"), **options)
    left = {k: repr(v) for k, v in added(before, process_wide()).items() if v}  # before any collection
    loss = model(torch.arange(16)[None], labels=torch.arange(16)[None]).loss  # still trains as before
    return {"left": left, "loss": loss.item()}


@pytest.mark.parametrize("case", ["tp_vocab_sp", "cp"])
def test_a_wrap_failing_late_leaves_nothing_process_wide(case: str) -> None:
    for report in run_ranks(failing_wrap, 2, case):
        assert report["left"] == {} and report["loss"] > 0, report


class Owner:
    """Something a process-wide effect is held for (a CP model's state, a mesh guard)."""


def test_one_step_hook_for_every_owner_removed_after_a_step_in_which_the_last_was_collected() -> None:
    """The step hook is registered once, whatever the owners; an owner collected while a step runs the hooks (here
    by a later hook) takes it out only after that step: removing it mid-iteration would break the step."""
    from autotp.runtime import process_hooks

    before = list(torch_optimizer._global_optimizer_pre_hooks.values())
    owners, checked = [Owner(), Owner()], []
    for owner in owners:
        process_hooks.watch_optimizer_steps(owner, lambda o, optimizer: checked.append(type(o)))
    del owner  # the list holds them alone
    assert len(torch_optimizer._global_optimizer_pre_hooks) == len(before) + 1

    def drop(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owners.clear()
        gc.collect()

    handles = [
        torch_optimizer.register_optimizer_step_pre_hook(drop),
        torch_optimizer.register_optimizer_step_pre_hook(lambda *args: None),
    ]  # iterated after the drop
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    optimizer.step()
    for handle in handles:
        handle.remove()
    assert len(checked) == 2
    assert not [e for e in process_hooks.live() if e.kind == process_hooks.OPTIMIZER_STEP_PRE_HOOK]
    assert list(torch_optimizer._global_optimizer_pre_hooks.values()) == before
