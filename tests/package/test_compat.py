"""The dependency boundaries (autotp.compat): a moved private piece fails naming itself and the installed version,
an untested major version warns once, PEFT's patched `save_pretrained` lives only as long as the wrapped models,
and no module outside autotp/compat reaches into a dependency's private pieces."""

from __future__ import annotations

import ast
import functools
import gc
import re
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

import autotp
from autotp.compat import peft as peft_compat
from autotp.compat import torch as torch_compat
from autotp.compat import trainer as trainer_compat
from autotp.compat import versions
from autotp.testing.spawn import COLLECTIVE_TIMEOUT, run_ranks
from models import tiny_model

PACKAGE = Path(autotp.__file__).parent
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

# Private names of transformers, PEFT, accelerate and torch.distributed objects that only autotp/compat may use
DEPENDENCY_PRIVATES = {
    "_wrap_model",
    "_get_num_items_in_batch",
    "_get_train_sampler",
    "_save",
    "_save_optimizer_and_scheduler",
    "_get_collator_with_removed_columns",
    "_train_batch_size",
    "_models",
    "_check_forward_args",
    "_cast_input_dtype",
    "_timeout",
    "_getframe",
    "_get_backend",
    "_ddp_params_and_buffers_to_ignore",
    "_attn_implementation",
    "_experts_implementation_internal",
    "_make_wrapper_subclass",
    "_disabled_torch_function_impl",
    "_load_rng_state",
    "_get_eval_sampler",
    "_global_mapping",
    "_current_frames",
}
NN_MODULE_OWN = {name for name in dir(nn.Module) if name.startswith("_")}  # _modules, _load_from_state_dict, ...


def is_dependency_private(name: str) -> bool:
    return name not in NN_MODULE_OWN and (name in DEPENDENCY_PRIVATES or name.startswith("_load_"))


