"""The zero-bubble schedules (ZBVZeroBubble, DualPipeV): the rank workers of tests/pp/test_pp_zero_bubble.py (a helper
module beside them; the parity harness itself is `pp_workers.pp_parity`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

import autotp
from autotp.state import state_of
from autotp.vocab.chunked import ChunkedHead
from models import tiny_model
from pp_workers import pp_batch, pp_parity, router_logits


def zb_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """`pp_parity` for each (family, tp, pp, options) in one set of ranks, with what its steps ran on this rank: the
    losses computed over chunks (`chunked`) and the weights' parts of a split backward (`weight_backwards`)."""
    counts = {"chunked": 0, "weight_backwards": 0}
    loss_sum, weight = ChunkedHead.loss_sum, PipelineStage.backward_weight_one_chunk

    def counted_loss(self: ChunkedHead, *args: Any) -> Any:
        total = loss_sum(self, *args)
        counts["chunked"] += total is not None
        return total

    def counted_weight(self: PipelineStage, *args: Any, **kwargs: Any) -> Any:
        counts["weight_backwards"] += 1
        return weight(self, *args, **kwargs)

    ChunkedHead.loss_sum, PipelineStage.backward_weight_one_chunk = counted_loss, counted_weight  # type: ignore[method-assign]
    results = []
    try:
        for case in cases:
            counts.update(chunked=0, weight_backwards=0)
            results.append({**pp_parity(rank, world, *case), **counts})
    finally:
        ChunkedHead.loss_sum, PipelineStage.backward_weight_one_chunk = loss_sum, weight  # type: ignore[method-assign]
    return results


def trained_layers(results: list[dict]) -> list[set[int]]:
    """The decoder layers each rank trained (from the parameters it compared)."""
    return [
        {int(n.split(".")[n.split(".").index("layers") + 1]) for n in r["errors"] if ".layers." in n} for r in results
    ]


def zb_refusals(rank: int, world: int, tp: int, path: str) -> dict[str, Any]:
    """What the zero-bubble schedules refuse at pp 2 (`tp`: the TP size), each by name and before the model changes:
    the message, and whether the model's parameters are the same objects, equal (for fully_shard: not sharded). At
    tp 1 also `saved`: whether a ZBV model saved to `path` loads in transformers as the model it was wrapped from."""
    import transformers as tf

    zbv = dict(pp_schedule="ZBVZeroBubble")
    cases: dict[str, tuple[Any, dict]] = {
        "pp_stages_per_rank": (lambda: tiny_model("llama", num_hidden_layers=6), dict(zbv, pp_stages_per_rank=3)),
        "DualPipeV microbatches": (lambda: tiny_model("llama"), dict(pp_schedule="DualPipeV", pp_microbatches=2)),
        "output_router_logits": (lambda: tf.AutoModelForCausalLM.from_config(router_logits("afmoe")), zbv),
    }
    if tp > 1:
        cases = {"overlap": (lambda: tiny_model("llama", num_hidden_layers=4), zbv)}
    refused = {}
    for name, (build, options) in cases.items():
        model = build()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            autotp.wrap(model, tp, pp_size=2, **options)
        except (NotImplementedError, ValueError) as err:
            same = all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and len(before) == len(
                list(model.parameters())
            )
            refused[name] = (str(err), same and not hasattr(model, "autotp_state"))
    if tp == 1:
        model = autotp.wrap(tiny_model("llama", num_hidden_layers=4), 1, pp_size=2, **zbv)
        refused["saved"] = saved_equal(model, path)
        model.model.layers[1].compile()  # in place, as for the other schedules: nothing compiles before a call
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            autotp.forward_backward(model, **pp_batch())
        except NotImplementedError as err:
            untouched = all(p.grad is None and torch.equal(p, before[n]) for n, p in model.named_parameters())
            refused["compile"] = (str(err), untouched)
        try:
            autotp.fully_shard(model)
        except NotImplementedError as err:
            refused["fully_shard"] = (str(err), not state_of(model).fsdp)
    return refused


def saved_equal(model: torch.nn.Module, path: str) -> bool | None:
    """`autotp.save_pretrained` of a wrapped, untrained 4-layer llama (each rank holding its V's stages; rank 0 the
    first and the last), loaded by transformers on rank 0: equal to the model wrap was given (None elsewhere)."""
    import transformers as tf

    autotp.save_pretrained(model, path)
    if torch.distributed.get_rank() != 0:
        return None
    loaded = dict(tf.AutoModelForCausalLM.from_pretrained(path).named_parameters())
    whole = dict(tiny_model("llama", num_hidden_layers=4).named_parameters())
    return loaded.keys() == whole.keys() and all(torch.equal(loaded[n], p) for n, p in whole.items())


def zb_run(rank: int, world: int, cases: list[tuple], tp: int, path: str = "") -> dict:
    """`zb_cases` and `zb_refusals` in one set of ranks."""
    return {"cases": zb_cases(rank, world, cases), "refused": zb_refusals(rank, world, tp, path)}
