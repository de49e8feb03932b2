"""One MoE layer's experts split by expert over the EP group, reached by an all-to-all of the routed tokens.

transformers' experts modules (`@use_experts_implementation`: qwen3_moe, mixtral, olmoe, ...) take
`experts(hidden_states, top_k_index, top_k_weights)` after the model's own router, so routing stays the model's: its
gate, top-k and normalisation. `ExpertRegion` keeps this rank's experts (whole, consecutive) and replaces the module's
forward by: this TP rank's tokens; permute the (token, slot) pairs by expert; all-to-all of the counts, then of the
tokens (dropless: buffers follow the counts); the local experts by the module's own implementation (`grouped_mm`,
`batched_mm` or its loop), top-1 with unit weights; the reverse all-to-all; un-permute, weight by the routing weights
and sum over the slots as transformers sums them; the TP ranks' tokens gathered back.

Notation of the shape comments (as Megatron's token dispatcher writes them):

    T    tokens of the layer's input, the same on every TP rank of this one
    t    this TP rank's share of them, T / tp rounded up or down (`dim0_share`; t = T without TP)
    H    hidden size
    k    slots per token: the router's top-k
    E    experts of the layer; each of the `ep` EP ranks holds E / ep consecutive ones (`local`)
    S    (token, slot) pairs this rank sends: t k
    R    (token, slot) pairs this rank receives from the EP group, to run on its experts
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import named_failure
from ..planning.sharding import Partition, Shard
from ..runtime.process_hooks import patch_attribute
from ..runtime.seq_collectives import dim0_share, gather_dim0_shares, keep_dim0_share
from .collectives import exchange, exchange_counts
from .groups import ExpertGroups

_OVER_TP = " of the expert-parallel tokens over TP"


class ExpertRegion:
    """An experts module holding this EP rank's experts (`names`: its parameters, dotted, each holding the experts as
    equal consecutive blocks of dim 0: `autotp.ep.regions`); they carry `autotp_expert` (this object), which the
    gradient sync, the norm and the state paths read (`held`: this rank's rows as a `Shard` over the EP group)."""

    def __init__(self, path: str, module: nn.Module, names: list[str], experts: ExpertGroups, tp_group, state):
        self.path, self.module, self.names, self.experts, self.tp_group = path, module, names, experts, tp_group
        self.state, self.modality = state, None  # modality: its `autotp.ep.modality.ModalityGroup`, if any
        # a backward ran through a call on tokens of this rank's since the last gradient sync (`autotp.ep.grads`): set
        # by the backward, as one process's module gets a gradient only then (not after a forward that raised)
        self.fed = False
        self.total = module.num_experts
        self.local = self.total // experts.size
        self.first = experts.rank * self.local
        self.own_forward = type(module).forward.__get__(module)  # the class's: transformers' implementation dispatch
        # the same on this rank's experts: E / ep of them, passed through a view (`_LocalExperts`), the module untouched
        self.local_forward = type(module).forward.__get__(_LocalExperts(module, self.local))
        for name in names:
            old = module.get_parameter(name)
            new = nn.Parameter(self._mine(old.data).clone(), requires_grad=old.requires_grad)
            new.autotp_expert = self
            self._set(name, new)
        self.blocks = {p.shape[0]: p.shape[0] // self.local for p in map(module.get_parameter, names)}
        patch_attribute(module, "forward", self.forward)
        module.autotp_region = self

    def held(self, tensor: torch.Tensor) -> Shard | None:
        """The `Shard` of the full tensor that `tensor` (one of the parameters, or a tensor shaped like one) holds:
        None once gathered whole (every expert on every rank)."""
        per = self.blocks.get(tensor.shape[0])  # this rank's rows -> rows per expert; a whole tensor is not there
        return (
            None
            if per is None
            else Shard(Partition.even(0, self.total * per, self.experts.size, per), self.experts.rank)
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        if self.state.is_gathered():  # whole experts: the module as one process runs it
            return self.own_forward(hidden_states, top_k_index, top_k_weights, **kwargs)
        if self.modality is not None:
            self.modality.before(self, hidden_states)
        shape = hidden_states.shape  # [tokens, hidden], or DBRX's [batch, seq, hidden]
        out = self._dispatch(hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
        # never a view: an in-place op on a view an FSDP2 module returned would drop FSDP's pre-backward hook (torch
        # warns of it); DBRX's 3-D output costs one copy of the layer's output
        return out if out.shape == shape else out.view(shape).clone()

    @torch.compiler.disable
    def _dispatch(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The dispatch, run eagerly under torch.compile: its buffers follow the routed counts (`bincount`, then
        `tolist` for the all-to-all's splits), data-dependent sizes dynamo would break on several times a layer;
        one break a MoE layer leaves the rest of each block in whole graphs."""
        n_tokens, slots = hidden_states.shape[0], top_k_index.shape[-1]  # T, k
        hidden, weights = keep_dim0_share((hidden_states, top_k_weights), self.tp_group, of=_OVER_TP)  # [t, H], [t, k]
        mine = dim0_share(n_tokens, self.tp_group)
        expert_ids = top_k_index[mine.start : mine.stop].reshape(-1)  # [S]: pair p is token p // k's slot p % k
        order = torch.argsort(expert_ids, stable=True)  # [S]: the pairs by expert, so by destination rank
        counts = torch.bincount(expert_ids, minlength=self.total).view(self.experts.size, self.local)  # [ep, E/ep]
        received_counts = exchange_counts(counts, self.experts.ep)  # [ep, E/ep]: row j, what rank j sends here
        send, receive = counts.sum(1).tolist(), received_counts.sum(1).tolist()  # [ep] each: S and R in total
        tokens = exchange(hidden[order // slots], send, receive, self.experts.ep)  # [S, H] sent -> [R, H]
        # Received layout: rank 0's pairs, then rank 1's, ...; each rank's run is sorted by expert (its `order`), so it
        # is received_counts[j, 0] pairs for local expert 0, then received_counts[j, 1] for expert 1, ...
        local_ids = torch.arange(self.local, device=tokens.device).repeat(self.experts.size)  # [ep E/ep]
        local_ids = local_ids.repeat_interleave(received_counts.reshape(-1), output_size=tokens.shape[0])  # [R]
        output = exchange(self._run_local(tokens, local_ids), receive, send, self.experts.ep)  # [R, H] -> [S, H]
        # The reverse all-to-all returns each pair's output where it was sent from: row i is pair order[i]. Indexing
        # by the inverse permutation (argsort of `order`: inverse[order[i]] = i) puts pair p back at row p.
        by_slot = output[torch.argsort(order)].view(-1, slots, output.shape[-1])  # [t, k, H]
        combined = (by_slot * weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)  # [t, H]
        out = gather_dim0_shares(combined, n_tokens, self.tp_group, of=_OVER_TP)  # [T, H]
        if n_tokens and out.requires_grad:  # here, run eagerly: a hook on a tensor would break a compiled graph
            out.register_hook(self._backward_ran)
        return out

    def _backward_ran(self, grad: torch.Tensor) -> None:
        self.fed = True

    def dispatch_nothing(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The dispatch with no token of this rank's (`autotp.ep.modality`): its all-to-alls still pair with the
        peers', and its experts still run on the tokens they send. Zero tokens of `hidden_states`, so the backward
        reaches the tokens' all-to-all as the peers' does; called as the module, so FSDP gathers its experts."""
        none = hidden_states.reshape(-1, hidden_states.shape[-1])[:0]
        index = torch.zeros((0, 1), dtype=torch.long, device=none.device)
        return self.module(none, index, none.new_zeros((0, 1)))

    def _mine(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole tensor: its block of dim 0 (one row per expert, or DBRX's width rows)."""
        per = tensor.shape[0] // self.total
        return tensor[self.first * per : (self.first + self.local) * per]

    def _set(self, name: str, param: nn.Parameter) -> None:
        owner, _, attr = name.rpartition(".")
        setattr(self.module.get_submodule(owner) if owner else self.module, attr, param)

    def _run_local(self, tokens: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The local experts on the received tokens, each top-1 with weight 1 (the weights are the sender's)."""
        if tokens.shape[0] == 0:  # still in the graph, so the reverse all-to-all runs; zero gradients, not None
            anchor = sum(self.module.get_parameter(name).reshape(-1)[:0].sum() for name in self.names)
            return tokens * 0 + anchor
        ones = tokens.new_ones(tokens.shape[0], 1)
        return self.local_forward(tokens, local_ids.unsqueeze(-1), ones).reshape(tokens.shape)

    def gather_(self) -> None:
        """Every expert on every rank (GatherReplacedLayerParams): all-gathered over the EP group."""
        for name in self.names:
            param = self.module.get_parameter(name)
            parts = [torch.empty_like(param.data) for _ in range(self.experts.size)]
            with named_failure(self.experts.ep, "the all-gather of the experts"):
                dist.all_gather(parts, param.data.contiguous(), group=self.experts.ep)
            param.data = torch.cat(parts)

    def partition_(self) -> None:
        for name in self.names:
            param = self.module.get_parameter(name)
            param.data = self._mine(param.data).clone()


class _LocalExperts:
    """An experts module as its own forward sees it on this rank's experts only: `num_experts` is the local count (the
    implementations size their per-expert counts by it), every other attribute is the module's."""

    def __init__(self, module: nn.Module, num_experts: int):
        self._experts_module, self.num_experts = module, num_experts

    def __getattr__(self, name: str):
        return getattr(self._experts_module, name)
