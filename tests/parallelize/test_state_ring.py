"""The edges ring over state a user makes before or after `wrap` (issue 49's features): an optimizer made before
wrap (weight-decay groups by name as HF's Trainer builds them, an LR scheduler and clipping, an optimizer over named
parameters, a group per layer; at dp 2, under `autotp.fully_shard`, at pp 2, holding only replicated tensors at
tp 2), a user's `loss_function` at tp 2 (Trainer's `compute_loss_func` reading whole logits, bf16, every label
ignored, save and `GatherReplacedLayerParams` after it is set), hooks (before wrap refused by name, after wrap run on
whole outputs) and one linear registered under two names at tp 2.

Each case runs against one process set up alike (same seed, same calls). Tolerances: `autotp.testing.parity`'s fp32
ones (only the order of sums differs; AdamW with eps 1e-6 as `compare_training` uses); bf16's loss within 1e-3 (its
rounding of the 5.5 loss is 2e-2 per ulp, the two runs round alike but for the order of sums).

Before: an optimizer made before `autotp.fully_shard` silently trained nothing (FSDP2 puts new parameters in
place), and a linear registered twice (`layers[1].mlp.down_proj = layers[0].mlp.down_proj`) failed the wrap with
`KeyError: 'model.layers.1.mlp.down_proj'`.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, focal_loss, tiny_model
from pp_workers import pp_batch


def decay_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices only, by name, as transformers' Trainer groups them."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def per_layer(model: torch.nn.Module) -> list[dict]:
    """SGD with momentum, one group (and learning rate) per GPT-2 block, the rest in one more."""
    blocks = [{"params": list(b.parameters()), "lr": 1e-2 * (i + 1)} for i, b in enumerate(model.transformer.h)]
    return blocks + [{"params": [p for n, p in model.named_parameters() if ".h." not in n]}]


def before_wrap_at_tp1(family: str, make, clip: float | None) -> tuple[float, float]:
    """One step before wrap(model, 1), three after, with a LinearLR schedule (and clipping): worst loss and
    parameter differences against one process."""
    ids = batch()
    reference = tiny_model(family)
    model = copy.deepcopy(reference)
    runs = []
    for m in (reference, model):
        optimizer = make(m)
        runs.append([m, optimizer, torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=4)])

    def step(m, optimizer, scheduler) -> float:
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        return loss.item()

    losses = [(step(*runs[0]), step(*runs[1]))]
    runs[1][0] = autotp.wrap(model, 1)
    losses += [(step(*runs[0]), step(*runs[1])) for _ in range(3)]
    expected = dict(reference.named_parameters())
    return (
        max(abs(a - b) for a, b in losses),
        max((p - expected[n]).abs().max().item() for n, p in runs[1][0].named_parameters()),
    )


def test_an_optimizer_made_before_wrap_at_tp1_in_the_shapes_users_build() -> None:
    for label, family, make, clip in (
        ("decay groups, clip 0.1", "llama", lambda m: torch.optim.AdamW(decay_groups(m), lr=1e-3, eps=1e-6), 0.1),
        ("named parameters", "llama", lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-3, eps=1e-6), None),
        ("a group per layer", "gpt2", lambda m: torch.optim.SGD(per_layer(m), lr=1e-2, momentum=0.9), None),
        ("tied embeddings", "gemma", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6), None),
    ):
        loss, param = before_wrap_at_tp1(family, make, clip)
        assert loss <= parity.LOSS_ATOL and param <= parity.PARAM_ATOL, (label, loss, param)


def guarded(case) -> object:
    try:
        return case()
    except Exception as err:  # the report names it; the test fails on it
        return f"{type(err).__name__}: {err}"


def full(model: torch.nn.Module, tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    return parity.full_tensor(tensor, param, autotp.tp_group(model))


def param_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    expected = dict(reference.named_parameters())
    return max(
        (full(model, p.detach(), p) - expected[n]).abs().max().item()
        for n, p in model.named_parameters()
        if p.device.type != "meta"
    )


def compute_loss_func(ids: torch.Tensor) -> tuple[float, float]:
    """Trainer's `compute_loss_func` path at tp 2: the model called without labels, the user's loss on
    `outputs.logits` (whole), backward: loss and worst gradient error against one process."""
    reference = tiny_model("llama")
    model = autotp.wrap(copy.deepcopy(reference), 2)
    expected = focal_loss(reference(input_ids=ids).logits, ids)
    expected.backward()
    got = focal_loss(model(input_ids=ids).logits, ids)
    got.backward()
    grads = dict(reference.named_parameters())
    error = max(parity.grad_error(full(model, p.grad, p), grads[n].grad) for n, p in model.named_parameters())
    return abs(got.item() - expected.item()), error


def own_loss(ids: torch.Tensor, dtype: torch.dtype, labels: torch.Tensor) -> tuple[float, float]:
    """A user's loss set before wrap(model, 2): the loss in `dtype` against one process's, with `labels`."""
    reference = tiny_model("llama").to(dtype)
    reference.loss_function = focal_loss
    model = autotp.wrap(copy.deepcopy(reference), 2)
    return reference(input_ids=ids, labels=labels).loss.item(), model(input_ids=ids, labels=labels).loss.item()


def own_loss_saved(rank: int, ids: torch.Tensor) -> tuple[float, float, bool]:
    """A user's loss set after wrap(model, 2), then `autotp.save_pretrained` (loaded back against the one-process
    model) and a forward inside `GatherReplacedLayerParams` (against one process with that loss)."""
    reference = tiny_model("llama")
    model = autotp.wrap(copy.deepcopy(reference), 2)
    model.loss_function = focal_loss
    directory = [tempfile.mkdtemp(prefix="autotp-ring2-") if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    autotp.save_pretrained(model, directory[0])
    dist.barrier()
    back = AutoModelForCausalLM.from_pretrained(directory[0])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory[0])
    saved = max((back.state_dict()[n] - t).abs().max().item() for n, t in reference.state_dict().items())
    with autotp.GatherReplacedLayerParams(model):
        got = model(input_ids=ids, labels=ids).loss.item()
    reference.loss_function = focal_loss
    return saved, abs(got - reference(input_ids=ids, labels=ids).loss.item()), model.loss_function is focal_loss


def trained_two_steps(reference, model, make, ids, sync=lambda m: None) -> float:
    """Two steps of each, the model's optimizer from `make(model before wrap)` already: worst parameter error."""
    for m, optimizer in ((reference, make[0]), (model, make[1])):
        for _ in range(2):
            m(input_ids=ids, labels=ids).loss.backward()
            sync(m) if m is model else None
            optimizer.step()
            optimizer.zero_grad()
    return param_error(model, reference)


