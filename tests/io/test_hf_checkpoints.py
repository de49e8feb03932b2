"""Checkpoints as transformers writes them, read by `autotp.from_pretrained` and equal to wrap-after-load tensor for
tensor: MoE experts one tensor per expert (the hub's layout; renamed modules such as Mixtral's block_sparse_moe),
built from this rank's rows of each expert; tensors transformers converts otherwise on load (a fused projection
saved whole, projections saved apart, offset layer indices); and models of every task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import CONFIG_MAPPING

from autotp.compat.hf import TASKS
from autotp.compat.hf_conversion import ConvertedSource, checkpoint_sources
from autotp.io.errors import CheckpointError
from autotp.io.hf.load import checkpoint_files
from autotp.testing import tiny_config
from autotp.testing.parity import compare_loading
from autotp.testing.spawn import run_ranks
from models import tiny_model

MOE = ["granitemoe", "minimax", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe"]


def save_moe(model_type: str, path: Path, task: str = "causal-lm") -> set[str]:
    """Saves with transformers; returns the checkpoint names that are not the model's own."""
    torch.manual_seed(0)
    model = getattr(transformers, TASKS[task]).from_config(tiny_config(model_type))
    model.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys()) - set(model.state_dict())


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_type", MOE)
def test_per_expert_checkpoint_loads_like_wrap(tmp_path: Path, model_type: str, tp: int) -> None:
    assert save_moe(model_type, tmp_path), "transformers saves this model under its own names: nothing to convert"
    for report in run_ranks(compare_loading, tp, str(tmp_path)):
        assert report["keys"] and report["unequal"] == [] and report["buffers"] == [], report
        assert report["shards"] > 0
        assert report["logits"] == 0.0 and report["loss"] == 0.0 and report["grads"] == [], report


