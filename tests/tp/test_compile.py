"""torch.compile on a wrapped model: the training step traces with no graph break (the collectives are autograd
functions dynamo traces through), and the compiled step keeps parity with eager. CPU CI uses the aot_eager
backend (inductor's C++ builds are slow on 2 cores); tests/package/test_gpu.py runs inductor."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

pytestmark = pytest.mark.slow  # dynamo tracing; the eager step's parity is test_parity.py's


def compiled_against_eager(rank: int, world: int, family: str, vocab_parallel: bool) -> dict:
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(autotp.wrap(tiny_model(family), world, vocab_parallel=vocab_parallel))
    eager, compiled = models
    ids = batch()

    def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    breaks = torch._dynamo.explain(loss_of)(compiled, ids).graph_break_count
    step = torch.compile(loss_of, backend="aot_eager")
    losses = []
    for model, run in ((eager, loss_of), (compiled, step)):
        loss = run(model, ids)
        loss.backward()
        losses.append(loss.item())
    reference = dict(eager.named_parameters())
    worst = max(parity.grad_error(p.grad, reference[n].grad) for n, p in compiled.named_parameters())
    return {"breaks": breaks, "loss": abs(losses[0] - losses[1]), "grad": worst}


@pytest.mark.parametrize("vocab_parallel", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_compiled_training_step_has_no_graph_break_and_keeps_parity(family: str, vocab_parallel: bool) -> None:
    for report in run_ranks(compiled_against_eager, 2, family, vocab_parallel):
        assert report["breaks"] == 0, report
        assert report["loss"] <= parity.LOSS_ATOL and report["grad"] <= parity.GRAD_RTOL, report


def graphs_of_blocks_compiled_one_by_one(rank: int, world: int, layers: int) -> int:
    """How many graphs dynamo hands the backend for one training step of a wrapped model whose decoder layers are
    compiled one by one (`layer.compile()`, torchtitan's way)."""
    torch.compiler.reset()
    graphs = []

    def counting(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    model = autotp.wrap(tiny_model("llama", num_hidden_layers=layers), world)
    for layer in model.model.layers:
        layer.compile(backend=counting)
    ids = batch()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return len(graphs)


@pytest.mark.parametrize("world", [1, 2])
def test_blocks_compiled_one_by_one_share_one_compilation(world: int) -> None:
    """Before: a block entry looked up its readers' deferred weights by `id(weight)` even when none were deferred
    (under compile), so dynamo guarded on each block's weight object and compiled every block again; past torch's
    recompile limit (8) the remaining blocks ran eager."""
    one, four = (run_ranks(graphs_of_blocks_compiled_one_by_one, world, layers)[0] for layers in (1, 4))
    assert four == one, f"4 blocks gave {four} graphs, 1 block {one}"
