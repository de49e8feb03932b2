"""Ranks that must agree, and state that must not cross ranks: DP replicas broadcast at wrap and checked; configs,
options and plans compared before the model is touched; plain state dicts tagged with their layout; explicit
plans applied with the user's example inputs; MoE experts at widths grouped_mm refuses.

Parity tolerances are autotp.testing's (fp32, only the order of sums differs): loss 1e-5, parameters 3e-5; logits
after a state-dict load 1e-5 for the same reason.
"""

from __future__ import annotations

from pathlib import Path

import inspect
import time
from dataclasses import MISSING, fields

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

import autotp
from autotp.runtime.agreement import AGREED_OPTIONS, PER_RANK_OPTIONS
from autotp.options import WrapOptions
from autotp.testing import LOSS_ATOL, PARAM_ATOL, assert_parity, compare_training, full_tensor, run_ranks, tiny_config
from cp_workers import CP_FAMILIES
from models import batch, tiny_model


def dp_replicas(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama", seed=rank), 2)  # no common seed: every rank starts apart
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()]]
    theirs: list = [None] * autotp.dp_size()
    dist.all_gather_object(theirs, tensors, group=autotp.dp_group())
    equal = all(torch.equal(a, b) for a, b in zip(theirs[0], theirs[1]))
    autotp.check_replicas(model)  # passes: wrap made them equal
    if rank == 3:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(1e-3)  # a shard drifts on one DP replica
    try:
        autotp.check_replicas(model)
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"equal": equal, "error": error}


@pytest.mark.slow
def test_dp_replicas_are_broadcast_at_wrap_and_their_drift_is_named() -> None:
    reports = run_ranks(dp_replicas, 4)
    assert all(report["equal"] for report in reports), reports
    assert reports[0]["error"] is None and reports[2]["error"] is None  # DP group {0, 2} still agrees
    for report in reports[1], reports[3]:
        assert "model.layers.0.self_attn.q_proj.weight (32, 64) differs between DP ranks 1 and 3" in report["error"]


def moe_parity(rank: int, world: int, model_type: str) -> dict:
    config = tiny_config(model_type)
    config.moe_intermediate_size = 12  # 6 fp32 per rank: 24 bytes, not a multiple of 16 (grouped_mm's stride)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    return compare_training(reference, batch(config.vocab_size), world)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_moe_experts_whose_shard_width_grouped_mm_refuses_train_with_parity(model_type: str) -> None:
    for report in run_ranks(moe_parity, 2, model_type):
        assert_parity(report)
        assert report["sharded"]


DISAGREEMENTS = {  # rank 1's difference -> what the error names
    "intermediate_size": ({"config": {"intermediate_size": 128}}, "config key intermediate_size is 96 on rank 0 but 128"),
    "num_hidden_layers": ({"config": {"num_hidden_layers": 3}}, "config key num_hidden_layers is 2 on rank 0 but 3"),
    "vocab_parallel": ({"options": {"vocab_parallel": False}}, "option vocab_parallel is True on rank 0 but False"),
    "sequence_parallel": ({"options": {"sequence_parallel": True}},
                          "option sequence_parallel is False on rank 0 but True"),
}


