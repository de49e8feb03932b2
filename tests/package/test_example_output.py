"""What the examples print, run in this process: the SFT example without its extra names the install command once,
and the Trainer example with activation checkpointing and LoRA warns of no deprecation."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import autotp

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("rank", ["0", "1"])
def test_sft_example_without_the_extra_names_it_once(monkeypatch, capsys, rank: str) -> None:
    """Without `datasets` every rank exits with code 1; only rank 0 prints the install command, no traceback."""
    import runpy

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: find_spec answers None
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLES / "sft_lora.py"))
    err = capsys.readouterr().err
    assert exit_.value.code == 1
    assert err.count("pip install -e '.[sft]'") == (rank == "0") and ("datasets not installed" in err) == (rank == "0")


@pytest.mark.timeout(120)
def test_trainer_example_checkpoints_activations_without_deprecation_warnings(monkeypatch, tmp_path: Path) -> None:
    """`--grad-ckpt --lora` used the deprecated `gradient_checkpointing=` (and PEFT reads the deprecated
    `is_gradient_checkpointing`): each printed a FutureWarning on every rank. One step at tp 1 (no process group)."""
    from autotp.hf_trainer import AutoTPTrainer

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from data import PatternDataset
    from train_trainer import parse_args, tiny_llama, training_arguments, with_lora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args(["--grad-ckpt", "--lora", "--steps", "1", "--output", str(tmp_path)])
        model = with_lora(tiny_llama())
        autotp.wrap(model.base_model.model, tp_size=1)
        training = training_arguments(args)
        AutoTPTrainer(model=model, args=training, train_dataset=PatternDataset(2, 8, 256)).train()
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert training.activation_checkpointing and model.base_model.model.is_activation_checkpointing
