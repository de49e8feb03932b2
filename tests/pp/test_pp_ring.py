"""Pipeline parallelism walked through the edge rows (held-out probing, issue 49's ring) at pp 2, in one `run_ranks`
spawn, each case against one process set up as a user would (plain transformers, same seed, same calls): bf16 under
GPipe; a micro-batch whose labels are all -100, and a batch with none; a frozen last stage under `clip_grad_norm_`;
tied embeddings with the embedding frozen; gradients accumulated over two `forward_backward` calls; the chunked loss
over several chunks a micro-batch; evaluation without labels, in training mode; `generate` of one row; a bf16 model
saved at pp 2 and loaded by plain transformers.

fp32 tolerances are `autotp.testing.parity`'s (the micro-batches and chunks only reorder sums); bf16's is
tests/pp/test_pp_edges.py's (3 times one process's bf16-against-fp32 yardstick, see its docstring).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
import transformers as tf

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from edge_workers import bf16_parity
from ep_workers import whole
from models import batch, tiny_model
from pp_workers import pp_batch

BF16_FACTOR = 3


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: whole(p.grad, p, model).float() for n, p in model.named_parameters() if p.grad is not None}


def compare(
    build: Callable[[], torch.nn.Module],
    batches: list[dict],
    clip: float | None = None,
    steps: bool = True,
    **options: Any,
) -> dict:
    """One process and the wrapped copy (pp 2) through the same calls: `forward_backward` of each batch (accumulated,
    no zero_grad between), `allreduce_gradients`, optionally `clip_grad_norm_`, one AdamW step. The losses, the
    gradients' worst error over what this rank trains, the clip norms, and the parameters' worst error after the step
    (NaN if any parameter is not finite); `trained`: the count of this rank's parameters with a gradient."""
    reference = build()
    model = autotp.wrap(copy.deepcopy(reference), 1, pp_size=2, **options)
    losses = [[], []]
    for inputs in batches:
        losses[0].append(autotp.forward_backward(reference, **inputs).loss.item())
        losses[1].append(autotp.forward_backward(model, **inputs).loss.item())
    autotp.allreduce_gradients(model)
    got, want = grads_of(model), {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    report: dict[str, Any] = {
        "losses": losses,
        "grad": max((parity.grad_error(g, want[n]) for n, g in got.items()), default=0.0),
        "missing": sorted(set(got) - set(want)),
        "trained": len(got),
    }
    if clip is not None:
        expected = torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], clip)
        report["norms"] = (autotp.clip_grad_norm_(model, clip).item(), expected.item())
    if steps:
        for m in (reference, model):
            trained = [p for p in m.parameters() if p.grad is not None]  # none: a stage with nothing to train
            if trained:
                torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.1).step()
        ref = dict(reference.named_parameters())
        errors = [(whole(p, p, model) - ref[n]).abs().max().item() for n, p in model.named_parameters() if n in got]
        report["param"] = max(errors, default=0.0)
        report["finite"] = all(torch.isfinite(p).all().item() for p in model.parameters())
    return report


def llama(**config: Any) -> Callable[[], torch.nn.Module]:
    return lambda: tiny_model("llama", **config).train()


def frozen(build: Callable[[], torch.nn.Module], names: tuple[str, ...]) -> Callable[[], torch.nn.Module]:
    def frozen_build() -> torch.nn.Module:
        model = build()
        for name, p in model.named_parameters():
            if name.startswith(names):
                p.requires_grad_(False)
        return model

    return frozen_build


def tied_frozen_embedding() -> torch.nn.Module:
    model = tiny_model("llama", tie_word_embeddings=True).train()
    model.tie_weights()
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def ignored_rows(rows: tuple[int, ...]) -> dict:
    """`pp_batch` with every label of `rows` -100 (a prompt-only row: its micro-batch learns from nothing)."""
    inputs = pp_batch()
    for row in rows:
        inputs["labels"][row] = -100
    return inputs


