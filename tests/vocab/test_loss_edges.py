"""The causal-LM loss's edges (issue 49), at every setting of the chunked and the vocab-parallel loss, against one
process (plain transformers, same seed, same calls): a batch with no label to learn from, `output.logits` read
after an optimizer step or first under no_grad, `logits_to_keep` with full-length labels, second-order gradients,
`label_smoothing` passed to the forward, and an fp16 or bf16 head's gradient.

The settings run in two spawns' worth of work: tp 1 in the test process, tp 2 in one `run_ranks` call, each
returning a report that the tests below read (a module fixture). fp32 tolerances are `autotp.testing.parity`'s: the
chunks and the shards only change the order of sums.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, labels_with_ignored, tiny_model

SETTINGS = {  # at tp 1 only the first two: no head to split
    "chunked": dict(loss_chunk=4),
    "whole": dict(loss_chunk=None),
    "chunked, replicated head": dict(loss_chunk=4, vocab_parallel=False),
    "whole, replicated head": dict(loss_chunk=None, vocab_parallel=False),
}
IDS = batch(vocab=250, size=(2, 15))
LABELS = labels_with_ignored(IDS)


def build() -> torch.nn.Module:
    # eager attention: CPU's SDPA kernel has no second derivative, in one process either
    return tiny_model("llama", vocab_size=250, _attn_implementation="eager").train()


def pair(world: int, options: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    return build(), autotp.wrap(build(), world, **options)


def worst(model: torch.nn.Module, reference: torch.nn.Module, of: Callable[[torch.nn.Parameter], Any]) -> float:
    """The largest `parity.grad_error` over the parameters of `of(parameter)` (its gradient, or itself)."""
    group, want = model.autotp_state.tp_group, dict(reference.named_parameters())
    return max(parity.grad_error(parity.full_tensor(of(p), p, group), of(want[n])) for n, p in model.named_parameters())


def message(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def all_ignored(world: int, options: dict) -> dict:
    """Every label -100 (a prompt-only batch), given as num_items_in_batch=0, then counted, then an AdamW step."""
    out: dict[str, Any] = {}
    reference, model = pair(world, options)
    for name, extra in (("num_items_in_batch=0", {"num_items_in_batch": torch.tensor(0)}), ("counted", {})):
        losses = []
        for m in (reference, model):
            m.zero_grad()
            loss = m(input_ids=IDS, labels=torch.full_like(IDS, -100), **extra).loss
            loss.backward()
            losses.append(loss.item())
        nonzero = [sum(int((p.grad != 0).sum()) for p in m.parameters()) for m in (reference, model)]  # NaN counts
        out[name] = {"losses": losses, "nonzero gradients": nonzero}
    for m in (reference, model):
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1).step()
    group = model.autotp_state.tp_group
    out["step"] = {
        "finite": all(parity.full_tensor(p, p, group).isfinite().all() for p in model.parameters()),
        "parameters": worst(model, reference, lambda p: p),
    }
    return out


def update_head_in_place(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.5)


UPDATES: dict[str, Callable[[torch.nn.Module], None]] = {
    "fused AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True).step(),  # bumps no version
    "in place": update_head_in_place,
}


def logits_after_update(world: int, options: dict) -> dict:
    """`output.logits` first read after the head changed: the forward's, or refused; and those of a second forward,
    read before the change, after it."""
    out: dict[str, Any] = {}
    for name, update in UPDATES.items():
        reference, model = pair(world, options)
        expected, output = reference(input_ids=IDS, labels=LABELS), model(input_ids=IDS, labels=LABELS)
        read_before = model(input_ids=IDS, labels=LABELS)
        assert read_before.logits.shape == (2, 15, 250)
        for m, o in ((reference, expected), (model, output)):
            o.loss.backward()
            update(m)
        out[f"read before, {name}"] = (read_before.logits - expected.logits).abs().max().item()
        try:
            out[name] = (output.logits - expected.logits).abs().max().item()
        except RuntimeError as error:
            out[name] = message(error)
    return out


def read_under_no_grad(world: int, options: dict) -> float:
    """`output.logits` first read under no_grad, then trained through by a z-loss: the worst gradient error."""
    reference, model = pair(world, options)
    for m in (reference, model):
        output = m(input_ids=IDS, labels=LABELS)
        with torch.no_grad():
            output.logits.sum()
        (output.loss + 1e-2 * output.logits.logsumexp(-1).square().mean()).backward()
    return worst(model, reference, lambda p: p.grad)


def keep_five(model: torch.nn.Module) -> str:
    """`logits_to_keep=5` with labels of all 15 positions: the error, or that there was none."""
    try:
        model(input_ids=IDS, labels=LABELS, logits_to_keep=5)
    except (ValueError, RuntimeError) as error:
        return message(error)
    return "no error"


def second_order(world: int, options: dict, autocast: bool = False) -> float | str:
    """A gradient penalty (`create_graph=True`): the worst gradient error, or the refusal."""
    reference, model = pair(world, options)
    for m in (reference, model):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = m(input_ids=IDS, labels=LABELS).loss
        try:
            grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
            sum(g.float().square().sum() for g in grads).backward()
        except RuntimeError as error:
            return message(error)
    return worst(model, reference, lambda p: p.grad)


def smoothing_passed(world: int, options: dict) -> dict:
    """`label_smoothing=0.1` passed to the forward, which transformers' loss ignores: the loss's and gradients'
    differences."""
    reference, model = pair(world, options)
    losses = []
    for m in (reference, model):
        loss = m(input_ids=IDS, labels=LABELS, label_smoothing=0.1).loss
        loss.backward()
        losses.append(loss.item())
    return {"loss": abs(losses[1] - losses[0]), "grad": worst(model, reference, lambda p: p.grad)}


def edges(rank: int, world: int) -> dict:
    """Every case at every setting of tp=`world`."""
    report = {}
    for setting, options in list(SETTINGS.items())[: 2 if world == 1 else None]:
        reference, model = pair(world, options)  # for logits_to_keep, which changes nothing
        report[setting] = {
            "all ignored": all_ignored(world, options),
            "after update": logits_after_update(world, options),
            "no_grad read": read_under_no_grad(world, options),
            "logits_to_keep": keep_five(model),
            "one process's logits_to_keep": keep_five(reference),
            "second order": second_order(world, options),
            "label_smoothing": smoothing_passed(world, options),
        }
    if world == 1:
        report["whole"]["second order, autocast"] = second_order(world, SETTINGS["whole"], autocast=True)
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return [edges(0, 1), *run_ranks(edges, 2)]


def cases(reports: list[dict], case: str):
    """(setting, tp-labelled, value) of `case` in every rank's report."""
    for report in reports:
        for setting, values in report.items():
            yield setting, values[case]


