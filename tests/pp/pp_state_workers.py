"""Pipeline parallelism's state: the rank worker of tests/pp/test_pp_state.py (a helper module beside it)."""

from __future__ import annotations

import copy
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from autotp.io.hf import load
from autotp.io.hf.parts import saved_layout
from autotp.io.hf.safetensors import read_header, read_rows
from autotp.io.rollout.export import EngineLayout, exported_tensors
from autotp.pp.cut import Skipped
from autotp.testing import parity
from models import assert_same_checkpoint, tensors, tiny_model
from pp_workers import pp_batch

SMALL_BUCKET = 8 << 10  # several buckets per stage even for a tiny model
TIED = dict(tie_word_embeddings=True)
SHARD = "100KB"  # several files and an index


def pp_state(rank: int, world: int, tp: int, pp: int, cases: dict[str, tuple], steps: int = 2) -> dict:
    """Per case (label -> family, config overrides, wrap options), from one seed: `autotp.save_pretrained` and
    `export_weights` (whole, and cut to an engine's 2 TP ranks; and the names, dtypes and shapes `vllm_sync`'s source
    declares) of the wrapped model right after wrap against
    transformers' own save of the one-process model; then after `steps` AdamW steps through the same calls, the
    save and the export against one process's save, and each rank's trained parameters (full) for the test to find
    in the saved checkpoint. Rank 0 compares; every rank reports what the exports handed it."""
    out: dict = {}
    shared = [tempfile.mkdtemp(prefix="autotp-pp-state-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])
    for label, (family, config, options) in cases.items():
        reference = tiny_model(family, **config)
        model = autotp.wrap(copy.deepcopy(reference), tp, pp_size=pp, **options)
        result = out[label] = {}
        expected, wrapped, trained, after = (root / label / n for n in ("expected", "wrapped", "trained", "after"))
        if rank == 0:
            reference.save_pretrained(expected, max_shard_size=SHARD)
        autotp.save_pretrained(model, wrapped, max_shard_size=SHARD)
        exported = list(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET))
        engine = list(autotp.export_weights(model, bucket_bytes=SMALL_BUCKET, target=EngineLayout(2)))
        result["handed"] = len(exported) + len(engine)
        declared = saved_layout(model, exported_tensors(model, merge_lora=True)[1])  # vllm_sync's metadata()
        if rank == 0:
            want = flat(expected)
            result["saved"] = same_checkpoint(wrapped, expected)
            result["exported order"] = [n for n, _ in exported] == [n for n, _ in autotp.export_weights(reference)]
            result["exported"] = differing(dict(exported), want)
            result["declared"] = [(n, t.dtype, t.shape) for n, t in exported] == [
                (n, d.dtype, torch.Size(d.shape)) for n, d in declared.items()
            ]
            result["engine rows"] = engine_rows(model, want, {(n, r): t for n, r, t in engine})
        result.update(read_stage(expected, model, tp, pp, options))
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(steps):
            inputs = pp_batch(seq=16 - 2 * step, seed=step + 1)
            autotp.forward_backward(reference, **inputs)
            ref_opt.step()
            ref_opt.zero_grad()
            autotp.forward_backward(model, **inputs)
            autotp.allreduce_gradients(model)
            opt.step()
            opt.zero_grad(set_to_none=False)  # a trained parameter keeps a gradient: the test finds it by that
        autotp.save_pretrained(model, trained)
        exported = list(autotp.export_weights(model))
        result["trained by this rank"] = {
            name: parity.full_tensor(p, p, autotp.tp_group(model))
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        if rank == 0:
            reference.save_pretrained(after)
            want, got = flat(after), flat(trained)
            result["trained names"] = (list(got) == list(want), sorted(n for n, _ in exported) == sorted(want))
            result["trained error"] = max(
                max((got[n] - t).abs().max().item(), (dict(exported)[n] - t).abs().max().item())
                for n, t in want.items()
            )
            result["trained checkpoint"] = got
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    return out


def read_stage(path: Path, wrapped: torch.nn.Module, tp: int, pp: int, options: dict) -> dict:
    """`autotp.from_pretrained(path, tp, pp_size=pp)`: whether it equals `wrapped` (the wrap of the model saved at
    `path`) bit for bit, the decoder layers whose tensors it read (a spy on the loader's reads) and those it runs."""
    by_offsets = {
        (str(file), tuple(entry["data_offsets"])): name
        for file in sorted(path.glob("*.safetensors"))
        for name, entry in read_header(file)[0].items()
    }
    read = []

    def spy(f, entry, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        read.append(by_offsets[(f.name, tuple(entry["data_offsets"]))])
        return read_rows(f, entry, *args, **kwargs)

    load.read_rows = spy
    try:
        model = autotp.from_pretrained(path, tp, pp_size=pp, **options)
    finally:
        load.read_rows = read_rows
    got, want = dict(model.named_parameters()), dict(wrapped.named_parameters())
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    return {
        "loaded": list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want),
        "layers read": sorted({int(m.group(1)) for n in read if (m := re.search(r"\.(\d+)\.", n))}),
        "layers run": [i for i, layer in enumerate(layers) if not isinstance(layer, Skipped)],
    }


def flat(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by name, in its files' order."""
    return {name: tensor for named in tensors(directory).values() for name, tensor in named.items()}


def same_checkpoint(ours: Path, theirs: Path) -> str:
    """ "same", or how `assert_same_checkpoint` (names, order, bit-for-bit values, config, index) finds them apart."""
    try:
        assert_same_checkpoint(ours, theirs)
    except AssertionError as err:
        return f"differs: {err!r}"
    return "same"


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The names missing, extra, or not bit-for-bit equal."""
    return sorted(set(got) ^ set(want)) or [n for n, t in want.items() if not torch.equal(got[n], t)]


def engine_rows(model: torch.nn.Module, want: dict, rows: dict) -> bool:
    """Whether every engine rank's rows are those `EngineLayout(2)` cuts from one process's tensors."""
    partitions = EngineLayout(2).partitions(model)
    for name, full in want.items():
        for engine_rank in range(2):
            part = partitions.get(name)
            if not torch.equal(rows[(name, engine_rank)], full if part is None else part.shard(full, engine_rank)):
                return False
    return len(rows) == 2 * len(want)