def evaluation(rank: int) -> dict:
    """The model called under no_grad: without labels (in training mode, as a user's periodic check in a training loop
    leaves it), and with them; and `generate` of one row: the differences from one process's."""
    reference, model = tiny_model("llama").train(), autotp.wrap(tiny_model("llama").train(), 1, pp_size=2)
    inputs = pp_batch(seed=5)
    out: dict[str, Any] = {}
    with torch.no_grad():
        got = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        want = reference(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        out["no labels"] = (got.loss, (got.logits - want.logits).abs().max().item())
        got, want = model.eval()(**inputs), reference.eval()(**inputs)
        out["labels"] = (abs(got.loss.item() - want.loss.item()), (got.logits - want.logits).abs().max().item())
        ids = batch(size=(1, 5), seed=9)
        settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        tokens = [m.generate(input_ids=ids, **settings) for m in (model, reference)]
        out["generate 1 row"] = torch.equal(*tokens)
    return out


def saved_bf16(path: str) -> dict:
    """A bf16 model wrapped at pp 2, saved with `autotp.save_pretrained`, loaded by transformers: each tensor against
    the bf16 model one process holds (exactly: nothing trained)."""
    reference = tiny_model("llama").to(torch.bfloat16)
    model = autotp.wrap(copy.deepcopy(reference), 1, pp_size=2)
    autotp.save_pretrained(model, path)
    torch.distributed.barrier()
    loaded = tf.AutoModelForCausalLM.from_pretrained(path)
    want = reference.state_dict()
    return {
        "dtype": str(loaded.dtype),
        "differ": sorted(n for n, t in loaded.state_dict().items() if not torch.equal(t, want[n])),
        "keys": sorted(set(want) ^ set(loaded.state_dict())),
    }


def ring(rank: int, world: int, path: str) -> dict:
    """Every 2-rank case of this module."""
    two = dict(pp_microbatches=2)
    report: dict[str, Any] = {
        "bf16 GPipe": bf16_parity(rank, world, 1, 2, dict(pp_schedule="GPipe", pp_microbatches=2)),
        "one micro-batch ignored": compare(llama(), [ignored_rows((0,))], pp_microbatches=4),
        "all ignored": compare(llama(), [ignored_rows((0, 1, 2, 3))], **two),
        "seq 1": compare(llama(), [pp_batch(seq=1, pads=(0, 0, 0, 0))], **two),
        "frozen last stage": compare(
            frozen(llama(), ("model.layers.1.", "model.norm.", "lm_head.")), [pp_batch()], clip=1e-3, **two
        ),
        "tied, embedding frozen": compare(tied_frozen_embedding, [pp_batch()], clip=1e-3, **two),
        "accumulated": compare(llama(), [pp_batch(seed=1), pp_batch(seq=12, seed=2)], **two),
        "chunks of 4": compare(llama(), [ignored_rows((1,))], pp_microbatches=4, loss_chunk=4),
        "evaluation": evaluation(rank),
        "saved bf16": saved_bf16(path),
    }
    try:  # ranks that disagree on the micro-batches: named at wrap on every rank
        autotp.wrap(tiny_model("llama"), 1, pp_size=2, pp_microbatches=2 + 2 * rank)
        report["disagree"] = "wrapped"
    except (ValueError, RuntimeError) as error:
        report["disagree"] = str(error)
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(ring, 2, str(tmp_path_factory.mktemp("ring")))


def test_bf16_under_gpipe_within_bf16_noise(reports: list[dict]) -> None:
    for report in reports:
        result = report["bf16 GPipe"]
        for name in ("loss", "param", "eval loss", "eval logits", "generate logits"):
            yardstick, error = result[name]
            assert 0 < yardstick and error <= BF16_FACTOR * yardstick, (name, result[name])
        assert result["tokens"]["wrapped"] == result["tokens"]["bf16"]


PARITY = ("one micro-batch ignored", "frozen last stage", "tied, embedding frozen", "accumulated", "chunks of 4")


def test_each_training_case_is_one_process(reports: list[dict]) -> None:
    for report in reports:
        for case in PARITY:
            result = report[case]
            for got, want in zip(*result["losses"], strict=True):
                assert abs(got - want) <= parity.LOSS_ATOL, (case, result)
            assert result["grad"] <= parity.GRAD_RTOL and result["param"] <= parity.PARAM_ATOL, (case, result)
            assert result["finite"] and not result["missing"], (case, result)
            if "norms" in result:
                got, want = result["norms"]
                assert abs(got - want) <= 1e-5 * want, (case, result)
    assert reports[1]["frozen last stage"]["trained"] == 0 < reports[0]["frozen last stage"]["trained"]


def test_a_batch_with_no_label_gives_nan_and_leaves_the_model_finite(reports: list[dict]) -> None:
    for report in reports:
        for case in ("all ignored", "seq 1"):
            result = report[case]
            assert all(math.isnan(x) for losses in result["losses"] for x in losses), (case, result)
            assert result["grad"] == 0.0 and result["finite"] and result["param"] <= parity.PARAM_ATOL, (case, result)


def test_evaluation_without_labels_and_generate_of_one_row_are_one_process(reports: list[dict]) -> None:
    for report in reports:
        result = report["evaluation"]
        loss, logits = result["no labels"]
        assert loss is None and logits <= 1e-5, result
        assert result["labels"][0] <= parity.LOSS_ATOL and result["labels"][1] <= 1e-5, result
        assert result["generate 1 row"], result


def test_a_bf16_model_saved_at_pp2_loads_in_transformers_as_it_was(reports: list[dict]) -> None:
    for report in reports:
        assert report["saved bf16"] == {"dtype": "torch.bfloat16", "differ": [], "keys": []}, report["saved bf16"]


def test_ranks_that_disagree_on_pp_microbatches_are_named_at_wrap(reports: list[dict]) -> None:
    for report in reports:
        assert "pp_microbatches" in report["disagree"], report["disagree"]
