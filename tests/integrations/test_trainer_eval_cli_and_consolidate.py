"""AutoTPTrainer's evaluation loss against one-process Trainer, consolidate of non-causal-LM checkpoints, Trainer
resume across DDP and FSDP (and the error of older checkpoints), consolidate's error inside a job, and the `autotp`
command line's messages, progress and --dtype."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

import autotp
from autotp.testing.spawn import run_ranks
from models import Sequences, tiny_model


def eval_arguments(output: str) -> TrainingArguments:
    return TrainingArguments(output_dir=output, per_device_eval_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)


def evaluate_rank(rank: int, world: int, output: str, samples: int, tp: int) -> float:
    from autotp.hf_trainer import AutoTPTrainer

    model = autotp.wrap(tiny_model("llama"), tp_size=tp)
    trainer = AutoTPTrainer(model=model, args=eval_arguments(output), eval_dataset=Sequences(samples))
    return trainer.evaluate()["eval_loss"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 1])
def test_eval_loss_weights_a_smaller_last_batch_as_one_process_trainer(tmp_path: Path, tp: int) -> None:
    """14 samples in batches of 4: at dp=1 x tp=2 the last batch holds 2 and must weigh 2 samples, not 4; at
    dp=2 x tp=1 each replica's 7 samples end in a batch of 3, gathered over the DP group."""
    got = run_ranks(evaluate_rank, 2, str(tmp_path / "tp"), 14, tp)
    expected = Trainer(model=tiny_model("llama"), args=eval_arguments(str(tmp_path / "one")),
                       eval_dataset=Sequences(14)).evaluate()["eval_loss"]
    # fp32: TP changes only the order of sums in the forward; the batch-mean slip this guards against is ~1e-4
    assert got[0] == got[1] and abs(got[0] - expected) <= 1e-5, (got, expected)


# --- consolidate builds the checkpoint's own class ---------------------------------------------------------------

TASK_CLASSES = {"bert": "AutoModelForSequenceClassification", "t5": "AutoModelForSeq2SeqLM",
                "llava": "AutoModelForImageTextToText"}


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


# --- Trainer resume across layouts, and consolidate inside a job ---------------------------------------------------

def recording_trainer(path: str, tp: int, fsdp: bool, steps: int = 1, save: bool = False, cp: int = 1) -> Trainer:
    """AutoTPTrainer on a tiny Llama wrapped at `tp` (and `cp`), keeping each step's loss unrounded in `.losses`."""
    from autotp.hf_trainer import AutoTPTrainer

    class Recording(AutoTPTrainer):
        losses: list[float] = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses = [*self.losses, loss.item()]
            return loss

    args = TrainingArguments(output_dir=path, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-3,
                             adam_epsilon=1e-6, seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
                             save_strategy="steps" if save else "no", save_steps=1)
    return Recording(model=autotp.wrap(tiny_model("llama"), tp_size=tp, cp_size=cp), args=args,
                     train_dataset=Sequences(12), fully_shard=fsdp)


def resume_in_other_layout(rank: int, world: int, path: str, saved_fsdp: bool) -> tuple[list[float], list[float]]:
    """Three steps at dp=2 x tp=1 with a checkpoint after each, under one layout (DDP or FSDP); then a resume from
    step 1 under the other. Returns both runs' losses."""
    whole = recording_trainer(path, 1, saved_fsdp, steps=3, save=True)
    whole.train()
    resumed = recording_trainer(f"{path}/resumed", 1, not saved_fsdp, steps=3)
    resumed.train(resume_from_checkpoint=f"{path}/checkpoint-1")
    return whole.losses, resumed.losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_fsdp", [True, False])
def test_trainer_resumes_across_ddp_and_fsdp(tmp_path: Path, saved_fsdp: bool) -> None:
    """A Trainer checkpoint saved with fully_shard resumes without it, and the other way: FSDP's rows of each Adam
    moment are not DDP's whole tensors, so the optimizer state is re-cut on load. Step 3's loss depends on it."""
    (whole, resumed), _ = run_ranks(resume_in_other_layout, 2, str(tmp_path), saved_fsdp)
    assert (tmp_path / "checkpoint-1" / "optimizer" / ".metadata").is_file()
    assert not list((tmp_path / "checkpoint-1").glob("optimizer.*"))
    # fp32: FSDP's reduce-scatter and DDP's all-reduce sum the two replicas' gradients in another order
    assert len(whole) == 3 and len(resumed) == 2
    assert max(abs(a - b) for a, b in zip(resumed, whole[1:])) <= 1e-5, (resumed, whole)


