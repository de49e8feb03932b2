"""Training checkpoints (`autotp.save_checkpoint`, DCP) under a pipeline: saved at pp 2 (x tp 2), resumed at pp 1 x tp 2,
at pp 4 and in one process, continuing as one process that trained straight through, AdamW's state and a StepLR
scheduler included; `autotp.consolidate` of it; each key saved once, by the stage that owns it.

Tolerances as every parity test: fp32, only the order of sums differs, so each resumed step's loss is within 1e-5 of
one process's and every parameter within 3e-5 after the steps. One spawn saves and resumes at each layout its ranks
allow; the one-process resume and `consolidate` run here, without torch.distributed. The batches are 4 rows padded
by different amounts (4 micro-batches of other label counts under a pipeline), their halves of equal label counts
(so a DP replica's mean is one process's), the sequence length changing from step to step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.pp.cut import find_cut, owner
from autotp.state import find_state
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import tiny_model
from pp_workers import pp_batch, replica_rows, replicas_loss
from resume_workers import resume_training

STEPS = 2  # before the save, and after each resume
BATCHES = [pp_batch(seq=16 - 2 * step, seed=step + 1, pads=(0, 6, 3, 3)) for step in range(2 * STEPS)]
LLAMA4 = dict(num_hidden_layers=4)  # pp 4: a layer per stage
TIED = dict(tie_word_embeddings=True)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, batches: list[dict]) -> list[float]:
    """The README's loop on this replica's rows of each global batch: the global batch's loss at each step."""
    wrapped = find_state(model) is not None
    losses = []
    for inputs in batches:
        out = autotp.forward_backward(model, **(replica_rows(model, inputs) if wrapped else inputs))
        losses.append(replicas_loss(model, out.loss) if wrapped else out.loss.item())
        if wrapped:
            autotp.allreduce_gradients(model)
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]
        optimizer.zero_grad(set_to_none=False)
    return losses


def layout(family: str, config: dict, tp: int, pp: int, seed: int) -> tuple:
    model = tiny_model(family, seed=seed, **config)
    model = autotp.wrap(model, tp, **(dict(pp_size=pp, pp_microbatches=4) if pp > 1 else {}))
    return (model, *resume_training(model))


def trained_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full tensor of every parameter this rank trains (its stages' under a pipeline: those given a gradient)."""
    group = autotp.tp_group(model)
    return {n: parity.full_tensor(p, p, group) for n, p in model.named_parameters() if p.grad is not None}


def save_then_resume(
    rank: int, world: int, family: str, config: dict, saved_at: tuple[int, int], resumes: list, path: str
) -> dict:
    """Train `STEPS` steps at `saved_at` (tp, pp) and save; then, in the same ranks, for each (tp, pp) of `resumes`,
    a model of other weights loads the checkpoint and trains `STEPS` more. Last, a model of another layer count is
    refused, and so are a checkpoint of the older per-rank format and a save whose stages' optimizers hold other
    numbers of groups."""
    model, optimizer, scheduler = layout(family, config, *saved_at, seed=0)
    report: dict = {"saved": train(model, optimizer, scheduler, BATCHES[:STEPS]), "stage": autotp.pp_rank(model)}
    autotp.save_checkpoint(path, model, optimizer, scheduler, step=STEPS)
    del model, optimizer, scheduler
    for tp, pp in resumes:
        torch.manual_seed(999)  # whatever: the checkpoint's state must win
        model, optimizer, scheduler = layout(family, config, tp, pp, seed=7)
        state = autotp.load_checkpoint(path, model, optimizer, scheduler)
        names = {id(p): n for n, p in model.named_parameters()}
        loaded = {names[id(p)] for p in optimizer.state}  # Adam's state: only for what this rank trains
        losses = train(model, optimizer, scheduler, BATCHES[STEPS:])
        report[(tp, pp)] = {"state": state, "losses": losses, "params": trained_params(model), "loaded": loaded}
        del model, optimizer, scheduler
    saved = tiny_model(family, **config).config
    more: dict = dict(num_hidden_layers=saved.num_hidden_layers + 1)
    if getattr(saved, "layer_types", None):  # qwen2's list of one type per layer
        more["layer_types"] = saved.layer_types + saved.layer_types[-1:]
    deeper = autotp.wrap(tiny_model(family, **{**config, **more}), 1, pp_size=2)
    try:
        autotp.load_checkpoint(path, deeper)
    except autotp.CheckpointError as err:
        report["refused"] = str(err)
    try:  # the older per-rank format (`old_format`)
        autotp.load_checkpoint(Path(path).parent / "old", deeper)
    except autotp.CheckpointError as err:
        report["old"] = str(err)
    params = list(deeper.parameters())  # the first stage's optimizer of two groups, the others' of one
    groups = [{"params": params[:1]}, {"params": params[1:]}] if autotp.pp_rank(deeper) == 0 else params
    try:
        autotp.save_checkpoint(Path(path).parent / "groups", deeper, torch.optim.AdamW(groups))
    except ValueError as err:
        report["groups"] = str(err) if not (Path(path).parent / "groups").exists() else "written"
    return report


def straight_run(family: str, config: dict) -> dict:
    """The reference: one process through every step, built as a user would (the same seed and calls)."""
    model = tiny_model(family, **config)
    losses = train(model, *resume_training(model), BATCHES)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "family": family,
        "config": config,
        "layers": model.config.num_hidden_layers,
    }


def check(report: dict, expected: dict, label: str) -> set[str]:
    assert report["state"] == {"step": STEPS}, (label, report["state"])
    assert report["loaded"] == set(report["params"]), (label, report["loaded"] ^ set(report["params"]))
    losses = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"][STEPS:]))
    assert losses <= parity.LOSS_ATOL, (label, report["losses"], expected["losses"][STEPS:])
    worst = max(((p - expected["params"][n]).abs().max().item(), n) for n, p in report["params"].items())
    assert worst[0] <= parity.PARAM_ATOL, (label, worst)
    return set(report["params"])