def optimizer_before(world_case: str, ids: torch.Tensor) -> object:
    """An optimizer made before wrap: at tp 2 over replicated tensors only (the norms), at dp 2 (tp 1), under
    `autotp.fully_shard` (refused at its step, nothing changed), at pp 2 (against one process)."""
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    if world_case == "norms at tp 2":
        optimizers = [
            torch.optim.AdamW([p for n, p in m.named_parameters() if "norm" in n], lr=1e-2) for m in (reference, model)
        ]
        return trained_two_steps(reference, autotp.wrap(model, 2), optimizers, ids)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (reference, model)]
    if world_case == "dp 2":
        return trained_two_steps(reference, autotp.wrap(model, 1), optimizers, ids, autotp.allreduce_gradients)
    if world_case == "fully_shard":
        autotp.fully_shard(autotp.wrap(model, 1))
        held = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        model(input_ids=ids, labels=ids).loss.backward()
        try:
            optimizers[1].step()
            refusal = "no error"
        except RuntimeError as err:
            refusal = str(err)
        return refusal, all(torch.equal(held[n], p.detach().full_tensor()) for n, p in model.named_parameters())
    autotp.wrap(model, 1, pp_size=2, pp_microbatches=2)  # pp 2
    inputs, losses = pp_batch(), []
    for _ in range(2):
        expected = reference(**inputs).loss
        expected.backward()
        losses.append(abs(autotp.forward_backward(model, **inputs).loss.item() - expected.item()))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return max(losses), param_error(model, reference)


