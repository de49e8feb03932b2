"""The MoE load-balancing loss under a pipeline, added across stages as one process adds it over layers.

transformers' Switch loss (`load_balancing_loss_func`, with `output_router_logits`) is, over every router layer and
every unmasked token of the whole batch, `E * sum_e (T_e / R) * (P_e / R)`: T_e the top-k picks of expert e, P_e the
sum of its routing probabilities, R the rows (layers x tokens). Only P carries a gradient (the picks are a top-k),
so with T and R known the loss is linear in each (stage, micro-batch)'s own P: each adds
`coef * E * sum_e T_e P_e / R**2` for its layers and rows, and those add up to one process's loss and gradients.
T and R are the whole batch's, over every stage, so a training step first runs torch's forward-only schedule to
count them (an extra forward), then the training schedule. A stage before the last adds its share to its backward
through its output (`_AddToBackward`, Megatron's MoEAuxLossAutoScaler), the last to its loss; the loss reported is
the sum over the stages. Evaluating counts T, P and R in its one forward.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..compat.hf import router_outputs
from ..mesh import Group, device_of, named_failure
from .cut import base_of

_SWITCH = "transformers.models.mixtral.modeling_mixtral"  # the Switch loss, as transformers copies it per model
_CALL = "load_balancing_loss_func(outputs.router_logits,self.num_experts,self.num_experts_per_tok,attention_mask,)"


def unsupported(model: nn.Module) -> str | None:
    """Why `model`'s load-balancing loss cannot be added across stages, or None: it must be transformers' Switch loss
    over every router's logits and the attention mask, scaled by `router_aux_loss_coef`."""
    module = importlib.import_module(type(model).__module__)
    function = getattr(module, "load_balancing_loss_func", None)
    switch = importlib.import_module(_SWITCH).load_balancing_loss_func
    if function is None or inspect.getsource(function) != inspect.getsource(switch):
        return f"{module.__name__} has no load_balancing_loss_func of transformers' Switch form"
    forward = re.sub(r"\s+", "", inspect.getsource(type(model).forward))
    if _CALL not in forward or "self.router_aux_loss_coef*aux_loss" not in forward:
        return f"{type(model).__name__}.forward does not add it as transformers' MoE causal LMs do"
    base = base_of(model) or model
    if router_outputs(base) is None:
        return f"{type(base).__name__} records no router_logits"
    return None


class _AddToBackward(torch.autograd.Function):
    """The hidden states unchanged; in the backward, `aux` gets the gradient 1, so a stage's share of the loss
    is differentiated with the rest of its backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux = (aux.shape, aux.dtype, aux.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux
        return grad, torch.ones(shape, dtype=dtype, device=device)


class Balance:
    """One rank's part of the load-balancing loss: its stages' routers, the counts of the forward-only pass and the
    shares of the training pass."""

    def __init__(self, model: nn.Module, group: Group):
        found = router_outputs(base_of(model) or model)
        assert found is not None  # `unsupported` refused the model otherwise
        self.is_router, self.index = found
        self.group = group
        self.experts, self.top_k = int(model.num_experts), int(model.num_experts_per_tok)
        self.coef = float(model.router_aux_loss_coef)
        self.counting = True
        self.weights: torch.Tensor | None = None  # coef * E * T / R**2 per expert, once counted
        self.sums = torch.zeros(2 * self.experts + 1)  # T, P and R of this rank's stages
        self.routed: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # this micro-batch's logits and mask
        self.sent = torch.zeros(())  # the shares of this rank's stages before the last, for the loss reported

    def hooks(self, layers: list[nn.Module], mask: torch.Tensor | None) -> list[Any]:
        """Forward hooks on the routers of `layers` for one micro-batch (its attention mask), removed by the caller."""
        flat = None if mask is None else mask.reshape(-1)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._routed(output[self.index], flat)

        return [m.register_forward_hook(hook) for layer in layers for m in layer.modules() if self.is_router(m)]

    def _routed(self, logits: torch.Tensor, mask: torch.Tensor | None) -> None:
        if not self.counting:  # its share is computed after the stage's layers (`take`): outside any checkpointed
            self.routed.append((logits, mask))  # layer, whose recomputation must save what its forward saved
            return
        probs = torch.softmax(logits.float(), dim=-1)
        weight = torch.ones(probs.shape[0], device=probs.device) if mask is None else mask.float()
        _, picked = torch.topk(probs, self.top_k, dim=-1)
        picks = torch.zeros(self.experts, device=probs.device)
        picks.scatter_add_(0, picked.reshape(-1), weight.repeat_interleave(self.top_k))
        prob = (probs * weight.unsqueeze(-1)).sum(0)
        self.sums += torch.cat([picks, prob, weight.sum().reshape(1)]).detach().cpu()

    def take(self) -> torch.Tensor | None:
        """This micro-batch's share of the loss on this stage (None while counting, or with no router)."""
        routed, self.routed = self.routed, []
        shares = []
        for logits, mask in routed:
            if not logits.requires_grad:  # the router ran under no_grad: reentrant checkpointing's forward
                raise RuntimeError(
                    "the MoE load-balancing loss under a pipeline needs the routers' logits with their graph; they "
                    "came without (activation checkpointing with use_reentrant=True): use use_reentrant=False"
                )
            assert self.weights is not None
            probs = torch.softmax(logits.float(), dim=-1)
            weight = torch.ones(probs.shape[0], device=probs.device) if mask is None else mask.float()
            shares.append(((probs * weight.unsqueeze(-1)).sum(0) * self.weights.to(probs.device)).sum())
        return torch.stack(shares).sum() if shares else None

    def attach(self, hidden: torch.Tensor) -> torch.Tensor:
        """A stage before the last: its share enters the backward through its output, and the loss reported."""
        share = self.take()
        if share is None:
            return hidden
        self.sent = self.sent + share.detach().cpu()
        return _AddToBackward.apply(hidden, share)

    def start(self) -> None:
        self.counting, self.weights = True, None
        self.sums.zero_()
        self.sent = torch.zeros(())

    def counted(self) -> torch.Tensor:
        """After the forward-only pass: T, P and R summed over the pipeline; from now on the shares are computed."""
        sums = self.sums.to(device_of(self.group))
        with named_failure(self.group, "the load-balancing loss's expert counts summed over the pipeline"):
            dist.all_reduce(sums, group=self.group)
        picks, rows = sums[: self.experts].cpu(), sums[-1].cpu()
        self.weights = self.coef * self.experts * picks / rows**2
        self.counting = False
        return sums.cpu()

    def loss(self, sums: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss from the counted sums (evaluation)."""
        picks, prob, rows = sums[: self.experts], sums[self.experts : -1], sums[-1]
        return self.coef * self.experts * (picks * prob).sum() / rows**2

    def sent_total(self) -> torch.Tensor:
        """The shares every rank's stages before the last added, summed over the pipeline."""
        sent = self.sent.reshape(1).to(device_of(self.group))
        with named_failure(self.group, "the load-balancing loss's shares summed over the pipeline"):
            dist.all_reduce(sent, group=self.group)
        return sent[0].cpu()
