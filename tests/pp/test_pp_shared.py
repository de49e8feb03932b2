"""Parameters that several pipeline stages hold, and saving the experts under a pipeline.

Zamba's hybrid layers share one transformer block (transformers ties each layer's block to the first's); with a
hybrid layer on each stage of pp 2, each stage holds a copy. Their gradients are summed over the two stages by
`autotp.allreduce_gradients` and counted once by `autotp.clip_grad_norm_` (`autotp.pp.shared`), as the tied embedding
is, so training matches one process: parity as tests/pp/test_pipeline.py's (fp32, only the order of reductions
differs: loss within 1e-5 at each of 3 AdamW steps, every trained parameter within 3e-5, the clipped norm within
1e-5 relative). The same model at tp 2 (pp 1) keeps the tie too: a tied block stays replicated
(`autotp.planning.ties`). Its save and export at pp 2 are transformers' save (the tied aliases dropped) and one
process's export, bit for bit.

`save_pretrained` and `export_weights` of qwen3_moe at pp 2 x ep 2 and pp 2 x tp 2 x ep 2 (4 ranks, slow) write
transformers' save of the one-process model bit for bit and hand out one process's export.
"""

from __future__ import annotations

import pytest

from autotp.testing.spawn import run_ranks
from pp_shared_workers import experts_saved, shared_block, step_unsynced
from pp_workers import assert_pp_parity


def test_a_block_shared_by_layers_on_two_stages_trains_and_saves_as_one_tensor() -> None:
    results = run_ranks(shared_block, 2)
    assert_pp_parity([r["pp2"] for r in results])
    assert_pp_parity([r["tp2"] for r in results])
    assert all(len(r["pp2"]["norms"]) == 3 for r in results)
    assert results[0]["saved"]["saved"] == "same", results[0]["saved"]
    assert [r["saved"].get("exported") for r in results] == [True, None]


@pytest.mark.slow
def test_pp2_ep2_save_and_export_equal_transformers_save() -> None:
    results = run_ranks(experts_saved, 4)
    for layout in ("pp2 ep2", "pp2 tp2 ep2"):
        assert results[0][layout]["saved"] == "same", (layout, results[0][layout]["saved"])
        handed = [r[layout].get("exported") for r in results]
        assert handed[0] is True and all(h in (True, None) for h in handed), (layout, handed)


def test_a_step_without_the_gradient_sum_of_a_tied_embedding_is_refused_by_name() -> None:
    for result in run_ranks(step_unsynced, 2):
        assert "model.embed_tokens.weight" in result["refused"] or "lm_head.weight" in result["refused"], result
        assert "autotp.allreduce_gradients(model)" in result["refused"], result
        assert result["unchanged"] and result["stepped"], result
