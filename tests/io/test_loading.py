"""`autotp.from_pretrained` reads only this rank's slices and equals wrap-after-load, tensor for tensor."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import tiny_model


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_from_pretrained_equals_wrap_after_load(tmp_path: Path, family: str, layout: str, tp: int) -> None:
    tiny_model(family).save_pretrained(tmp_path, max_shard_size="5GB" if layout == "single" else "60KB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (layout == "sharded")
    for report in run_ranks(parity.compare_loading, tp, str(tmp_path)):
        assert report["keys"] and report["unequal"] == [] and report["buffers"] == [], report
        assert report["shards"] > 0
        assert report["logits"] == 0.0 and report["loss"] == 0.0 and report["grads"] == [], report


@pytest.mark.parametrize("family", ["olmo", "gpt_neo"])
def test_from_pretrained_shards_derived_plans_like_wrap(tmp_path: Path, family: str) -> None:
    """No shipped policy: HF's plan (olmo) or detection (gpt_neo), verified on a twin while on meta."""
    tiny_model(family).save_pretrained(tmp_path)
    for report in run_ranks(parity.compare_loading, 2, str(tmp_path)):
        assert report["keys"] and report["unequal"] == [] and report["buffers"] == [], report
        assert report["shards"] > 0
        assert report["logits"] == 0.0 and report["loss"] == 0.0 and report["grads"] == [], report
