"""Parameters several stages hold, and saving at pp x ep: the rank workers of tests/pp/test_pp_shared.py (a helper
module beside it)."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
import models
from autotp.testing import tiny_config
from models import tiny_model
from pp_state_workers import same_checkpoint
from pp_workers import pp_parity


def zamba() -> object:
    """Zamba with a hybrid layer on each stage of pp 2: both run the one shared transformer block (transformers ties
    each hybrid layer's block to the first's, tensor by tensor). Widths as the model's (tiny_config keeps the default
    attention_hidden_size), 8 heads of 8 so the chain check's structural twin is as wide (it would not narrow
    attention_hidden_size)."""
    config = tiny_config("zamba")
    config.num_hidden_layers = 2
    config.layers_block_type = ["hybrid", "hybrid"]
    config.attention_hidden_size = 2 * config.hidden_size
    config.num_attention_heads, config.attention_head_dim, config.num_key_value_heads = 8, 8, 4
    config.mamba_dt_rank = 4
    return config


models.CONFIGS.setdefault("zamba_shared", zamba)
MOE = "qwen3_moe"
models.CONFIGS.setdefault(MOE, lambda: tiny_config(MOE))


def shared_block(rank: int, world: int) -> dict:
    """Zamba's shared block trained at pp 2 and at tp 2 (pp 1) against one process (`pp_parity`, gradients clipped),
    and saved and exported at pp 2 right after wrap against transformers' save and one process's export."""
    out = {
        "pp2": pp_parity(rank, world, "zamba_shared", 1, 2, dict(pp_microbatches=2, clip=0.5)),
        "tp2": pp_parity(rank, world, "zamba_shared", 2, 1, dict(clip=0.5)),
    }
    out["saved"] = saved(rank, "zamba_shared", 1, {})
    return out


def saved(rank: int, family: str, tp: int, options: dict) -> dict:
    """`family` wrapped at pp 2 (and `tp`, `options`) right after wrap: `autotp.save_pretrained` against transformers'
    own save of the one-process model (rank 0 compares: files, names, order, values, config), and on each rank that
    `export_weights` hands tensors, whether they are one process's export (names, order, values)."""
    reference = tiny_model(family)
    model = autotp.wrap(copy.deepcopy(reference), tp, pp_size=2, **options)
    directory = [tempfile.mkdtemp(prefix="autotp-pp-shared-") if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    root = Path(directory[0])
    if rank == 0:
        reference.save_pretrained(root / "expected")
    autotp.save_pretrained(model, root / "saved")
    result: dict = {"saved": same_checkpoint(root / "saved", root / "expected") if rank == 0 else None}
    exported = list(autotp.export_weights(model))
    if exported:
        want = list(autotp.export_weights(reference))
        names = [n for n, _ in exported] == [n for n, _ in want]
        result["exported"] = names and all(torch.equal(a, b) for (_, a), (_, b) in zip(exported, want))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    return result


def experts_saved(rank: int, world: int) -> dict:
    """qwen3_moe saved and exported at pp 2 x ep 2 (tp 1: each stage's DP pair splits the experts) and at
    pp 2 x tp 2 x ep 2 (EP over each stage's TP pair)."""
    return {
        "pp2 ep2": saved(rank, MOE, 1, dict(ep_size=2)),
        "pp2 tp2 ep2": saved(rank, MOE, 2, dict(ep_size=2)),
    }


def step_unsynced(rank: int, world: int) -> dict:
    """A tied llama at pp 2: `optimizer.step()` straight after `forward_backward`, without
    `autotp.allreduce_gradients`, is refused before any weight changes (each stage's copy of the tied embedding holds
    its part of the gradient only); after the sum, the step runs."""
    model = autotp.wrap(tiny_model("llama", tie_word_embeddings=True), 1, pp_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = models.batch(size=(2, 8))
    autotp.forward_backward(model, input_ids=ids, labels=ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out: dict = {"refused": None}
    try:
        optimizer.step()
    except RuntimeError as error:
        out["refused"] = str(error)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    autotp.allreduce_gradients(model)
    optimizer.step()
    out["stepped"] = not all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return out