def load_alone(rank: int, world: int, path: str) -> str:
    import autotp

    try:
        autotp.from_pretrained(path, world)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    """A checkpoint with one expert's tensor gone fails before anything is replaced, naming the fused tensor."""
    from safetensors.torch import load_file, save_file

    save_moe("olmoe", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for message in run_ranks(load_alone, 2, str(tmp_path)):
        assert "model.layers.1.mlp.experts.gate_up_proj" in message and "per-expert tensors" in message, message


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe"])
def test_per_expert_tensors_count_as_used(tmp_path: Path, model_type: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every per-expert tensor was read into a fused one, so none is reported as unused."""
    import logging

    import autotp

    save_moe(model_type, tmp_path)
    caplog.set_level(logging.WARNING, logger="autotp")
    autotp.from_pretrained(tmp_path, 1)
    assert not [r for r in caplog.records if "not used" in r.getMessage()], caplog.text


# What transformers does on load, beyond stacking experts; each model type needs it on its own save.
CONVERTED = {
    "hrm_text": "q, k and v saved as one fused tensor, which transformers chunks",
    "kimi_linear": "q/k/v convolutions saved apart, which transformers concatenates",
    "inkling2_text": "per-layer tensors saved under layer indices shifted by one",
    "deepseek_v4": "a rename of '.norm.' meant for the attention that also matches model.norm",
    "lara_mini": "one in_proj saved for four projections of unequal sizes, which transformers splits (5.24 on)",
}


@pytest.mark.parametrize(
    "model_type", [pytest.param(m, marks=pytest.mark.slow) if m == "kimi_linear" else m for m in sorted(CONVERTED)]
)  # kimi_linear: ~15 s to build
def test_converted_checkpoint_loads_like_wrap(tmp_path: Path, model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    assert save_moe(model_type, tmp_path) or model_type == "deepseek_v4", CONVERTED[model_type]
    for report in run_ranks(compare_loading, 2, str(tmp_path)):
        assert report["keys"] and report["unequal"] == [] and report["buffers"] == [], report
        assert report["logits"] == 0.0 and report["loss"] == 0.0 and report["grads"] == [], report


@pytest.mark.parametrize(
    "model_type,task",
    [
        ("llava", "image-text"),
        ("t5", "seq2seq"),
        ("marian", "seq2seq"),
        ("whisper", "speech-seq2seq"),
        ("bert", "masked-lm"),
    ],
)
def test_every_task_loads_like_wrap(tmp_path: Path, model_type: str, task: str) -> None:
    """from_pretrained builds the class the checkpoint's config.architectures names, not always a causal LM. Marian's
    sinusoidal positions, left out of its checkpoint, come out trainable or frozen as transformers' own load leaves
    them (trainable from 5.24), so both train alike."""
    save_moe(model_type, tmp_path, task)
    for report in run_ranks(compare_loading, 2, str(tmp_path)):
        assert report["keys"] and report["unequal"] == [] and report["buffers"] == [], report
        assert report["shards"] > 0
        assert report["logits"] == 0.0 and report["loss"] == 0.0 and report["grads"] == [], report


def test_a_bad_fused_tensor_is_named(tmp_path: Path) -> None:
    """A fused tensor whose parts do not come out at the config's shape fails naming the model tensor and both shapes."""
    from safetensors.torch import load_file, save_file

    save_moe("hrm_text", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    key = "model.H_module.layers.0.attn.gqkv_proj.weight"  # gate, q, k, v: chunked into four by transformers
    tensors[key] = tensors[key][:-8]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for message in run_ranks(load_alone, 2, str(tmp_path)):
        assert "model.H_module.layers.0.self_attn." in message and "the config implies" in message, message


# --- checkpoint_sources on hand-written checkpoints (no process group) --------------------------------------------


def write_checkpoint(path: Path, shapes: dict[str, tuple[int, ...]], files: int = 1) -> None:
    """A safetensors checkpoint of zero tensors of `shapes`: model.safetensors, or `files` shards and an index."""
    names = list(shapes)
    if files == 1:
        save_file({n: torch.zeros(shapes[n]) for n in names}, str(path / "model.safetensors"))
        return
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = names[i::files]
        save_file({n: torch.zeros(shapes[n]) for n in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("files", [1, 3])
def test_checkpoint_sources_of_a_checkpoint_under_the_models_own_names(tmp_path: Path, files: int) -> None:
    """Every tensor is read from the key of its own name: from model.safetensors, or from the shard the index
    names."""
    model = tiny_model("llama")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    write_checkpoint(tmp_path, shapes, files)
    found = checkpoint_files(tmp_path)
    if files == 1:
        assert found == dict.fromkeys(shapes, tmp_path / "model.safetensors")
    else:
        names = list(shapes)
        assert found == {n: tmp_path / f"model-{names.index(n) % 3 + 1:05d}-of-00003.safetensors" for n in names}
    assert checkpoint_sources(model, found) == {name: name for name in shapes}


def test_checkpoint_sources_of_per_expert_moe_keys(tmp_path: Path) -> None:
    """Mixtral as the hub stores it: `block_sparse_moe` (renamed `mlp` on load) and one w1/w2/w3 tensor per expert.
    The router maps to its old name; each layer's fused experts to their per-expert keys in expert order (2 before
    10), w1 (gate) then w3 (up), stacked over the experts and concatenated along dim 1."""
    model = tiny_model("mixtral", num_local_experts=12)
    hidden, width = model.config.hidden_size, model.config.intermediate_size
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if ".mlp." not in name}
    expert = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"
    for layer in range(2):
        shapes[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = (12, hidden)
        for e in range(12):
            shapes.update(
                {
                    expert.format(layer, e, "w1"): (width, hidden),
                    expert.format(layer, e, "w3"): (width, hidden),
                    expert.format(layer, e, "w2"): (hidden, width),
                }
            )
    write_checkpoint(tmp_path, shapes, files=2)
    sources = checkpoint_sources(model, checkpoint_files(tmp_path))
    assert set(sources) == set(model.state_dict())
    for layer in range(2):
        per_expert = lambda w, layer=layer: tuple(expert.format(layer, e, w) for e in range(12))  # noqa: E731
        assert sources[f"model.layers.{layer}.mlp.gate.weight"] == f"model.layers.{layer}.block_sparse_moe.gate.weight"
        assert sources[f"model.layers.{layer}.mlp.experts.gate_up_proj"] == ConvertedSource(
            (per_expert("w1"), per_expert("w3")),
            (".experts.*.w1.weight", ".experts.*.w3.weight"),
            None,
            "MergeModulelist(dim=0), Concatenate(dim=1)",
        )
        assert sources[f"model.layers.{layer}.mlp.experts.down_proj"] == ConvertedSource(
            (per_expert("w2"),), (".experts.*.w2.weight",), None, "MergeModulelist(dim=0)"
        )
    assert sources["model.layers.1.self_attn.q_proj.weight"] == "model.layers.1.self_attn.q_proj.weight"