def disagreeing(rank: int, world: int, case: str) -> str:
    change = DISAGREEMENTS[case][0] if rank == 1 else {}
    model = tiny_model("llama", **change.get("config", {}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as err:
        autotp.wrap(model, world, timeout=20, **change.get("options", {}))
    assert not autotp.tp.apply.parallel_layers(model)  # refused before anything changed
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_built_or_wrapped_differently_are_named_before_anything_changes(case: str) -> None:
    for message in run_ranks(disagreeing, 2, case):
        assert DISAGREEMENTS[case][1] + " on rank 1" in message, message
        assert "ranks disagree before sharding" in message


def test_every_wrap_option_is_compared_between_ranks_or_named_per_rank() -> None:
    """A field added to WrapOptions without deciding whether the ranks must agree on it fails here."""
    names = {f.name for f in fields(WrapOptions)}
    assert AGREED_OPTIONS | PER_RANK_OPTIONS == names, (names - AGREED_OPTIONS - PER_RANK_OPTIONS,
                                                        (AGREED_OPTIONS | PER_RANK_OPTIONS) - names)
    assert not AGREED_OPTIONS & PER_RANK_OPTIONS
    assert "cp_size" in AGREED_OPTIONS


def test_wrap_explain_and_from_pretrained_take_wrap_options_by_keyword() -> None:
    """WrapOptions is keyword-only (a field added in the middle cannot shift the others), and every entry point takes
    each of its fields, under its name and with its default."""
    with pytest.raises(TypeError):
        WrapOptions(None)
    options = {f.name: f.default for f in fields(WrapOptions)}
    assert MISSING not in options.values()
    for entry in autotp.wrap, autotp.explain, autotp.from_pretrained:
        taken = {name: p.default for name, p in inspect.signature(entry).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert {name: taken.get(name, "(absent)") for name in options} == options, entry.__name__


def different_sizes(rank: int, world: int, sizes: tuple[tuple[int, int], ...]) -> tuple[float, str]:
    """Each rank wraps at its own (tp_size, cp_size); a short timeout, which a prompt refusal never reaches."""
    tp_size, cp_size = sizes[rank]
    model = tiny_model("llama", **CP_FAMILIES["llama"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        autotp.wrap(model, tp_size, cp_size=cp_size, timeout=20)
    elapsed = time.monotonic() - start
    assert not autotp.tp.apply.parallel_layers(model) and autotp.state.find_state(model) is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return elapsed, str(err.value)


@pytest.mark.timeout(90)  # before the fix, the ranks diverged in the group creation: one waited out the timeout
@pytest.mark.parametrize("sizes", [((2, 2), (2, 1)), ((2, 1), (1, 2))], ids=["cp", "tp"])
def test_ranks_with_different_sizes_are_refused_before_any_group_is_built(sizes: tuple) -> None:
    for elapsed, message in run_ranks(different_sizes, 2, sizes):
        (tp0, cp0), (tp1, cp1) = sizes
        assert f"rank 0: tp_size={tp0}, cp_size={cp0}; rank 1: tp_size={tp1}, cp_size={cp1}" in message, message
        assert "Every rank must call wrap with the same tp_size and cp_size" in message
        assert elapsed < 10, elapsed  # a few seconds at most; the timeout is 20 s


def alone_at_tp1(rank: int, world: int) -> str:
    """Rank 1 wraps at tp 1 and cp 1, which runs no collective (some ranks only may), and goes on; rank 0 at cp 2."""
    model = tiny_model("llama", **CP_FAMILIES["llama"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        autotp.wrap(model, 1, cp_size=2 if rank == 0 else 1, timeout=20)
        return "wrapped"
    except RuntimeError as err:
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return str(err)


@pytest.mark.timeout(120)  # rank 0 fails when rank 1 leaves (at once here), else at the world's 60 s timeout
def test_a_rank_waiting_for_one_that_wrapped_alone_at_tp1_is_told_the_likely_cause() -> None:
    waiting, alone = run_ranks(alone_at_tp1, 2)
    assert alone == "wrapped"
    assert "comparing the ranks' sizes and plans in wrap over ranks [0, 1] failed" in waiting, waiting
    assert "Every rank must call wrap with the same tp_size and cp_size: a rank at tp_size=1 and cp_size=1" in waiting


class FeatureConfig(PretrainedConfig):
    model_type = "autotp_test_features"

    def __init__(self, hidden_size: int = 64, intermediate_size: int = 96, num_hidden_layers: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size, self.intermediate_size, self.num_hidden_layers = hidden_size, intermediate_size, num_hidden_layers


class FeatureMLP(nn.Module):
    def __init__(self, config: FeatureConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class FeatureModel(PreTrainedModel):
    """A regressor over feature vectors: its forward takes `inputs_embeds`, never `input_ids`."""

    config_class = FeatureConfig

    def __init__(self, config: FeatureConfig):
        super().__init__(config)
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.blocks = nn.ModuleList(FeatureMLP(config) for _ in range(config.num_hidden_layers))
        self.head = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, inputs_embeds: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        x = inputs_embeds
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        logits = self.head(x).squeeze(-1)
        loss = None if labels is None else nn.functional.mse_loss(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


FEATURE_POLICY = {"mlp": [{"match": "blocks.*", "column": ["up"], "row": ["down"]}]}


def feature_model() -> FeatureModel:
    torch.manual_seed(0)
    return FeatureModel(FeatureConfig())


def explicit_plan(rank: int, world: int) -> dict:
    with pytest.raises(ValueError) as err:
        autotp.wrap(feature_model(), world, policy=FEATURE_POLICY)
    generator = torch.Generator().manual_seed(1)
    features, targets = torch.randn(2, 8, 64, generator=generator), torch.randn(2, 8, generator=generator)
    reference = feature_model()
    model = autotp.wrap(feature_model(), world, policy=FEATURE_POLICY, example_inputs={"inputs_embeds": features[:1]})
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (reference, model)]
    losses = []
    for _ in range(3):
        for m, opt in zip((reference, model), optimizers):
            loss = m(inputs_embeds=features, labels=targets).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    group = autotp.tp_group(model)
    ref = dict(reference.named_parameters())
    params = {n: (full_tensor(p, p, group) - ref[n].detach()).abs().max().item() for n, p in model.named_parameters()}
    return {"refusal": str(err.value), "losses": losses, "params": params,
            "sharded": sum(hasattr(p, "autotp_shard") for p in model.parameters())}


def test_an_explicit_plan_is_verified_on_example_inputs_or_refused() -> None:
    for report in run_ranks(explicit_plan, 2):
        assert "example_inputs=" in report["refusal"] and "inputs_embeds" in report["refusal"], report["refusal"]
        assert report["sharded"] == 6  # up.weight, up.bias and down.weight of both blocks (down.bias is whole)
        losses = report["losses"]
        assert max(abs(a - b) for a, b in zip(losses[::2], losses[1::2])) < LOSS_ATOL
        assert max(report["params"].values()) < PARAM_ATOL, report["params"]


def state_dicts(rank: int, world: int, directory: str) -> dict:
    model = autotp.wrap(tiny_model("llama"), world)
    ids = batch()
    own = Path(directory) / f"rank{rank}.pt"
    torch.save(model.state_dict(), own)
    dist.barrier()
    out: dict = {}
    saved = torch.load(Path(directory) / "rank0.pt", weights_only=True)  # rank 0's dict, on every rank
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        model.load_state_dict(saved)
        out["rank0_dict"] = None
    except RuntimeError as err:
        out["rank0_dict"] = str(err)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a training step, say
    model.load_state_dict(torch.load(own, weights_only=True))  # this rank's own dict
    out["own_restored"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    other = tiny_model("llama", seed=7)  # a one-process model's full state dict
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        out["full_logits"] = (model(ids).logits - other(ids).logits).abs().max().item()

    third = tiny_model("llama", seed=8)
    with autotp.GatherReplacedLayerParams(model):
        model.load_state_dict(third.state_dict())  # full weights inside: loads as it would in one process
    with torch.no_grad():
        out["gathered_logits"] = (model(ids).logits - third(ids).logits).abs().max().item()

    plain = Path(directory) / f"rank{rank}.safetensors"  # a shard-shaped dict that lost its metadata
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, plain)
    try:
        model.load_state_dict(load_file(plain))
        out["safetensors"] = None
    except RuntimeError as err:
        out["safetensors"] = str(err)
    return out


def test_a_plain_state_dict_says_whose_rows_it_holds(tmp_path: Path) -> None:
    reports = run_ranks(state_dicts, 2, str(tmp_path))
    assert reports[0]["rank0_dict"] is None  # rank 0's own
    assert "state dict tensor model.embed_tokens.weight (128, 64) was saved by TP rank 0 of 2, but this is TP rank 1 " \
           "of 2" in reports[1]["rank0_dict"], reports[1]["rank0_dict"]
    assert "autotp.save_checkpoint" in reports[1]["rank0_dict"]
    for report in reports:
        assert report["unchanged"] and report["own_restored"]
        assert report["full_logits"] < 1e-5  # fp32, only the order of sums differs
        assert report["gathered_logits"] < 1e-5
        assert "no record of the rank that saved it" in report["safetensors"], report["safetensors"]
        assert "autotp.save_checkpoint" in report["safetensors"]
