"""GRPO with a running vLLM server generating and autotp training at tp=2, on CPU, no downloads.

    python examples/grpo_vllm.py --init /tmp/tiny          # a tiny Llama (head_dim 32: vLLM's CPU attention)
    export AUTOTP_SYNC_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')   # the channel's secret
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/tiny --port 8000 \
        --host 127.0.0.1 --dtype float32 --skip-tokenizer-init --enforce-eager --weight-transfer-config '{"backend": "autotp-gloo"}'
    torchrun --nproc-per-node 2 examples/grpo_vllm.py --model /tmp/tiny --url http://127.0.0.1:8000

Why this and not TRL's GRPOTrainer: TRL 1.16's vLLM client refuses a non-CUDA device, so on CPU the loop is
written out; it is GRPO's whole algorithm. Each step, rank 0 asks the server for `GROUP` sampled completions of
each prompt (token ids over HTTP) and hands them to the other ranks; a verifiable reward scores them (how many
of their tokens are below `LOW`); each completion's advantage is its reward normalised within its prompt's group;
the loss is the clipped policy-gradient surrogate on the completion tokens' log-probs (its value is minus the mean
advantage, about 0, with one update per batch: the gradient is what moves; the example prints the reward and the
mean log-prob), which come from the
vocab-sharded LM head (`autotp.vocab.tokens.token_log_probs`: the batch x vocabulary logits are never gathered).
After the optimizer step, `engine.send_weights()` puts the new weights into the server, so the next step samples
from the policy just trained. Completions run to `max_tokens` (`ignore_eos`) and prompts share one length, so the
batch needs no padding.
"""

from __future__ import annotations

import argparse
import json

import requests
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

import autotp
from autotp.rollout import vllm_sync
from autotp.vocab.tokens import token_log_probs

PROMPTS = [[1, 5, 9, 22], [300, 17, 4, 88], [42, 42, 7, 250]]  # one length: no padding
GROUP = 6  # completions per prompt, scored against each other
NEW_TOKENS = 8
LOW = 128  # the reward: how many of a completion's tokens are below LOW (a quarter of the vocabulary)
TEMPERATURE = 1.0
CLIP = 0.2  # PPO's clipping range; one update per generation batch, so the ratio is 1 and the clip inactive


def save_tiny_model(path: str) -> None:
    """The model the server loads and the trainers start from: a tiny Llama built from a config."""
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def generate(url: str, prompts: list[list[int]], seed: int) -> list[list[list[int]]]:
    """`GROUP` sampled completions (token ids) of each prompt from the server, seeded: [prompt][sample][token]."""
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": prompts,
        "n": GROUP,
        "max_tokens": NEW_TOKENS,
        "temperature": TEMPERATURE,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])  # prompt-major
    return [[choice["token_ids"] for choice in choices[i * GROUP : (i + 1) * GROUP]] for i in range(len(prompts))]


def reward(completion: list[int]) -> float:
    """Verifiable, no model: the count of the completion's tokens below LOW."""
    return float(sum(token < LOW for token in completion))


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage: each reward against its group's mean and standard deviation ([prompt, sample])."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)


def grpo_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, prompts: list[list[int]], completions: list[list[list[int]]]
) -> dict:
    """One GRPO update on one generation batch; returns the rewards, the loss and the completion log-probs."""
    rewards = torch.tensor([[reward(c) for c in group] for group in completions])
    advantage = advantages(rewards).flatten()[:, None]
    ids = torch.tensor([prompt + c for prompt, group in zip(prompts, completions) for c in group])
    log_probs = token_log_probs(model, ids, temperature=TEMPERATURE)[:, len(prompts[0]) - 1 :]  # completion tokens
    ratio = torch.exp(log_probs - log_probs.detach())  # against the sampling policy: these same weights
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage)
    loss = -surrogate.mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"rewards": rewards, "loss": loss.item(), "log_probs": log_probs.detach()}


def train(model: nn.Module, url: str, steps: int, lr: float, seed: int = 0) -> list[dict]:
    """The loop, on every trainer rank: connect, send the starting weights (the server may hold another run's),
    then per step generate on rank 0, share, update, send. Returns each step's completions and `grpo_step`'s."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine = vllm_sync(model, url)
    engine.send_weights()
    records = []
    for step in range(steps):
        shared = [generate(url, PROMPTS, seed + step) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        records.append({"completions": shared[0], **grpo_step(model, optimizer, PROMPTS, shared[0])})
        engine.send_weights()  # the next step samples from the weights just trained
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", metavar="DIR", help="write the tiny model to DIR and exit")
    parser.add_argument("--model", help="the directory the server loaded")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    if args.init:
        save_tiny_model(args.init)
        return
    dist.init_process_group("gloo")
    model = autotp.wrap(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), tp_size=args.tp)
    for step, record in enumerate(train(model, args.url, args.steps, args.lr)):
        if dist.get_rank() == 0:
            print(
                json.dumps(
                    {
                        "step": step,
                        "mean_reward": round(record["rewards"].mean().item(), 3),
                        "mean_log_prob": round(record["log_probs"].mean().item(), 4),
                    }
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