def check_everywhere(reports: list[dict], expected: dict, resumes: list, path: Path) -> None:
    """The saving run matched one process; each resume in the ranks and in one process continues as one process;
    every parameter is trained somewhere at each layout; a model of another layer count is refused by name."""
    for report in reports:
        assert max(abs(a - b) for a, b in zip(report["saved"], expected["losses"])) <= parity.LOSS_ATOL, report
        assert "refused" in report, "a checkpoint of fewer layers was loaded"
        assert "[1, 2] parameter groups" in report.get("groups", ""), report.get("groups")
        assert "never under a pipeline" in report.get("old", ""), report.get("old")
    layer = f"model.layers.{expected['layers']}."  # the deeper model's last layer, which no stage saved
    assert any(layer in r["refused"] and "missing" in r["refused"] for r in reports), [r["refused"] for r in reports]
    for at in resumes:
        trained = set().union(*(check(r[at], expected, f"tp={at[0]} x pp={at[1]}") for r in reports))
        assert trained == set(expected["params"]), (at, trained ^ set(expected["params"]))
    check(one_process(str(path), reports, expected), expected, "one process")


def one_process(path: str, reports: list[dict], expected: dict) -> dict:
    """A resume without torch.distributed; and `consolidate`, whose HF checkpoint holds what it loaded."""
    family, config = expected["family"], expected["config"]
    model = tiny_model(family, seed=7, **config)
    optimizer, scheduler = resume_training(model)
    state = autotp.load_checkpoint(path, model, optimizer, scheduler)
    out = Path(path).parent / "consolidated"
    autotp.consolidate(path, out)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    losses = train(model, optimizer, scheduler, BATCHES[STEPS:])
    params = {n: p.detach() for n, p in model.named_parameters()}
    return {"state": state, "losses": losses, "params": params, "loaded": set(params)}


def check_keys(path: Path, family: str, config: dict, pp: int, world: int) -> None:
    """The checkpoint holds one process's keys, each written by a rank of the stage that owns it, and records pp."""
    reference = tiny_model(family, **config)
    metadata = dcp.FileSystemReader(path).read_metadata()
    names = set(reference.state_dict())
    state = {f"optimizer/{n}/{k}" for n, _ in reference.named_parameters() for k in ("step", "exp_avg", "exp_avg_sq")}
    saved = set(metadata.state_dict_metadata)
    assert {k for k in saved if not k.startswith(("optimizer/", "rng/", "scheduler"))} == names, saved ^ names
    assert {k for k in saved if k.startswith("optimizer/") and k != "optimizer/param_groups"} == state
    stage = owner(reference, find_cut(reference, pp, None))
    for index, info in metadata.storage_data.items():
        name = (
            index.fqn.removeprefix("optimizer/").rsplit("/", 1)[0] if index.fqn.startswith("optimizer/") else index.fqn
        )
        writer = int(info.relative_path.split("_")[2])  # __RANK_0.distcp
        if name in names:
            assert writer // (world // pp) == stage(name), (index.fqn, writer)
    meta = json.loads((path / "autotp_checkpoint.json").read_text())
    assert (meta["pp_size"], meta["dp_size"], len(meta["pp_bounds"])) == (pp, 1, pp + 1), meta


def old_format(directory: Path, world: int) -> None:
    """The record of a checkpoint in the per-rank format before DCP (tests/io/test_checkpoint_faults.py writes whole
    ones): a pipeline refuses it before reading any rank's files."""
    record = {"format": "autotp-checkpoint/1", "tp_size": 1, "world_size": world, "state": {}, "partitions": {}}
    directory.mkdir()
    (directory / "autotp_checkpoint.json").write_text(json.dumps(record))


def test_saved_at_pp2_tied_resumes_at_tp2_and_in_one_process(tmp_path: Path) -> None:
    """The fast tier's case: qwen2 with tied embeddings saved at pp 2 (the first stage writes the embedding, the last
    the head: one process's two names of the one weight), resumed at pp 1 x tp 2 in the same two ranks and in one
    process, and consolidated."""
    path, resumes = tmp_path / "ckpt", [(2, 1), (1, 2)]
    expected = straight_run("qwen2", TIED)
    old_format(tmp_path / "old", 2)
    reports = run_ranks(save_then_resume, 2, "qwen2", TIED, (1, 2), resumes, str(path))
    assert [r["stage"] for r in reports] == [0, 1]
    check_keys(path, "qwen2", TIED, 2, 2)
    check_everywhere(reports, expected, resumes, path)


@pytest.mark.slow  # 4 ranks, three layouts; the fast test above covers the mechanics at pp 2
def test_saved_at_pp2_tp2_resumes_at_pp4_at_tp2_dp2_and_in_one_process(tmp_path: Path) -> None:
    """The acceptance's resume: saved at pp 2 x tp 2, resumed at pp 4 (another cut: keys are full names) and at
    pp 1 x tp 2 (x dp 2) in the same four ranks, and in one process."""
    path, resumes = tmp_path / "ckpt", [(1, 4), (2, 1)]
    expected = straight_run("llama", LLAMA4)
    old_format(tmp_path / "old", 4)
    reports = run_ranks(save_then_resume, 4, "llama", LLAMA4, (2, 2), resumes, str(path))
    assert [r["stage"] for r in reports] == [0, 0, 1, 1]
    check_keys(path, "llama", LLAMA4, 2, 4)
    check_everywhere(reports, expected, resumes, path)
