"""An ordinary Hugging Face training loop, made tensor-parallel by one autotp.wrap call.

    torchrun --nproc-per-node 2 examples/train.py                # tiny Llama from a config, no download
    torchrun --nproc-per-node 4 examples/train.py --model DIR    # a local HF checkpoint

It trains on a synthetic, learnable token pattern, saves a full checkpoint with
autotp.save_pretrained, reloads it with plain transformers in one process and checks that its
logits equal the tensor-parallel model's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from data import pattern_batch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig

import autotp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model directory (default: a tiny Llama built from a config)")
    parser.add_argument(
        "--tp",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="tensor-parallel size (default: every launched process)",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--adam-epsilon",
        type=float,
        default=1e-8,
        help="AdamW's eps (the tests take 1e-6: see autotp.testing.parity.compare_training)",
    )
    parser.add_argument("--output", default="out/autotp-demo")
    parser.add_argument("--losses-out", help="write each step's loss over the global batch as JSON (rank 0)")
    return parser.parse_args()


def tiny_llama() -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=256,
    )
    return AutoModelForCausalLM.from_config(config)


def global_loss(loss: torch.Tensor, model: torch.nn.Module) -> float:
    """The loss over the global batch: the replicas' mean (their batches hold equally many tokens)."""
    mean = loss.detach().clone()
    if autotp.dp_size(model) > 1:
        dist.all_reduce(mean, group=autotp.dp_group(model))
    return mean.item() / autotp.dp_size(model)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32) if args.model else tiny_llama()
    model = autotp.wrap(model, tp_size=args.tp)
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    device = next(model.parameters()).device
    dp_rank, dp_size = autotp.dp_rank(model), autotp.dp_size(model)
    if rank == 0:
        print(model.autotp_state.plan.describe().splitlines()[0])

    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.adam_epsilon)
    model.train()
    bar = tqdm(range(args.steps), desc="train", disable=rank != 0)
    losses = []
    for step in bar:
        # Each data-parallel replica reads its own batch; TP ranks of a replica read the same one.
        ids = pattern_batch(step * dp_size + dp_rank, args.batch, args.seq, vocab).to(device)
        loss = autotp.forward_backward(model, input_ids=ids, labels=ids).loss  # model(...).loss.backward() here
        autotp.allreduce_gradients(model)  # average over data-parallel replicas only
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_loss(loss, model))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")

    autotp.save_pretrained(model, args.output, overwrite=True)
    model.eval()
    probe = pattern_batch(10_000, 2, args.seq, vocab).to(device)
    with torch.no_grad():
        tp_logits = model(input_ids=probe).logits.float().cpu()
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(args.output, dtype=torch.float32)
        with torch.no_grad():
            plain_logits = plain(input_ids=probe.cpu()).logits
        diff = (plain_logits - tp_logits).abs().max().item()
        print(
            f"saved {args.output}; final loss {losses[-1]:.4f}; "
            f"plain-transformers reload vs TP logits: max |diff| = {diff:.2e}"
        )
        # fp32: only the order of the TP partial sums differs.
        if diff > 1e-4:
            raise SystemExit(f"logits differ by {diff:.2e}")
        print("logits match")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump({"losses": losses}, f)
    autotp.finish()  # every rank: exiting straight after a gloo collective can abort (see autotp.finish)


if __name__ == "__main__":
    main()
