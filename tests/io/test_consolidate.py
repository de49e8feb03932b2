"""`autotp.consolidate` builds the checkpoint's own class (sequence classification, seq2seq, image-text-to-text), not
a causal LM, with tensors bit-equal to one process's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autotp
from autotp.testing.spawn import run_ranks

TASK_CLASSES = {
    "bert": "AutoModelForSequenceClassification",
    "t5": "AutoModelForSeq2SeqLM",
    "llava": "AutoModelForImageTextToText",
}


def task_model(model_type: str) -> torch.nn.Module:
    """A tiny `model_type` model for its task, built from a config (so config.architectures is unset), seed 0."""
    import transformers

    from autotp.testing import tiny_config

    torch.manual_seed(0)
    return getattr(transformers, TASK_CLASSES[model_type]).from_config(tiny_config(model_type), dtype=torch.float32)


def save_task_checkpoint(rank: int, world: int, model_type: str, path: str) -> int:
    model = autotp.wrap(task_model(model_type), tp_size=world)
    autotp.save_checkpoint(path, model, torch.optim.AdamW(model.parameters()), step=0)
    return sum(hasattr(p, "autotp_shard") for p in model.parameters())


def task_outputs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 13).reshape(2, 6)  # inside every tiny vocabulary, below Llava's image token (511)
    extra = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        return model.eval()(input_ids=ids, **extra).logits


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", sorted(TASK_CLASSES))
def test_consolidate_builds_the_checkpoints_own_class(tmp_path: Path, model_type: str) -> None:
    """BERT for classification, T5 and Llava: consolidate used to build a causal LM (missing tensors, or no class)."""
    import transformers

    sharded = run_ranks(save_task_checkpoint, 2, model_type, str(tmp_path / "ckpt"))
    assert sharded[0] > 0, "nothing was sharded, so the test would prove nothing"
    autotp.consolidate(tmp_path / "ckpt", tmp_path / "full")
    loaded = getattr(transformers, TASK_CLASSES[model_type]).from_pretrained(tmp_path / "full")
    reference = task_model(model_type)
    assert type(loaded) is type(reference)
    expected = reference.state_dict()
    unequal = [n for n, t in loaded.state_dict().items() if not torch.equal(t, expected[n])]
    # the shards are the one-process tensors cut and joined again: bit-equal, and so are the outputs
    assert unequal == [] and loaded.state_dict().keys() == expected.keys(), unequal
    assert torch.equal(task_outputs(loaded), task_outputs(reference))
