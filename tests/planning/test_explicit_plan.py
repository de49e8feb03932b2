"""An explicit plan for a model autotp has never seen (a regressor over feature vectors) is refused without example
inputs, and verified on them otherwise: it then trains as one process (tolerances autotp.testing's: fp32, loss 1e-5,
parameters 3e-5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

import autotp
from autotp.testing import LOSS_ATOL, PARAM_ATOL, full_tensor, run_ranks


class FeatureConfig(PretrainedConfig):
    model_type = "autotp_test_features"

    def __init__(self, hidden_size: int = 64, intermediate_size: int = 96, num_hidden_layers: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size, self.intermediate_size, self.num_hidden_layers = (
            hidden_size,
            intermediate_size,
            num_hidden_layers,
        )


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
    return {
        "refusal": str(err.value),
        "losses": losses,
        "params": params,
        "sharded": sum(hasattr(p, "autotp_shard") for p in model.parameters()),
    }


def test_an_explicit_plan_is_verified_on_example_inputs_or_refused() -> None:
    for report in run_ranks(explicit_plan, 2):
        assert "example_inputs=" in report["refusal"] and "inputs_embeds" in report["refusal"], report["refusal"]
        assert report["sharded"] == 6  # up.weight, up.bias and down.weight of both blocks (down.bias is whole)
        losses = report["losses"]
        assert max(abs(a - b) for a, b in zip(losses[::2], losses[1::2])) < LOSS_ATOL
        assert max(report["params"].values()) < PARAM_ATOL, report["params"]
