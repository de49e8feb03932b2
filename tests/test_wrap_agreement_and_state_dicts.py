"""Ranks that must agree, and state that must not cross ranks: DP replicas broadcast at wrap and checked; configs,
options and plans compared before the model is touched; plain state dicts tagged with their layout; explicit
plans applied with the user's example inputs; MoE experts at widths grouped_mm refuses.

Parity tolerances are autotp.testing's (fp32, only the order of sums differs): loss 1e-5, parameters 3e-5; logits
after a state-dict load 1e-5 for the same reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

import autotp
from autotp.testing import LOSS_ATOL, PARAM_ATOL, assert_parity, compare_training, full_tensor, run_ranks, tiny_config
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
    assert not autotp.parallel.apply.parallel_layers(model)  # refused before anything changed
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_built_or_wrapped_differently_are_named_before_anything_changes(case: str) -> None:
    for message in run_ranks(disagreeing, 2, case):
        assert DISAGREEMENTS[case][1] + " on rank 1" in message, message
        assert "ranks disagree before sharding" in message


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
