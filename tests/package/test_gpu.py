"""The GPU path, marked `gpu` and skipped without CUDA (CI has none; the closing notes give the runs on one).

- NCCL: `wrap` over an NCCL group puts the model on the rank's GPU and trains it like one process.
- Two ranks on one GPU over gloo's CUDA support: parity with one process on the GPU, which exercises
  device placement of everything autotp allocates (buffers, partitions, collectives' outputs).
- bf16 autocast on the GPU at tp=2: the loss of a one-process bf16 run, to bf16 rounding.
- CUDA RNG under dropout: replicated activations bit-identical across TP ranks.
- torch.compile with inductor on a wrapped model: the eager loss and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, replicated_streams, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
CUDA = torch.device("cuda", 0)


def nccl_step(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    reference = tiny_model("llama").to(CUDA)
    model = autotp.wrap(copy.deepcopy(reference).cpu(), world, tp_group=dist.group.WORLD)
    ids = batch().to(CUDA)
    losses = [m(input_ids=ids, labels=ids).loss.item() for m in (reference, model)]
    return {"device": str(next(model.parameters()).device), "loss": abs(losses[0] - losses[1])}


def test_nccl_wrap_places_the_model_on_the_gpu() -> None:
    (report,) = run_ranks(nccl_step, 1, backend="nccl")
    assert report["device"] == "cuda:0" and report["loss"] <= parity.LOSS_ATOL, report


def gpu_parity(rank: int, world: int, family: str) -> dict:
    torch.manual_seed(0)
    model = tiny_model(family).to(CUDA)
    ids = batch().to(CUDA)
    report = parity.compare_training(model, ids, world)
    report["devices"] = sorted({str(p.device) for p in model.parameters()})
    return report


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_two_ranks_on_one_gpu_match_one_process(family: str) -> None:
    for report in run_ranks(gpu_parity, 2, family):
        assert report["devices"] == ["cuda:0"] and report["sharded"] > 0, report
        parity.assert_parity(report)


def bf16_losses(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    reference = tiny_model("llama").to(CUDA)
    model = autotp.wrap(copy.deepcopy(reference), world)
    ids = batch().to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return [m(input_ids=ids, labels=ids).loss.item() for m in (reference, model)]


def test_bf16_autocast_on_the_gpu_matches_one_process() -> None:
    for one, tp in run_ranks(bf16_losses, 2):
        assert abs(one - tp) <= 2e-2, (one, tp)  # bf16 keeps 8 bits of mantissa; TP reorders the sums


def test_cuda_dropout_keeps_replicated_activations_identical() -> None:
    for same in run_ranks(replicated_streams, 2, "cuda"):
        assert same and all(same), same


def compiled_step(rank: int, world: int) -> dict:
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(autotp.wrap(tiny_model("llama").to(CUDA), world))
    eager, compiled = models
    step = torch.compile(lambda m, ids: m(input_ids=ids, labels=ids).loss, backend="inductor")
    ids = batch().to(CUDA)
    losses = []
    for m, run in ((eager, lambda m, ids: m(input_ids=ids, labels=ids).loss), (compiled, step)):
        loss = run(m, ids)
        loss.backward()
        losses.append(loss.item())
    grads = dict(eager.named_parameters())
    worst = max(parity.grad_error(p.grad, grads[n].grad) for n, p in compiled.named_parameters())
    return {"loss": abs(losses[0] - losses[1]), "grad": worst}


@pytest.mark.slow  # torch.compile
def test_inductor_compiles_a_wrapped_model() -> None:
    (report,) = run_ranks(compiled_step, 1)
    assert report["loss"] <= parity.LOSS_ATOL and report["grad"] <= 1e-4, report


def test_a_checkpoint_saved_on_the_gpu_at_tp2_resumes_at_dp2_and_in_one_process(tmp_path) -> None:
    """tests/io/test_reshard_resume.py's fast case with the model on CUDA: DCP writes the pieces from GPU memory and
    reads them back into it, at another layout."""
    from resume_workers import check_resume, first_half, second_half, straight_run

    path = str(tmp_path / "ckpt")
    expected = straight_run("llama", device="cuda")
    run_ranks(first_half, 2, "llama", 2, False, path, "cuda")
    check_resume(second_half(0, 1, "llama", 0, False, path, "cuda"), expected, "one process")
    for report in run_ranks(second_half, 2, "llama", 1, False, path, "cuda"):
        check_resume(report, expected, "tp=1 x dp=2")
