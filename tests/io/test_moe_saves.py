"""`autotp.save_pretrained` of MoE models writes what transformers' own `save_pretrained` writes for the same
one-process model: every expert as its own tensor (transformers 5 holds them fused and splits them on save), under
its names (Mixtral's `block_sparse_moe`, `w1`/`w2`/`w3`), the same files, index and values; plain transformers
reloads it. Each expert's tensor is gathered alone, also under `autotp.fully_shard` and with uneven expert widths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import autotp
from autotp.io.hf.save import write_hf_checkpoint
from autotp.testing import tiny_config
from autotp.testing.spawn import run_ranks
from models import assert_same_checkpoint, batch

MOE = ["deepseek_v3", "granitemoe", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe"]
# tiny_config's DeepSeek-V3 does not run (the sweep lists it as not built): MLA wants as many KV heads as heads and a
# rope head_dim, the router one group of its 4 experts, and its first 3 layers are dense (the tiny model's 2 would hold
# no expert). Uneven: 33 rows of each expert's gate and up over 2 ranks (17 and 16), run by batched_mm (grouped_mm needs
# rows of 16 bytes, in the one-process model too).
DEEPSEEK = dict(
    first_k_dense_replace=1,
    num_key_value_heads=4,
    n_group=1,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)
CONFIGS = {"deepseek_v3": DEEPSEEK, "uneven": {"moe_intermediate_size": 33}}
SMALL = "40KB"  # several files for every tiny model, each expert's group of views kept together


def build(model_type: str, **config: int) -> torch.nn.Module:
    """The tiny model of `model_type`, the same on every rank (seed 0)."""
    tiny = tiny_config(model_type)
    for key, value in {**CONFIGS.get(model_type, {}), **config}.items():
        setattr(tiny, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny, dtype=torch.float32, **kernels(tiny.to_dict()))


def kernels(config: dict) -> dict:
    """`from_config` / `from_pretrained` keywords that let a model with experts of `config`'s width run."""
    return {"experts_implementation": "batched_mm"} if config.get("moe_intermediate_size", 0) % 4 else {}


def save_wrapped(rank: int, world: int, model_type: str, target: str, config: dict, dp: int = 1) -> list[str]:
    """Saves the wrapped model twice: in one file (out/whole) and in small files (out/small); returns the names of
    the experts tensors it shards."""
    model = autotp.wrap(build(model_type, **config), world // dp)
    if dp > 1:
        autotp.fully_shard(model)
    autotp.save_pretrained(model, Path(target) / "whole")
    autotp.save_pretrained(model, Path(target) / "small", max_shard_size=SMALL)
    return [name for name, p in model.named_parameters() if ".experts." in name and hasattr(p, "autotp_shard")]


def check_save(tmp_path: Path, model_type: str, tp: int, dp: int = 1, **config: int) -> None:
    sharded = run_ranks(save_wrapped, tp * dp, model_type, str(tmp_path / "ours"), config, dp)[0]
    assert sharded, "no experts tensor is sharded: nothing to gather expert by expert"
    plain = build(model_type, **config)
    for kind, size in (("whole", "5GB"), ("small", SMALL)):
        plain.save_pretrained(tmp_path / "theirs" / kind, max_shard_size=size)
        assert_same_checkpoint(tmp_path / "ours" / kind, tmp_path / "theirs" / kind)
    assert len(list((tmp_path / "ours" / "small").glob("*.safetensors"))) > 2, "the small shard size makes files"
    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours" / "small", output_loading_info=True, **kernels(config)
    )
    assert not any(info.values()), info
    ids = batch(plain.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, plain.eval()(ids).logits)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_type", MOE)
def test_moe_save_is_transformers_save(tmp_path: Path, model_type: str, tp: int) -> None:
    check_save(tmp_path, model_type, tp)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_uneven_expert_widths(tmp_path: Path, tp: int) -> None:
    check_save(tmp_path, "qwen3_moe", tp, **CONFIGS["uneven"])


@pytest.mark.slow
def test_moe_save_under_fully_shard(tmp_path: Path) -> None:
    """tp=2 x dp=2: each expert's rows come from the DP rank holding them, then are gathered over TP."""
    check_save(tmp_path, "qwen3_moe", 2, dp=2, **CONFIGS["uneven"])


def test_consolidating_cuts_whole_tensors(tmp_path: Path) -> None:
    """Without a part fetcher (one process, as `autotp consolidate` writes), experts are cut from whole tensors."""
    model = build("olmoe")
    params = model.state_dict(keep_vars=True)
    for kind, size in (("whole", "5GB"), ("small", SMALL)):
        (tmp_path / "ours" / kind).mkdir(parents=True)
        write_hf_checkpoint(model, params, lambda name: params[name].detach(), tmp_path / "ours" / kind, size)
        model.save_pretrained(tmp_path / "theirs" / kind, max_shard_size=size)
        assert_same_checkpoint(tmp_path / "ours" / kind, tmp_path / "theirs" / kind)


def test_a_conversion_that_is_not_a_cut_is_named(tmp_path: Path) -> None:
    """Inkling2's experts are saved interleaved (a reshape, not rows of the fused tensor): refused before anything is
    written, naming the tensor, the family and the operation, rather than a wrong file."""
    model = build("inkling2_text")
    params = model.state_dict(keep_vars=True)
    with pytest.raises(NotImplementedError) as err:
        write_hf_checkpoint(model, params, lambda name: params[name].detach(), tmp_path, "5GB")
    message = str(err.value)
    assert "'model.llm.layers.0.mlp.experts.w13_weight'" in message and "inkling2_text" in message, message
    assert "reshape()" in message and list(tmp_path.iterdir()) == [], message
