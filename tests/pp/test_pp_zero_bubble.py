"""torch's zero-bubble schedules (`pp_schedule="ZBVZeroBubble"`, `"DualPipeV"`): each rank runs two stages placed in a
V (rank r: stages r and 2P - 1 - r) and splits each stage's backward into the input's part and the weights' part.
Parity with one process as tests/pp/test_pipeline.py's (`pp_parity`): fp32, so only the order of reductions differs:
the loss within 1e-5 at every step, every parameter a stage trains within 3e-5 of one process's after 3 AdamW steps
(the gradient norm clipped), and the evaluation's loss and logits under no_grad. The chunked loss is on (the default)
and is checked to have run; the weights' parts of the split backward are counted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autotp.pp.zero_bubble import ZERO_BUBBLE, bubble
from autotp.testing.spawn import run_ranks
from pp_workers import LORA, assert_pp_parity
from zb_workers import trained_layers, zb_run

LAYERS = dict(num_hidden_layers=4)
TIED = dict(tie_word_embeddings=True, num_hidden_layers=4, layer_types=["full_attention"] * 4)
PP2 = {  # one spawn of 2 ranks: (family, tp, pp, options)
    "zbv tied": ("qwen2", 1, 2, dict(pp_schedule="ZBVZeroBubble", pp_microbatches=4, clip=0.5, config=TIED)),
    "dualpipev lora": (
        "llama",
        1,
        2,
        dict(pp_schedule="DualPipeV", pp_microbatches=4, clip=0.5, lora=LORA, config=LAYERS, checkpointing=True),
    ),
}


REFUSED = {  # what each refusal names
    "pp_stages_per_rank": "exactly 2 stages per rank",
    "DualPipeV microbatches": "pp_microbatches >= 4",
    "output_router_logits": "load-balancing loss",
    "fully_shard": "autotp.fully_shard at pp_size=2 with pp_schedule='ZBVZeroBubble'",
    "compile": "model.layers.1 compiled",
}


def test_pp2_zero_bubble_schedules_match_one_process_and_refuse_by_name(tmp_path: Path) -> None:
    """ZBVZeroBubble on qwen2 with tied embeddings: the embedding (stage 0) and the head (stage 3) are both rank 0's,
    one tensor, so no PP group sums them. DualPipeV with LoRA put on before wrap and activation checkpointing, whose
    recomputation the two parts of the backward share. Then what they refuse, before the model changes, and
    `save_pretrained` from the V (the last stage's tensors are rank 0's)."""
    results = run_ranks(zb_run, 2, list(PP2.values()), 1, str(tmp_path))
    cases = {name: [rank["cases"][i] for rank in results] for i, name in enumerate(PP2)}
    for name, ranks in cases.items():
        assert trained_layers(ranks) == [{0, 3}, {1, 2}], (name, trained_layers(ranks))  # the V
        assert [r["chunked"] for r in ranks] == [3 * 4, 0], name  # the last stage is rank 0's: 4 micro-batches a step
        assert all(r["weight_backwards"] > 0 for r in ranks), name  # the backward was split
    assert all(r["tied"] for r in cases["zbv tied"])
    assert "model.embed_tokens.weight" in cases["zbv tied"][0]["errors"]
    assert_pp_parity(cases["zbv tied"], reference_names=2 + 4 * 12)  # embedding, final norm, 12 per qwen2 layer
    assert_pp_parity(cases["dualpipev lora"], reference_names=4 * 2 * 2)  # q and v of 4 layers, A and B each
    assert [rank["refused"].pop("saved") for rank in results] == [True, None]
    for rank in results:
        assert set(rank["refused"]) == set(REFUSED), rank["refused"]
        for name, words in REFUSED.items():
            message, unchanged = rank["refused"][name]
            assert words in message and unchanged, (name, message)


@pytest.mark.slow  # 4 ranks on 2 cores
def test_pp4_and_pp2_tp2_zero_bubble_schedules_match_one_process() -> None:
    """pp 4 (8 stages of one layer) under both schedules, 8 micro-batches (DualPipeV runs at least one a stage), LoRA
    under ZBV; ZBV at pp 2 x tp 2 (overlap=False): qwen3, whose per-head q and k norms' gradients TP's hooks sum in
    the weights' part, and llama with sequence parallelism (a column layer's saved sequence chunk gathered again in
    each part); DualPipeV at pp 2 x cp 2 (its evaluation refused, as under every schedule). TP's overlap, refused."""
    pads = (0, 3, 6, 9, 1, 4, 7, 2)
    eight = dict(num_hidden_layers=8)
    zbv = dict(pp_schedule="ZBVZeroBubble", pp_microbatches=4, clip=0.5, overlap=False, config=LAYERS)
    cases = {
        "pp4 dualpipev": (
            "llama",
            1,
            4,
            dict(pp_schedule="DualPipeV", pp_microbatches=8, clip=0.5, pads=pads, config=eight),
        ),
        "pp4 zbv lora": (
            "llama",
            1,
            4,
            dict(pp_schedule="ZBVZeroBubble", pp_microbatches=8, pads=pads, lora=LORA, config=eight),
        ),
        "tp2 qwen3": ("qwen3", 2, 2, dict(zbv, config=dict(LAYERS, layer_types=["full_attention"] * 4))),
        "tp2 sp": ("llama", 2, 2, dict(zbv, sequence_parallel=True)),
        "cp2": ("llama", 1, 2, dict(pp_schedule="DualPipeV", pp_microbatches=4, cp_size=2, clip=0.5, config=LAYERS)),
    }
    results = run_ranks(zb_run, 4, list(cases.values()), 2)
    found = {name: [rank["cases"][i] for rank in results] for i, name in enumerate(cases)}
    assert trained_layers(found["pp4 dualpipev"]) == [{0, 7}, {1, 6}, {2, 5}, {3, 4}]
    assert_pp_parity(found["pp4 dualpipev"], reference_names=2 + 8 * 9 + 1)
    assert_pp_parity(found["pp4 zbv lora"], reference_names=8 * 2 * 2)
    for name in ("tp2 qwen3", "tp2 sp", "cp2"):
        assert [r["stage"] for r in found[name]] == [0, 0, 1, 1], name
    assert_pp_parity(found["tp2 qwen3"], reference_names=2 + 4 * 11 + 1)  # 9 a layer and its q and k norms
    assert_pp_parity(found["tp2 sp"], reference_names=2 + 4 * 9 + 1)
    assert all("cp_size > 1" in r["eval"] for r in found["cp2"]), [r["eval"] for r in found["cp2"]]
    assert_pp_parity(found["cp2"], reference_names=2 + 4 * 9 + 1, evaluated=False)
    for name, ranks in found.items():
        assert all(r["weight_backwards"] > 0 for r in ranks), name
    for rank in results:  # TP's overlap at tp 2: refused, naming overlap=False
        message, unchanged = rank["refused"]["overlap"]
        assert "wrap with overlap=False" in message and unchanged, message


def test_zero_bubble_theory_is_below_1f1b() -> None:
    """The bubble of torch's own order of actions, forward, input and weight backward one unit each: below 1F1B's
    (P - 1) / (M + P - 1) at the same micro-batch count."""
    for pp, microbatches in ((2, 4), (4, 8)):
        for schedule in ZERO_BUBBLE:
            assert bubble(schedule, pp, microbatches) < (pp - 1) / (microbatches + pp - 1) / 3, (schedule, pp)
