"""autotp under `accelerate launch`, checked against one process.

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/train_accelerate.py --tp 2

The clean setup with Accelerator: autotp owns the model's parallelism, so the model is not passed
to `accelerator.prepare` (that would wrap it in a DistributedDataParallel over every rank, which
autotp refuses), and neither is the dataloader (accelerate would shard it over every rank, while
TP ranks of a replica must read the same batches). The optimizer goes through `prepare`; the data
comes from `autotp.data_parallel_sampler`; gradients are averaged over the data-parallel group by
`autotp.allreduce_gradients`. At the end rank 0 trains the same model on the same global batches
in one process and compares losses and parameters.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from data import PatternDataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

import autotp
from autotp.testing.parity import full_tensor


def tiny_llama() -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    return AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2, help="per-replica batch")
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    reference = tiny_llama()
    model = autotp.wrap(copy.deepcopy(reference), tp_size=args.tp)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    dataset = PatternDataset(size=64, seq=32, vocab=model.config.vocab_size)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=autotp.data_parallel_sampler(dataset, shuffle=False))
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for _step, batch in zip(range(args.steps), loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        autotp.allreduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if autotp.dp_size(model) > 1:
            dist.all_reduce(mean, group=autotp.dp_group(model))
        losses.append(mean.item() / autotp.dp_size(model))
    params = {n: full_tensor(p, p, autotp.tp_group(model)) for n, p in model.named_parameters()}
    if rank == 0:
        print(f"dp={autotp.dp_size(model)} x tp={autotp.tp_size(model)}: losses {[round(x, 4) for x in losses]}")
        check_against_one_process(reference, dataset, args, losses, params, autotp.dp_size(model))
    autotp.finish()  # every rank: exiting straight after a gloo collective can abort (see autotp.finish)


def check_against_one_process(reference, dataset, args, losses, params, replicas: int) -> None:
    """The same global batches (each replica's part together) on one process; fp32 tolerances as in the tests."""
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    loader = DataLoader(dataset, batch_size=args.batch * replicas, shuffle=False)
    expected = []
    for _step, batch in zip(range(args.steps), loader):
        # DistributedSampler deals samples round-robin; the global batch is the same set of rows.
        loss = reference(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    loss_diff = max(abs(a - b) for a, b in zip(losses, expected))
    param_diff = max((params[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    print(
        f"one process: losses {[round(x, 4) for x in expected]}; max |loss diff| {loss_diff:.2e}, "
        f"max |param diff| {param_diff:.2e}"
    )
    if loss_diff > 1e-5 or param_diff > 3e-5:
        raise SystemExit("parity with one process FAILED")
    print("parity with one process: ok")


if __name__ == "__main__":
    main()