def test_a_batch_with_no_label_gives_a_nan_loss_and_zero_gradients_as_one_process(reports: list[dict]) -> None:
    """Before, the mean's 1/0 reached the gradients as 0 x inf: every gradient NaN (the chunked loss and the
    vocab-parallel one), so the optimizer step made the model NaN. One process: NaN loss, gradients exactly 0, so an
    AdamW step only decays the weights."""
    for setting, case in cases(reports, "all ignored"):
        for name in ("num_items_in_batch=0", "counted"):
            assert all(loss != loss for loss in case[name]["losses"]), (setting, case)  # NaN, both
            assert case[name]["nonzero gradients"] == [0, 0], (setting, case)
        assert case["step"]["finite"] and case["step"]["parameters"] <= parity.PARAM_ATOL, (setting, case)


def test_logits_first_read_after_the_head_changed_are_refused_or_the_forwards(reports: list[dict]) -> None:
    """Before, the chunked loss's logits read after `optimizer.step()` were computed from the stepped head. The
    forward's head weights are gone then (keeping them costs a copy of the head each step), so the read is refused,
    naming the fix; a fused AdamW, which bumps no version counter, is seen by the optimizer hook. The whole logits
    (tp 2's lazy gather of the forward's shards included) and logits read before the step are the forward's."""
    for setting, after in cases(reports, "after update"):
        for name in UPDATES:
            assert after[f"read before, {name}"] <= 1e-5, (setting, after)
            if setting.startswith("chunked"):
                assert "Read output.logits before optimizer.step()" in str(after[name]), (setting, name, after)
                assert "loss_chunk=None" in after[name], (setting, name, after)
            else:
                assert after[name] <= 1e-5, (setting, name, after)