def old_format_resume(rank: int, world: int, path: str, saved_fsdp: bool) -> tuple[bool, str]:
    """One step at tp=2, then this rank's optimizer state saved as autotp wrote it before `optimizer/` (one file per TP
    rank, per TP and DP rank under FSDP); loaded at the same layout (is it the saved state?), then at the other."""
    from autotp.io.checkpoint.legacy import local_optimizer_state

    saved = recording_trainer(path, world, saved_fsdp)
    saved.train()
    state = local_optimizer_state(saved.optimizer.state_dict())
    torch.save(state, f"{path}/optimizer.tp{rank}-of-2{'.dp0-of-1' if saved_fsdp else ''}.pt")
    torch.distributed.barrier()
    same = recording_trainer(path, world, saved_fsdp)
    same.create_optimizer_and_scheduler(num_training_steps=1)
    same.load_optimizer_and_scheduler(path)  # what train(resume_from_checkpoint=path) calls
    loaded = local_optimizer_state(same.optimizer.state_dict())["state"]
    equal = loaded.keys() == state["state"].keys() and all(
        torch.equal(loaded[i][k].cpu(), v) for i, entry in state["state"].items() for k, v in entry.items())
    other = recording_trainer(path, world, not saved_fsdp)
    other.create_optimizer_and_scheduler(num_training_steps=1)
    try:
        other.load_optimizer_and_scheduler(path)
    except autotp.CheckpointError as err:
        return equal, str(err)
    return equal, "loaded"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_fsdp", [True, False])
def test_trainer_old_per_rank_optimizer_files_load_at_their_layout_only(tmp_path: Path, saved_fsdp: bool) -> None:
    """Checkpoints of autotp before `optimizer/` still resume at their own layout; at another, a clear error that names
    the files found and both layouts (here the tp size is the same: it is fully_shard that differs)."""
    for equal, message in run_ranks(old_format_resume, 2, str(tmp_path), saved_fsdp):
        assert equal
        saved = "optimizer.tp0-of-2.dp0-of-1.pt" if saved_fsdp else "optimizer.tp0-of-2.pt"
        expected = "optimizer.tp{}-of-2.pt" if saved_fsdp else "optimizer.tp{}-of-2.dp0-of-1.pt"
        assert any(expected.format(r) + ": missing" in message for r in (0, 1)) and saved in message, message
        layouts = ("tp=2, fully_shard at dp=1", "tp=2 without fully_shard")
        assert f"saved at {layouts[not saved_fsdp]}" in message and f"this run has {layouts[saved_fsdp]}" in message
        assert "resume at any tp, dp and fully_shard" in message, message


def load_rng_of_fewer_ranks(rank: int, world: int, path: str) -> torch.Tensor:
    """Trainer's RNG file for rank 0 and none for rank 1, as when a checkpoint of fewer ranks resumes on more, loaded
    at tp=2. (Trainer under run_ranks is not in its distributed mode, so each rank is given its own directory.)"""
    import random

    import numpy as np

    trainer = recording_trainer(path, world, False)
    mine = Path(path, f"rank{rank}")
    mine.mkdir()
    if rank == 0:
        generator = torch.Generator().manual_seed(123)
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": generator.get_state()},
                   mine / "rng_state.pth")
    trainer._load_rng_state(str(mine))  # what Trainer calls when it resumes
    return torch.get_rng_state()


@pytest.mark.timeout(120)
def test_trainer_resume_on_more_ranks_gives_a_tp_group_one_random_state(tmp_path: Path) -> None:
    """Rank 1 has no RNG file of its own: it takes its TP group's rank 0's generator, which wrap requires of TP ranks
    (their replicated dropout masks must agree), instead of keeping another state."""
    states = run_ranks(load_rng_of_fewer_ranks, 2, str(tmp_path))
    assert torch.equal(states[0], torch.Generator().manual_seed(123).get_state())
    assert torch.equal(states[1], states[0])


# --- the command line names its own flags ----------------------------------------------------------------------------