def private_uses(source: str, where: str) -> list[str]:
    """where:line of each `x._name` (or getattr/hasattr/setattr with that name, or a method overriding it) in
    `source` that names a dependency's private piece."""
    found = []  # (line, name)
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.append((node.lineno, name.value))
        elif isinstance(node, ast.ClassDef):
            found += [
                (item.lineno, item.name)
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
    return [f"{where}:{line}: {name}" for line, name in sorted(found) if is_dependency_private(name)]


def test_no_private_dependency_access_outside_compat() -> None:
    sample = (
        "trainer._wrap_model(model)\ngetattr(accelerator, '_models')\nclass T:\n    def _load_best_model(self): "
        "pass\nmodule._modules, module._load_from_state_dict, self._own_helper"
    )
    expected = ["sample:1: _wrap_model", "sample:2: _models", "sample:4: _load_best_model"]
    assert private_uses(sample, "sample") == expected  # nn.Module's own privates and autotp's are not flagged
    compat = PACKAGE / "compat"
    outside = [
        use
        for file in sorted(PACKAGE.rglob("*.py"))
        if compat not in file.parents
        for use in private_uses(file.read_text(), str(file.relative_to(PACKAGE.parent)))
    ]
    assert outside == [], "dependency internals used outside autotp/compat:\n" + "\n".join(outside)


def needs(piece: str) -> str:
    """The start of the error for a missing `piece`, with the installed version of its package."""
    package = piece.split(".")[0]
    return re.escape(
        f"autotp needs {piece}, which {package} {versions.installed(package)} does not have; "
        f"autotp was tested on {package} {versions.TESTED[package][0]}"
    )


def test_trainer_privates_missing_from_transformers_fail_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(transformers.Trainer, "_wrap_model")
    methods = {name: lambda self: None for name in trainer_compat.REPLACED}
    with pytest.raises(RuntimeError, match=needs("transformers.Trainer._wrap_model")):
        trainer_compat.replace_privates(type("Replacing", (transformers.Trainer,), methods))


@pytest.mark.parametrize(
    "call,piece",
    [
        (
            lambda: trainer_compat.replaced(object(), object, "count_items_in_batch"),
            "transformers.Trainer._get_num_items_in_batch",
        ),
        (
            lambda: trainer_compat.collator(SimpleNamespace(data_collator=None), "training"),
            "transformers.Trainer._get_collator_with_removed_columns",
        ),
        (lambda: trainer_compat.train_batch_size(object()), "transformers.Trainer._train_batch_size"),
        (
            lambda: trainer_compat.is_prepared(SimpleNamespace(accelerator=object()), nn.Linear(2, 2)),
            "accelerate.Accelerator._models",
        ),
        (
            lambda: peft_compat.check_forward_args(nn.Linear(2, 2), torch.ones(1, 2)),
            "peft.tuners.lora.Linear._check_forward_args",
        ),
        (
            lambda: peft_compat.cast_input_dtype(nn.Linear(2, 2), torch.ones(1, 2), torch.float16),
            "peft.tuners.tuners_utils.BaseTunerLayer._cast_input_dtype",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_missing_private_piece_is_named_with_the_installed_version(call, piece: str) -> None:
    with pytest.raises(RuntimeError, match=needs(piece)):
        call()


def test_renamed_collectives_under_either_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_compat.all_gather_single() in (getattr(dist, "all_gather_single", None), dist.all_gather_into_tensor)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    assert torch_compat.all_gather_single() is dist.all_gather_into_tensor
    assert torch_compat.reduce_scatter_single() is dist.reduce_scatter_tensor
    monkeypatch.delattr(dist, "all_gather_into_tensor")
    monkeypatch.delattr(dist, "reduce_scatter_tensor")
    with pytest.raises(RuntimeError, match=needs("torch.distributed.all_gather_single")):
        torch_compat.all_gather_single()
    with pytest.raises(RuntimeError, match=needs("torch.distributed.reduce_scatter_single")):
        torch_compat.reduce_scatter_single()


def test_fake_process_group_names_the_missing_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu.py runs one tp=8 rank on torch's fake backend; a torch without it fails naming the module."""
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)  # import raises
    with pytest.raises(RuntimeError, match=needs("torch.testing._internal.distributed.fake_pg.FakeStore")):
        torch_compat.init_fake_process_group(8)
    assert not dist.is_initialized()


def timeouts(rank: int, world: int) -> tuple:
    """The world's timeout, then the errors for a group without `_get_backend` and a backend without `_timeout`."""
    errors = []
    for group in (object(), SimpleNamespace(_get_backend=lambda device: SimpleNamespace(options=object()))):
        try:
            torch_compat.backend_timeout(group)
        except RuntimeError as err:
            errors.append(str(err))
    return torch_compat.backend_timeout(), errors


def test_backend_timeout_reads_the_world_and_names_a_missing_piece() -> None:
    assert torch_compat.backend_timeout() is None  # no process group in this process
    ((timeout, errors),) = run_ranks(timeouts, 1)
    assert timeout == COLLECTIVE_TIMEOUT and isinstance(timeout, timedelta)
    assert len(errors) == 2
    assert re.match(needs("torch.distributed.ProcessGroup._get_backend"), errors[0]), errors[0]
    assert re.match(needs("torch.distributed.Backend.Options._timeout"), errors[1]), errors[1]


def test_frame_read_and_fsdp_hooks_without_a_ddp_or_fsdp() -> None:
    assert torch_compat.ddp_under_construction(0) is None  # this frame's `self` is no DDP
    assert torch_compat.ddp_under_construction(10**6) is None  # deeper than the stack
    from torch.distributed.fsdp import fully_shard

    assert torch_compat.is_fsdp_hook(functools.partial(fully_shard))
    assert not torch_compat.is_fsdp_hook(lambda module, args: None)


def test_ddp_ignore_list_round_trips() -> None:
    model = nn.Linear(2, 2)
    assert torch_compat.ddp_ignored(model) == ()
    torch_compat.set_ddp_ignored(model, ("bias",))
    assert torch_compat.ddp_ignored(model) == ("bias",)


def test_peft_classes_by_isinstance_and_none_without_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    peft_model = get_peft_model(tiny_model("llama"), LoraConfig(**LORA, modules_to_save=["lm_head"]))
    q_proj = peft_model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    lm_head = peft_model.get_submodule("base_model.model.lm_head")
    assert peft_compat.is_lora_linear(q_proj) and not peft_compat.is_lora_linear(q_proj.base_layer)
    assert peft_compat.is_modules_to_save(lm_head) and not peft_compat.is_modules_to_save(q_proj)
    assert all(peft_compat.is_peft_module(m) for m in (peft_model, peft_model.base_model, q_proj, lm_head))
    assert not peft_compat.is_peft_module(q_proj.base_layer)
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    peft_compat._classes.cache_clear()
    try:
        assert not any(
            check(module)
            for module in (q_proj, lm_head, peft_model)
            for check in (peft_compat.is_lora_linear, peft_compat.is_modules_to_save, peft_compat.is_peft_module)
        )
    finally:
        peft_compat._classes.cache_clear()


def test_untested_major_version_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = versions.installed
    monkeypatch.setattr(versions, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.check_versions()  # the versions in this environment were tested
        monkeypatch.setattr(
            versions, "installed", lambda package: "6.0.1" if package == "transformers" else installed(package)
        )
        versions.check_versions()
        versions.check_versions()
    assert [str(w.message) for w in caught] == [
        "autotp was tested on transformers 5.19–5.24; transformers 6.0.1 is installed, whose internals autotp relies "
        "on may differ"
    ]


def patch_lifetime(rank: int, world: int) -> list[bool]:
    """Whether PEFT's `save_pretrained` is autotp's wrapper: with two wrapped models, with one, with none."""
    original = PeftModel.save_pretrained
    first = get_peft_model(autotp.wrap(tiny_model("llama"), world), LoraConfig(**LORA))
    second = autotp.wrap(tiny_model("llama"), world)
    patched = [PeftModel.save_pretrained is not original and PeftModel.save_pretrained.__wrapped__ is original]
    del first
    gc.collect()
    patched.append(PeftModel.save_pretrained is not original)
    del second
    gc.collect()
    patched.append(PeftModel.save_pretrained is not original)
    return patched


def test_peft_save_patch_is_undone_when_the_last_wrapped_model_is_collected() -> None:
    for patched in run_ranks(patch_lifetime, 2):
        assert patched == [True, True, False]