def hooks_and_twice(ids: torch.Tensor) -> dict:
    """A forward hook on q_proj and a full backward hook on lm_head before wrap(model, 2) (refused, nothing changed);
    a hook after wrap on a decoder layer (its whole output, as one process's); one down_proj registered under two
    layers, trained two steps against one process."""
    out: dict = {}
    for label, hook in (
        ("q_proj", lambda m: m.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)),
        ("lm_head", lambda m: m.lm_head.register_full_backward_hook(lambda *a: None)),
    ):
        model = tiny_model("llama")
        hook(model)
        params = list(model.parameters())
        try:
            autotp.wrap(model, 2)
            out[label] = ("no error", False)
        except ValueError as err:
            out[label] = (str(err), all(a is b for a, b in zip(params, model.parameters())))
    reference = tiny_model("llama")
    model = autotp.wrap(copy.deepcopy(reference), 2)
    seen: dict = {}
    for key, m in (("reference", reference), ("wrapped", model)):
        m.model.layers[0].register_forward_hook(
            lambda mod, a, o, key=key: seen.__setitem__(key, o[0] if isinstance(o, tuple) else o)
        )
        m(input_ids=ids)
    out["hook after wrap"] = (seen["reference"] - seen["wrapped"]).abs().max().item()
    reference = tiny_model("llama")
    reference.model.layers[1].mlp.down_proj = reference.model.layers[0].mlp.down_proj
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    model = autotp.wrap(model, 2)
    out["registered twice"] = (
        trained_two_steps(reference, model, [optimizer, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)], ids),
        model.model.layers[1].mlp.down_proj is model.model.layers[0].mlp.down_proj,
    )
    return out


def two_ranks(rank: int, world: int) -> dict:
    ids = batch()
    report = {
        "compute_loss_func": guarded(lambda: compute_loss_func(ids)),
        "bf16": guarded(lambda: own_loss(ids, torch.bfloat16, ids)),
        "all ignored": guarded(lambda: own_loss(ids, torch.float32, torch.full_like(ids, -100))),
        "saved": guarded(lambda: own_loss_saved(rank, ids)),
        "hooks": guarded(lambda: hooks_and_twice(ids)),
    }
    for case in ("norms at tp 2", "dp 2", "fully_shard", "pp 2"):
        report[case] = guarded(lambda case=case: optimizer_before(case, ids))
    return report


def test_state_made_before_wrap_at_two_ranks() -> None:
    for report in run_ranks(two_ranks, 2):
        loss, grad = report["compute_loss_func"]
        assert loss <= parity.LOSS_ATOL and grad <= parity.GRAD_RTOL, report["compute_loss_func"]
        expected, got = report["bf16"]
        assert abs(expected - got) <= 1e-3, report["bf16"]
        assert all(math.isnan(x) for x in report["all ignored"]), report["all ignored"]  # the mean of nothing, alike
        saved, loss, kept = report["saved"]
        assert saved == 0.0 and loss <= parity.LOSS_ATOL and kept, report["saved"]
        hooks = report["hooks"]
        assert isinstance(hooks, dict), hooks  # before: KeyError: 'model.layers.1.mlp.down_proj' from the wrap
        for label, kind in (("q_proj", "1 forward hook"), ("lm_head", "1 backward hook")):
            message, unchanged = hooks[label]
            assert label in message and kind in message and "register it after wrap" in message, message
            assert unchanged, f"the refused wrap replaced {label}'s model parameters"
        assert hooks["hook after wrap"] <= 1e-6, hooks
        error, shared = hooks["registered twice"]
        assert error <= parity.PARAM_ATOL and shared, hooks["registered twice"]
        assert report["norms at tp 2"] <= parity.PARAM_ATOL, report["norms at tp 2"]
        assert report["dp 2"] <= parity.PARAM_ATOL, report["dp 2"]
        refusal, unchanged = report["fully_shard"]
        assert "model.embed_tokens.weight" in refusal and "after autotp.fully_shard" in refusal, refusal
        assert unchanged, "the refused step changed a weight"
        loss, param = report["pp 2"]
        assert loss <= parity.LOSS_ATOL and param <= parity.PARAM_ATOL, report["pp 2"]