def test_cli_messages_name_the_flags_not_the_keyword_arguments(autotp_cli, tmp_path: Path) -> None:
    model = autotp.wrap(tiny_model("llama"), tp_size=1)  # tp 1: no process group
    autotp.save_checkpoint(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.txt").write_text("kept")
    refused = autotp_cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert refused.returncode == 2 and "pass --overwrite to replace it" in refused.stderr and "=True" not in refused.stderr
    assert autotp_cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--overwrite").returncode == 0
    uneven = autotp_cli("plan", "llama", "--tp", "3")
    assert uneven.returncode == 2 and "over --tp 3" in uneven.stderr and "tp_size" not in uneven.stderr, uneven.stderr


def test_cli_max_shard_size_is_checked_by_the_parser(capsys, tmp_path: Path) -> None:
    from autotp.cli import main

    with pytest.raises(SystemExit):
        main(["consolidate", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "5 gigs"])
    err = capsys.readouterr().err
    assert "argument --max-shard-size: a size such as 5GB" in err and "'5 gigs'" in err, err


# --- examples -------------------------------------------------------------------------------------------------------

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


# --- autotp plan / verify: progress, --dtype, no relayed transformers warnings -----------------------------------

class TransformersRelay(logging.Handler):
    """Collects what transformers logs (its library logger does not propagate, so caplog never sees it)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_cli(capsys, monkeypatch, *argv: str) -> tuple[int, str, str, list[str]]:
    """`autotp.cli.main(argv)` in this process, its stderr a terminal (progress is shown only there): (exit code,
    stdout, stderr, what transformers logged or warned)."""
    from autotp.cli import main

    relay, library = TransformersRelay(), logging.getLogger("transformers")
    library.addHandler(relay)
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = main(list(argv))
    finally:
        library.removeHandler(relay)
    out, err = capsys.readouterr()
    relayed = relay.messages + [str(w.message) for w in caught if "/transformers/" in w.filename]
    return code, out, err, relayed


@pytest.mark.timeout(120)
def test_plan_shows_progress_and_relays_no_transformers_warnings(capsys, monkeypatch) -> None:
    code, out, err, relayed = run_cli(capsys, monkeypatch, "plan", "bert", "--tp", "2")  # BERT warned about is_decoder 3 times
    assert code == 0 and relayed == [], relayed
    assert "autotp plan: building bert on the meta device in float32" in err and "planning at tp 2" in err, err
    assert "sizes in float32 (--dtype)" in out


@pytest.mark.timeout(120)
def test_plan_sizes_follow_dtype_not_the_configs_torch_dtype(capsys, monkeypatch, tmp_path: Path) -> None:
    """A released config says torch_dtype bfloat16: the default sizes stay float32, and --dtype chooses."""
    import json

    from autotp.testing import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config("llama")).parameters())
    sizes = {}
    for dtype in ("default", "bfloat16", "float16", "float32"):
        code, out, _, _ = run_cli(capsys, monkeypatch, "plan", str(tmp_path), "--tp", "2", "--json",
                               *(["--dtype", dtype] if dtype != "default" else []))
        info = json.loads(out)
        sizes[dtype] = (code, info["dtype"], info["unsharded_param_bytes"])
    assert sizes == {"default": (0, "float32", 4 * numel), "float32": (0, "float32", 4 * numel),
                     "bfloat16": (0, "bfloat16", 2 * numel), "float16": (0, "float16", 2 * numel)}, sizes


@pytest.mark.timeout(180)
def test_verify_shows_progress_and_relays_no_transformers_warnings(capsys, monkeypatch) -> None:
    """The ranks are forked: what they log is not collected here, only what this process does before them."""
    code, out, err, relayed = run_cli(capsys, monkeypatch, "verify", "bert", "--tp", "2", "--steps", "1")
    assert code == 0 and "OK:" in out and relayed == [], (out, relayed)
    assert "autotp verify: building bert" in err and "training 1 steps on 2 CPU ranks" in err, err


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


def cp_trainer_losses(rank: int, world: int, path: str, cp: int) -> list[float]:
    """AutoTPTrainer at tp=1 x cp=`cp` (one replica): 3 steps of the same batches as on one rank."""
    trainer = recording_trainer(path, 1, False, steps=3, cp=cp)
    trainer.train()
    return trainer.losses


@pytest.mark.timeout(120)
def test_trainer_under_context_parallelism_trains_as_one_rank(tmp_path: Path) -> None:
    """cp=2: each CP rank computes its half of every sequence, the gradients are summed over CP (DDP over DP x CP),
    and the token count covers the whole sequence: the losses of one rank's run, to fp32 rounding."""
    (one,) = run_ranks(cp_trainer_losses, 1, str(tmp_path / "one"), 1)
    for losses in run_ranks(cp_trainer_losses, 2, str(tmp_path / "cp"), 2):
        assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, one)) <= 1e-5, (losses, one)
