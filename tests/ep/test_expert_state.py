"""State under expert parallelism (`ep_size`): saves, loads, training checkpoints and exports of a model whose ranks
each hold their EP rank's experts.

- Saves: `autotp.save_pretrained` and the model's own `save_pretrained` write what transformers' `save_pretrained`
  of the one-process model writes (files, names, dtypes, bytes, index, config), compared exactly.
- Loads: `from_pretrained(..., ep_size=E)` reads only this rank's experts (the bytes it reads are counted).
- Resume: 3 AdamW steps at one layout, `save_checkpoint`, 3 more at another equal 6 straight steps in one process
  (tolerances as tests/io/test_reshard_resume.py: fp32, only the order of sums differs; loss 1e-5, parameters 3e-5).
- Exports: `export_weights` yields transformers' names, one full tensor per name, equal to transformers' save.
- `consolidate` of an EP checkpoint equals `autotp.save_pretrained` of the model it was saved from, exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import autotp
import autotp.io.hf.load as hf_load
from autotp.testing import run_ranks
from autotp.testing.parity import full_tensor
from ep_workers import moe_model
from models import assert_same_checkpoint, tensors
from resume_workers import check_resume, resume_model, resume_steps, resume_training, straight_run

FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]
SMALL = "40KB"  # several files for every tiny model
pytestmark = pytest.mark.timeout(240)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole: experts all-gathered over EP, TP shards over TP (one process: as they are)."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "autotp_expert"):
            parts = [torch.empty_like(p) for _ in range(autotp.ep_size(model))]
            dist.all_gather(parts, p.detach().contiguous(), group=autotp.ep_group(model))
            out[name] = torch.cat(parts)
        else:
            out[name] = full_tensor(p, p, autotp.tp_group(model) if dist.is_initialized() else None).detach().clone()
    return out


# --- saves -----------------------------------------------------------------------------------------------------------


def save_at(rank: int, world: int, family: str, tp: int, ep: int, target: str) -> dict:
    """`autotp.save_pretrained` in one file, the model's own `save_pretrained` in small files, and an export."""
    model = autotp.wrap(moe_model(family), tp, ep_size=ep)
    autotp.save_pretrained(model, Path(target) / "whole")
    model.save_pretrained(Path(target) / "small", max_shard_size=SMALL)
    exported = [(name, tensor) for name, tensor in autotp.export_weights(model, bucket_bytes=20_000)]
    return {
        "exported": exported,
        "tp_rank": autotp.tp_rank(model),
        "experts": sum(hasattr(p, "autotp_expert") for p in model.parameters()),
    }


def check_saves(tmp_path: Path, family: str, tp: int, ep: int, world: int = 2) -> None:
    reports = run_ranks(save_at, world, family, tp, ep, str(tmp_path / "ours"))
    assert reports[0]["experts"] > 0, "no expert is split: nothing under test"
    plain = moe_model(family)
    for kind, size in (("whole", "5GB"), ("small", SMALL)):
        plain.save_pretrained(tmp_path / "theirs" / kind, max_shard_size=size)
        assert_same_checkpoint(tmp_path / "ours" / kind, tmp_path / "theirs" / kind)
    assert len(list((tmp_path / "ours" / "small").glob("*.safetensors"))) > 2, "the small shard size makes files"
    saved = {name: t for named in tensors(tmp_path / "theirs" / "whole").values() for name, t in named.items()}
    for report in reports:  # TP rank 0 of every TP group gets every tensor, as at ep 1; the others nothing
        if report["tp_rank"] != 0:
            assert report["exported"] == []
            continue
        names = [name for name, _ in report["exported"]]
        assert sorted(names) == sorted(saved) and len(set(names)) == len(names), "not one tensor per saved name"
        assert all(torch.equal(t, saved[name]) for name, t in report["exported"]), "an exported tensor differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_saves_and_export_at_ep2_are_transformers_save(tmp_path: Path, family: str) -> None:
    check_saves(tmp_path, family, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 4), (2, 4), (4, 2)], ids=["tp2-ep2", "ep4", "tp2-ep4", "tp4-ep2"])
def test_saves_and_export_on_four_ranks(tmp_path: Path, tp: int, ep: int) -> None:
    """tp2 x ep2: EP shares the TP ranks; ep4: every rank holds one expert; tp2 x ep4: an EP group over two TP groups
    (ranks 0 and 2 are TP rank 0: both get every tensor); tp4 x ep2: two EP groups in one TP group (ranks 2 and 3
    gather the dense tensors with rank 0, not the experts)."""
    check_saves(tmp_path, "qwen3_moe", tp, ep, world=4)


def export_to_an_engine(rank: int, world: int) -> str:
    model = autotp.wrap(moe_model("qwen3_moe"), 1, ep_size=2)
    try:
        list(autotp.export_weights(model, target=autotp.EngineLayout(2)))
    except NotImplementedError as err:
        return str(err)
    return "accepted"


def test_export_to_an_engine_layout_is_refused_at_ep2() -> None:
    """Cutting experts for an engine's own TP layout is the rollout issue's: refused before any gather."""
    for message in run_ranks(export_to_an_engine, 2):
        assert "target=...) at ep_size=2" in message, message


# --- loads -----------------------------------------------------------------------------------------------------------