def test_logits_first_read_under_no_grad_still_carry_the_graph(reports: list[dict]) -> None:
    """Before, the first read (under no_grad) was cached without a graph: a z-loss on the logits added no gradient."""
    for setting, error in cases(reports, "no_grad read"):
        assert error <= parity.GRAD_RTOL, (setting, error)


def test_logits_to_keep_with_full_length_labels_is_refused_as_in_one_process(reports: list[dict]) -> None:
    """Before, the chunked loss returned a loss (and tp 2's raised an index error): now transformers' ValueError, or
    autotp's naming the fix where its loss runs (tp 1 without chunks runs transformers' own)."""
    for report in reports:
        for setting, values in report.items():
            theirs, ours = values["one process's logits_to_keep"], values["logits_to_keep"]
            assert theirs.startswith("ValueError"), theirs
            assert ours == theirs or ours.startswith("ValueError") and "logits_to_keep=0" in ours, (setting, ours)


def test_second_order_gradients_are_exact_or_refused_by_name(reports: list[dict]) -> None:
    """Before, the chunked loss dropped the head's terms, tp 2 dropped the collectives' (silently, every setting),
    and the GLU recompute crashed at tp 1. Exact at tp 1 without chunks (the GLU recompute differentiable as
    autograd's silu is); refused naming the option elsewhere."""
    fixes = {"chunked": "loss_chunk=None", "whole": "tp_size=1"}
    for rank, report in enumerate(reports):
        for setting, values in report.items():
            result = values["second order"]
            if rank == 0 and setting == "whole":  # tp 1
                assert result <= parity.GRAD_RTOL, result
                assert "recompute_glu=False" in values["second order, autocast"], values["second order, autocast"]
                continue
            assert "create_graph=True" in result and fixes[setting.split(",")[0]] in result, (rank, setting, result)


def test_label_smoothing_passed_to_the_forward_is_ignored_as_transformers_ignores_it(reports: list[dict]) -> None:
    """Before, it applied over chunks and on vocab-parallel shards, but not on whole logits at tp 1."""
    for setting, case in cases(reports, "label_smoothing"):
        assert case["loss"] <= parity.LOSS_ATOL and case["grad"] <= parity.GRAD_RTOL, (setting, case)


def head_gradients(dtype: torch.dtype, wrapped: bool) -> dict[str, torch.Tensor]:
    """The head's and final norm's gradients of one step in `dtype`, one process or chunked at tp 1; the final norm
    scaled so that the head's gradient summed over the 30 tokens (one target) exceeds fp16's range, its mean not."""
    model = tiny_model("llama", vocab_size=250).train()
    with torch.no_grad():
        model.model.norm.weight.fill_(3000.0)
    model = model.to(dtype)
    if wrapped:
        model = autotp.wrap(model, 1, loss_chunk=4)
    model(input_ids=IDS, labels=torch.full_like(IDS, 7)).loss.backward()
    return {"head": model.lm_head.weight.grad.float(), "norm": model.model.norm.weight.grad.float()}


def test_a_half_precision_heads_gradient_is_one_process_within_the_dtypes_noise() -> None:
    """Before, the chunks' fp32 sum was cast to fp16 before the mean's 1/N: inf entries where one process's are
    finite (bf16, of fp32's range, did not overflow: checked alike). Tolerance: twice one process's own error in the
    dtype against its fp32 run."""
    exact = head_gradients(torch.float32, False)
    for dtype in (torch.float16, torch.bfloat16):
        reference, ours = head_gradients(dtype, False), head_gradients(dtype, True)
        for name, want in exact.items():
            noise = parity.grad_error(reference[name], want)
            assert ours[name].isfinite().all(), (dtype, name)
            assert parity.grad_error(ours[name], reference[name]) <= 2 * noise, (dtype, name, noise)
