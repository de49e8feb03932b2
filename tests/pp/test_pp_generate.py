"""`model.generate` and evaluation at pp 2: one process's greedy tokens, and a batch whose rows do not divide into
`pp_microbatches` (generate's single row included).

fp32, so greedy tokens are equal (the logits differ only in the order of sums, far below any gap between the top two
tokens of these models) and the evaluated loss is within 1e-5 (parity.LOSS_ATOL). One spawn runs every case.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model


def generate_cases(rank: int, world: int) -> dict:
    """Per family: one process's and the pipeline's tokens (two rows left-padded, then one row), and the evaluated
    loss of 3 rows at 2 micro-batches."""
    results = {}
    for family in ("llama", "gpt2"):
        reference = tiny_model(family)
        model = autotp.wrap(copy.deepcopy(reference), 1, pp_size=2, pp_microbatches=2)
        ids = batch(size=(2, 6), seed=3)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0  # the second row left-padded, as generation pads
        settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        tokens = []
        for inputs in ({"input_ids": ids, "attention_mask": mask}, {"input_ids": ids[:1]}):
            tokens.append((model.generate(**inputs, **settings), reference.generate(**inputs, **settings)))
        rows = batch(size=(3, 8), seed=4)
        with torch.no_grad():
            got, want = model(input_ids=rows, labels=rows), reference(input_ids=rows, labels=rows)
        results[family] = {
            "tokens": [(a.tolist(), b.tolist()) for a, b in tokens],
            "eval": (abs(got.loss.item() - want.loss.item()), (got.logits - want.logits).abs().max().item()),
        }
    for schedule, microbatches in (("1F1B", 1), ("Interleaved1F1B", 5)):  # what torch's schedules cannot run
        try:
            autotp.wrap(
                tiny_model("llama", num_hidden_layers=4),
                1,
                pp_size=2,
                pp_schedule=schedule,
                pp_microbatches=microbatches,
            )
        except ValueError as err:
            results[schedule] = str(err)
    return results


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(generate_cases, 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pp2_generate_gives_one_process_greedy_tokens_on_every_rank(reports: list[dict], family: str) -> None:
    for report in reports:
        for got, expected in report[family]["tokens"]:
            assert got == expected, (family, got, expected)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pp2_evaluates_rows_that_do_not_divide_into_the_micro_batches(reports: list[dict], family: str) -> None:
    for report in reports:
        loss, logits = report[family]["eval"]
        assert loss < parity.LOSS_ATOL and logits < 1e-4, report[family]["eval"]


def test_micro_batch_counts_torchs_schedules_cannot_run_are_refused_at_wrap(reports: list[dict]) -> None:
    assert "pp_microbatches >= 2" in reports[0]["1F1B"], reports[0]
    assert "a multiple of 2" in reports[0]["Interleaved1F1B"], reports[0]
