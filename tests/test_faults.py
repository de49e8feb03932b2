"""What users do around a wrapped model either works with parity or stops at once with a clear error.

Parity tolerances as in test_parity (fp32: tensor parallelism only reorders sums).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import assert_parity, parity, run_ranks, tiny_config
from models import batch, tiny_model


# --- resize_token_embeddings ---------------------------------------------------------------------------------

def resize_parity(rank: int, world: int, family: str, new_vocab: int, vocab_parallel: bool) -> dict:
    report = parity.compare_training(tiny_model(family), batch(vocab=min(256, new_vocab)), world,
                                     vocab_parallel=vocab_parallel,
                                     edit=lambda m: m.resize_token_embeddings(new_vocab))
    ids = torch.randint(0, new_vocab, (2, 16), generator=torch.Generator().manual_seed(3))  # new tokens too
    model = autotp.wrap(tiny_model(family), world, vocab_parallel=vocab_parallel)
    model.resize_token_embeddings(new_vocab)
    report["new_ids_loss"] = model(ids, labels=ids).loss.item()
    report["vocab_parallel"] = model.autotp_state.plan.vocab is not None
    return report


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family,new_vocab", [("llama", 262), ("gemma", 262), ("llama", 256), ("llama", 200)])
def test_resize_token_embeddings_keeps_parity(family: str, new_vocab: int, tp: int) -> None:
    """Grow unevenly (262 = 66/66/65/65 at tp 4), tied (gemma) or not, same size, shrink."""
    reports = run_ranks(resize_parity, tp, family, new_vocab, True)
    for report in reports:
        assert_parity(report)
        assert report["vocab_parallel"]
    assert len({r["new_ids_loss"] for r in reports}) == 1, "the ranks disagree on the loss after resizing"


def test_resize_token_embeddings_without_vocab_parallelism() -> None:
    for report in run_ranks(resize_parity, 2, "llama", 262, False):
        assert_parity(report)
        assert not report["vocab_parallel"]


def resize_after_loading(rank: int, world: int, path: str) -> float:
    model = autotp.from_pretrained(path, world)
    reference = AutoModelForCausalLM.from_pretrained(path)
    for m in (reference, model):
        torch.manual_seed(7)  # the new rows are drawn at random: the same draw for both
        m.resize_token_embeddings(262)
    ids = torch.randint(0, 262, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return (model(ids).logits - reference(ids).logits).abs().max().item()


def test_resize_token_embeddings_after_from_pretrained(tmp_path: Path) -> None:
    tiny_model("gemma").save_pretrained(tmp_path)
    for difference in run_ranks(resize_after_loading, 2, str(tmp_path)):
        assert difference <= 1e-5  # fp32, only the order of sums differs


# --- model.save_pretrained ------------------------------------------------------------------------------------

def hf_save(rank: int, world: int, target: str) -> dict | None:
    model = autotp.wrap(tiny_model("gemma"), world)
    with pytest.raises(ValueError) as err:
        model.save_pretrained(target, safe_serialization=False)
    refused_before_writing = not Path(target).exists()
    model.save_pretrained(target)  # transformers' method, as a user would call it, on every rank
    with autotp.GatherReplacedLayerParams(model):
        full = {k: v.clone() for k, v in model.state_dict().items()}
    return {"full": full, "error": str(err.value), "clean": refused_before_writing} if rank == 0 else None


def test_plain_save_pretrained_writes_the_full_checkpoint(tmp_path: Path) -> None:
    report = run_ranks(hf_save, 2, str(tmp_path / "out"))[0]
    assert report["clean"] and "safe_serialization" in report["error"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in report["full"].items())


# --- replicated parameters ------------------------------------------------------------------------------------

def unseeded_ranks(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama", seed=rank), world, check_inputs=True)  # no common seed
    reference = tiny_model("llama", seed=0)
    norm = model.model.norm.weight
    out = {"equal_to_rank0": torch.equal(norm, reference.model.norm.weight)}
    autotp.check_replicas(model)  # passes: wrap made them equal
    if rank == 1:
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight.add_(1e-3)  # drift on one rank
    with pytest.raises(RuntimeError) as err:
        autotp.check_replicas(model)
    out["error"] = str(err.value)
    with pytest.raises(RuntimeError) as err:
        model(batch(), labels=batch())  # check_inputs=True checks replicas on the first training forward
    out["forward_error"] = str(err.value)
    return out


def test_replicated_parameters_are_broadcast_and_drift_is_named() -> None:
    for report in run_ranks(unseeded_ranks, 2):
        assert report["equal_to_rank0"]
        for message in (report["error"], report["forward_error"]):
            assert "replicated tensor model.layers.0.input_layernorm.weight (64,) differs between TP ranks" in message


# --- verification with dropout --------------------------------------------------------------------------------

def test_derived_plans_are_verified_with_dropout_off_and_the_mode_restored() -> None:
    config = tiny_config("seed_oss")
    config.residual_dropout = 0.1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    plan = autotp.explain(model, 2)
    assert plan.layers, plan.describe()
    assert all(m.training for m in model.modules())


# --- optimizer inside the gather context ----------------------------------------------------------------------

def step_inside_gather(rank: int, world: int) -> str:
    model = autotp.wrap(tiny_model("llama"), world)
    opt = torch.optim.AdamW(model.parameters())
    with autotp.GatherReplacedLayerParams(model):
        model(batch(), labels=batch()).loss.backward()
        with pytest.raises(RuntimeError) as err:
            opt.step()
    opt.step()  # outside, with the gradients computed inside: fine
    model(batch(), labels=batch()).loss.backward()
    opt.step()
    return str(err.value)


def test_optimizer_step_inside_gather_is_refused() -> None:
    for message in run_ranks(step_inside_gather, 2):
        assert "inside GatherReplacedLayerParams" in message and "Leave the context first" in message


# --- timeouts and subsets of ranks ----------------------------------------------------------------------------

def peer_fails(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama"), world, timeout=3)
    default = autotp.wrap(tiny_model("llama"), world).autotp_state.timeout
    if rank == 1:
        try:
            raise ValueError("a bug in rank 1's data loader")
        except ValueError:
            time.sleep(12)  # still alive, never joining the step
            return {}
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        model(batch(), labels=batch()).loss.backward()
    return {"seconds": time.monotonic() - start, "error": str(err.value), "default": default.total_seconds()}


@pytest.mark.timeout(120)
def test_a_failed_peer_stops_the_others_within_the_timeout() -> None:
    report = run_ranks(peer_fails, 2)[0]
    assert report["seconds"] < 10, report
    assert "over ranks [0, 1]" in report["error"]
    assert report["default"] == 60  # the timeout the ranks' init_process_group was given (autotp.testing.spawn)


def only_rank0_wraps(rank: int, world: int, path: str) -> float | None:
    if rank != 0:
        return None
    model = autotp.wrap(tiny_model("llama"), 1)
    loaded = autotp.from_pretrained(path, 1)
    ids = batch()
    return (model(ids, labels=ids).loss - loaded(ids, labels=ids).loss).abs().item()


@pytest.mark.timeout(60)
def test_tp1_on_a_subset_of_ranks_needs_no_collective(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    assert run_ranks(only_rank0_wraps, 2, str(tmp_path))[0] == 0.0


# --- frozen parameters, and wrap as a transaction --------------------------------------------------------------

def frozen_norms(rank: int, world: int, unfreeze_after_wrap: bool) -> dict:
    reference = tiny_model("qwen3")
    for name, p in reference.named_parameters():
        if "q_norm" in name or "k_norm" in name:
            p.requires_grad_(False)

    def unfreeze(model: nn.Module) -> None:
        model.requires_grad_(True)

    return parity.compare_training(reference, batch(), world, edit=unfreeze if unfreeze_after_wrap else None)


@pytest.mark.parametrize("unfreeze_after_wrap", [False, True])
def test_frozen_per_head_norms_wrap_and_keep_their_reduction_when_unfrozen(unfreeze_after_wrap: bool) -> None:
    for report in run_ranks(frozen_norms, 2, unfreeze_after_wrap):
        assert_parity(report)
        assert ("model.layers.0.self_attn.q_norm.weight" in report["grad"]) == unfreeze_after_wrap


STAGES = ["autotp.parallel.apply.LinearAllreduce.__init__", "autotp.api.apply_sequence_parallel",
          "autotp.api.register_grad_hooks", "autotp.api.DDPGuard", "autotp.api.broadcast_replicated"]


def snapshot(model: nn.Module) -> dict:
    return {
        "modules": [(n, type(m).__name__, len(m._forward_hooks), len(m._forward_pre_hooks))
                    for n, m in model.named_modules()],
        "attrs": [(n, sorted(k for k in vars(m) if not k.startswith("_"))) for n, m in model.named_modules()],
        "heads": [(n, getattr(m, "num_key_value_groups", None), getattr(m, "config", None) is model.config)
                  for n, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "own": sorted(vars(model)),
    }


def failing_wrap(rank: int, world: int, stage: str) -> dict:
    import importlib

    model = tiny_model("qwen3")
    before = snapshot(model)
    ids = batch()
    loss_before = model(ids, labels=ids).loss.item()
    module_name, _, attr = stage.rpartition(".")
    owner = importlib.import_module(module_name) if not attr.startswith("__") else None
    if owner is None:  # a method: fail on the second row layer, after the first was swapped in
        import autotp.parallel.apply as target
        cls = target.LinearAllreduce
        calls = {"n": 0}
        original = cls.__init__

        def broken(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected")
            original(self, *args, **kwargs)

        cls.__init__ = broken
    else:
        def broken(*args, **kwargs):
            raise RuntimeError("injected")

        setattr(owner, attr, broken)
    with pytest.raises(RuntimeError, match="injected"):
        autotp.wrap(model, world, sequence_parallel=True)
    after = snapshot(model)
    same_tensors = all(torch.equal(before["state"][k], v) for k, v in after["state"].items())
    return {"same": {k: before[k] == after[k] for k in ("modules", "attrs", "heads", "own")},
            "tensors": same_tensors and before["state"].keys() == after["state"].keys(),
            "loss": model(ids, labels=ids).loss.item() - loss_before,
            "wrapped": hasattr(model, "autotp_state")}


@pytest.mark.parametrize("stage", STAGES)
def test_wrap_failing_at_any_stage_leaves_the_model_as_it_was(stage: str) -> None:
    for report in run_ranks(failing_wrap, 2, stage):
        assert all(report["same"].values()), report["same"]
        assert report["tensors"] and report["loss"] == 0.0 and not report["wrapped"]


# --- bad shapes and bad models --------------------------------------------------------------------------------

def test_widths_and_vocabularies_below_tp_are_refused_naming_the_module() -> None:
    config = tiny_config("llama")
    config.intermediate_size = 3
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp: MLP width 3 is smaller than tp_size=4"):
        autotp.explain(model, 4)
    config = tiny_config("llama")
    config.vocab_size = 3
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = autotp.explain(model, 4)
    assert plan.vocab is None and "vocabulary (3) is smaller than tp_size=4" in plan.vocab_reason


def test_a_model_that_is_not_from_transformers_gets_a_clear_error() -> None:
    with pytest.raises(TypeError, match="transformers PreTrainedModel.*got Sequential"):
        autotp.wrap(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), 1)


# --- logging --------------------------------------------------------------------------------------------------

def logged(rank: int, world: int) -> list[tuple[str, str]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("autotp")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    autotp.wrap(tiny_model("olmo"), world)  # an HF-derived plan: vocab parallelism stays off
    return [(r.levelname, r.getMessage()) for r in records]


def test_wrap_logs_a_summary_and_warns_on_rank0_only() -> None:
    first, second = run_ranks(logged, 2)
    assert second == []
    assert first[0][0] == "INFO" and "tp_size=2" in first[0][1] and "sharded" in first[0][1]
    assert ("WARNING", "autotp: vocab parallelism is off: only models covered by a policy (the loss and logits "
                       "path of others is unchecked)") in first
