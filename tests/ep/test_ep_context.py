"""Expert parallelism composed with context parallelism and sequence parallelism, against one process.

The harness and tolerances are ep_workers.py's (fp32; EP and CP only reorder sums): loss 1e-5 absolute, gradients
after the sync 1e-5 of the tensor's largest reference entry, parameters after 3 AdamW steps 3e-5 absolute; the top-k
of every MoE layer equal to one process's on every step, for the tokens this rank routes (its CP chunks, and under
sequence parallelism its TP chunk of them). As tests/cp feeds CP, every CP rank of a replica is given the replica's
whole batch and the model splits the sequence.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.cp.dimension import ContextParallelism
from autotp.state import state_of
from autotp.testing import run_ranks
from ep_workers import GLOBAL, check_training, dp_loop, moe_model, single_process

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)
pytestmark = pytest.mark.timeout(300)


def record_local_routing(model: torch.nn.Module, sequence_parallel: bool) -> list[tuple]:
    """Every experts call's top-k indices with the sequence positions they are for (the CP layout's `local`, None
    without CP) and, under sequence parallelism, this TP rank's share of the rows (token-major chunk)."""
    state = state_of(model)
    share = (autotp.tp_size(model), autotp.tp_rank(model)) if sequence_parallel else (1, 0)
    seen: list[tuple] = []

    def hook(module, args):
        cp = state.dim(ContextParallelism)
        layout = None if cp is None else cp.context.layout
        seen.append((args[1].detach().clone(), None if layout is None else layout.local.clone(), share))

    for name, module in model.named_modules():
        if name.endswith(".experts") and hasattr(module, "_is_expert_parallel"):
            module.register_forward_pre_hook(hook)
    return seen


def ep_cp_run(
    rank: int,
    world: int,
    family: str,
    tp: int,
    cp: int,
    ep: int,
    sequence_parallel: bool = False,
    config: dict | None = None,
) -> dict:
    """The README's DP loop at tp x cp x ep: each CP rank given its replica's whole rows, gradients synced, AdamW."""
    model = autotp.wrap(
        moe_model(family, **(config or {})), tp, ep_size=ep, cp_size=cp, sequence_parallel=sequence_parallel
    )
    routing = record_local_routing(model, sequence_parallel)
    report = dp_loop(model, lambda: autotp.allreduce_gradients(model))
    return {**report, "tp_rank": autotp.tp_rank(model), "routing": routing}


def expected_routing(
    theirs: torch.Tensor, first: int, rows: int, local: torch.Tensor | None, share: tuple[int, int]
) -> torch.Tensor:
    """One process's top-k of the tokens a rank routes: its replica's rows, its CP positions, its SP chunk."""
    seq = GLOBAL.shape[1]
    picked = theirs.view(GLOBAL.shape[0], seq, -1)[first : first + rows]
    if local is not None:
        picked = picked.index_select(1, local)
    flat = picked.reshape(-1, picked.shape[-1])
    count = flat.shape[0] // share[0]
    return flat[share[1] * count : (share[1] + 1) * count]


def check(report: dict, expected: dict) -> None:
    """Parity with one process, the routing included; raises AssertionError naming the worst tensor."""
    first, rows = report["rows"]
    assert report["routing"] and len(report["routing"]) == len(expected["routing"]), "not every experts call was seen"
    for (ours, local, share), theirs in zip(report["routing"], expected["routing"]):
        assert torch.equal(ours, expected_routing(theirs, first, rows, local, share)), (
            "top-k differs from one process's"
        )
    check_training(report, expected)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_cp2_ep2_on_two_ranks_equals_one_process(family: str) -> None:
    """tp 1: the EP group is the two CP ranks, each routing its zigzag chunks; expert-DP is one rank."""
    expected = single_process(family)
    for report in run_ranks(ep_cp_run, 2, family, 1, 2, 2):
        check(report, expected)


def test_cp2_ep2_with_the_load_balancing_loss_equals_one_process() -> None:
    """CP gathers every layer's router logits over CP before the loss (autotp/cp/apply.py), at ep 2 as at ep 1: at
    dp 1 the load-balancing loss is one process's."""
    expected, plain = single_process("qwen3_moe", config=AUX), single_process("qwen3_moe")
    assert min(a - b for a, b in zip(expected["losses"], plain["losses"])) > 0.1, "the aux loss must count"
    for report in run_ranks(ep_cp_run, 2, "qwen3_moe", 1, 2, 2, False, AUX):
        check(report, expected)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(
    "tp,ep,config", [(2, 2, AUX), (2, 4, AUX), (1, 2, None)], ids=["tp2-cp2-ep2-aux", "tp2-cp2-ep4-aux", "dp2-cp2-ep2"]
)
def test_cp2_on_four_ranks_equals_one_process(family: str, tp: int, ep: int, config: dict | None) -> None:
    """tp 2 x cp 2: EP takes the TP ranks first, so at ep 2 expert-DP is the CP pair and at ep 4 one rank; at dp 2 x
    cp 2 (tp 1) EP is the CP pair and expert-DP the DP pair. The expert gradients (each CP rank's tokens weighted C
    by CP's loss) divide by dp x cp as the dense ones do. dp 2 leaves the load-balancing loss out: each replica's
    reads its own tokens (docs/moe.md)."""
    expected = single_process(family, config=config)
    for report in run_ranks(ep_cp_run, 4, family, tp, 2, ep, False, config):
        check(report, expected)


# --- sequence parallelism -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,config", [("qwen3_moe", AUX), ("mixtral", None)], ids=["qwen3_moe-aux", "mixtral"])
def test_sequence_parallel_tp2_ep2_on_two_ranks_equals_one_process(family: str, config: dict | None) -> None:
    """The MoE block sits between SP's blocks, so it runs on this TP rank's chunk of the tokens: the router there,
    the chunk dispatched as it is (not split over TP again), the routers' logits gathered over TP for the
    load-balancing loss and their gradients summed over TP like the norms'."""
    expected = single_process(family, config=config)
    for report in run_ranks(ep_cp_run, 2, family, 2, 1, 2, True, config):
        check(report, expected)
        assert report["routing"][0][2] == (2, report["tp_rank"])  # the experts saw this TP rank's chunk


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(
    "cp,ep,config", [(1, 2, None), (2, 2, AUX), (2, 4, AUX)], ids=["dp2-tp2-ep2", "tp2-cp2-ep2-aux", "tp2-cp2-ep4-aux"]
)
def test_sequence_parallel_on_four_ranks_equals_one_process(family: str, cp: int, ep: int, config: dict | None) -> None:
    """Sequence parallelism at tp 2 with DP, and inside CP (each CP chunk split again over TP), at ep 2 and 4."""
    expected = single_process(family, config=config)
    for report in run_ranks(ep_cp_run, 4, family, 2, cp, ep, True, config):
        check(report, expected)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_sequence_parallel_with_tp_shared_experts_is_refused(family: str) -> None:
    """Shared experts planned as a TP block inside the MoE block would put SP's gather and reduce-scatter inside it."""
    with pytest.raises(ValueError, match="tensor-parallel block inside a MoE block .*shared"):
        autotp.explain(moe_model(family), 2, ep_size=2, sequence_parallel=True)