def load_counting(rank: int, world: int, path: str, ep: int) -> dict:
    """`from_pretrained(path, 1, ep_size=ep)`, counting the bytes each read of the checkpoint returns."""
    read = {"bytes": 0}
    real = hf_load.read_rows

    def counting(*args, **kwargs):
        tensor = real(*args, **kwargs)
        read["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    hf_load.read_rows = counting
    model = autotp.from_pretrained(path, 1, ep_size=ep)
    reference = autotp.wrap(AutoModelForCausalLM.from_pretrained(path), 1, ep_size=ep)
    theirs = reference.state_dict()
    unequal = [k for k, v in model.state_dict().items() if not torch.equal(v, theirs[k])]
    return {"read": read["bytes"], "unequal": unequal}


def test_from_pretrained_reads_only_this_ranks_experts(tmp_path: Path) -> None:
    """Every checkpoint tensor is read once, the experts' per-expert tensors only for this rank's experts."""
    moe_model("qwen3_moe").save_pretrained(tmp_path)
    stored = {name: t for named in tensors(tmp_path).values() for name, t in named.items()}
    total = sum(t.numel() * t.element_size() for t in stored.values())
    experts = sum(t.numel() * t.element_size() for name, t in stored.items() if ".experts." in name)
    assert experts > total // 2, "the experts must be most of the checkpoint for the count to mean something"
    for report in run_ranks(load_counting, 2, str(tmp_path), 2):
        assert report["unequal"] == []
        assert report["read"] == total - experts // 2, (report["read"], total, experts)


# --- training checkpoints --------------------------------------------------------------------------------------------


def first_half(rank: int, world: int, tp: int, ep: int, path: str) -> list[float]:
    """3 steps at tp x ep, `save_checkpoint`, and `save_pretrained` of the same weights (for consolidate)."""
    model = autotp.wrap(resume_model("qwen3_moe", seed=0), tp, ep_size=ep)
    optimizer, scheduler = resume_training(model)
    losses = resume_steps(model, optimizer, scheduler, 3)
    autotp.save_checkpoint(path, model, optimizer, scheduler, step=3, samples=12)
    autotp.save_pretrained(model, path + "-hf")
    return losses


def second_half(rank: int, world: int, tp: int, ep: int, path: str) -> dict:
    """Load at tp x ep (tp 0: one process, no torch.distributed) into other weights, then 3 more steps."""
    torch.manual_seed(999)  # whatever: the checkpoint's state must win
    model = resume_model("qwen3_moe", seed=7)
    if tp:
        model = autotp.wrap(model, tp, ep_size=ep)
    optimizer, scheduler = resume_training(model)
    state = autotp.load_checkpoint(path, model, optimizer, scheduler)
    losses = resume_steps(model, optimizer, scheduler, 3)
    return {
        "state": state,
        "losses": losses,
        "params": full_params(model) if tp else {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def consolidated(tmp_path: Path, path: str) -> None:
    autotp.consolidate(path, tmp_path / "consolidated")
    assert_same_checkpoint(tmp_path / "consolidated", Path(path + "-hf"), config=False)


def test_saved_at_ep2_resumes_without_ep_and_in_one_process(tmp_path: Path) -> None:
    """Saved at ep 2 (tp 1, dp 2); resumed at tp 2 without EP, at ep 2, and in one process; consolidated."""
    path = str(tmp_path / "ckpt")
    expected = straight_run("qwen3_moe")
    halves = run_ranks(first_half, 2, 1, 2, path)
    assert max(abs(a - b) for a, b in zip(halves[0], expected["losses"][:3])) <= 1e-5
    check_resume(second_half(0, 1, 0, 1, path), expected, "one process")
    for tp, ep in ((2, 1), (1, 2)):
        for report in run_ranks(second_half, 2, tp, ep, path):
            check_resume(report, expected, f"tp={tp} x ep={ep}")
    consolidated(tmp_path, path)


@pytest.mark.slow  # about 1 s; a checkpoint saved at ep2 resuming stays quick
def test_saved_without_ep_resumes_at_ep2(tmp_path: Path) -> None:
    """The other direction: saved at tp 2 (experts split by width), resumed at ep 2 (split by expert)."""
    path = str(tmp_path / "ckpt")
    expected = straight_run("qwen3_moe")
    run_ranks(first_half, 2, 2, 1, path)
    for report in run_ranks(second_half, 2, 1, 2, path):
        check_resume(report, expected, "ep=2")


@pytest.mark.slow
def test_saved_at_tp2_ep2_resumes_at_tp2_and_at_ep4(tmp_path: Path) -> None:
    """The acceptance: saved at tp 2 x ep 2 (4 ranks); resumed at tp 2 without EP (dp 2), at ep 4 (tp 1) and at
    tp 2 x ep 4, and in one process; consolidated."""
    path = str(tmp_path / "ckpt")
    expected = straight_run("qwen3_moe")
    halves = run_ranks(first_half, 4, 2, 2, path)
    assert max(abs(a - b) for a, b in zip(halves[0], expected["losses"][:3])) <= 1e-5
    check_resume(second_half(0, 1, 0, 1, path), expected, "one process")
    for tp, ep in ((2, 1), (1, 4), (2, 4)):
        for report in run_ranks(second_half, 4, tp, ep, path):
            check_resume(report, expected, f"tp={tp} x ep={ep}")
    consolidated(tmp_path, path)


@pytest.mark.slow
def test_saved_at_ep4_resumes_at_ep2_and_without_ep(tmp_path: Path) -> None:
    """ep 4, then ep 2, then none (the issue's chain, from the other end): saved at ep 4 (one expert per rank)."""
    path = str(tmp_path / "ckpt")
    expected = straight_run("qwen3_moe")
    run_ranks(first_half, 4, 1, 4, path)
    for world, tp, ep in ((4, 1, 2), (2, 2, 1)):
        for report in run_ranks(second_half, world, tp, ep, path):
            check_resume(report, expected, f"tp={tp} x ep={ep} on {world} ranks")
