"""LoRA from PEFT on a wrapped model (`get_peft_model` after `autotp.wrap`) trains like one-process PEFT.

Column layers keep lora_A replicated and split lora_B like the base rows; row layers split lora_A like
the base columns and keep lora_B replicated (see `autotp.tp.lora`). The adapters start from the one-process
adapters' values (PEFT draws them at local shapes under TP), then both train 3 AdamW steps on the same
batch. Tolerances are parity's fp32 ones: only the order of sums differs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

import autotp
from autotp.runtime.replicas import check_replicas
from autotp.state import state_of
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, full_tensor, grad_error
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(targets: list[str], **extra) -> LoraConfig:
    return LoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": targets, "lora_dropout": 0.0, "init_lora_weights": False, **extra}
    )


LORA_OPTIONS = ("modules_to_save", "lora_dropout")  # keys of a case's config that go to LoraConfig, not to the model


def paired(
    rank: int, world: int, family: str, targets: list[str], model_config: dict | None = None, before: bool = False
):
    """(one-process PEFT model, PEFT model on the wrapped copy with the same adapter values, TP group).

    `before`: get_peft_model runs first and `wrap` shards the model holding the adapters.
    """
    options = {k: v for k, v in (model_config or {}).items() if k in LORA_OPTIONS}
    torch.manual_seed(0)
    base = tiny_model(family, **{k: v for k, v in (model_config or {}).items() if k not in LORA_OPTIONS})
    reference = get_peft_model(copy.deepcopy(base), lora_config(targets, **options))
    if before:
        model = get_peft_model(base, lora_config(targets, **options))
        model.load_state_dict(reference.state_dict())  # the same adapter values, drawn for the whole layers
        autotp.wrap(model.base_model.model, world)
        return reference, model, state_of(model.base_model.model).tp_group
    model = get_peft_model(autotp.wrap(base, world), lora_config(targets, **options))
    with torch.no_grad():
        model(input_ids=batch())  # each block adapts its LoRA layers on its first run
    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                shard = getattr(param, "autotp_shard", None)
                param.copy_(full[name] if shard is None else shard.partition.shard(full[name], shard.rank))
    return reference, model, state_of(model.base_model.model).tp_group


def lora_parity(
    rank: int,
    world: int,
    family: str,
    targets: list[str],
    model_config: dict | None = None,
    before: bool = False,
    checkpointing: bool = False,
) -> dict:
    reference, model, group = paired(rank, world, family, targets, model_config, before)
    if checkpointing:  # each block's forward replayed in backward: LoRA's joined collectives and dropout masks too
        for m in (reference, model):
            m.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            m.base_model.model.enable_input_require_grads()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref_params = dict(reference.named_parameters())
    assert set(trainable) == {n for n, p in ref_params.items() if p.requires_grad}
    optimizers = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, eps=1e-6) for m in (reference, model)
    ]
    ids = batch()
    report: dict = {"loss": 0.0, "grad": {}, "param": {}, "adapters": sum("lora_" in n for n in trainable)}
    for step in range(3):
        losses = []
        for m in (reference, model):
            torch.manual_seed(step)  # LoRA dropout: both draw from the same stream
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        report["loss"] = max(report["loss"], abs(losses[0] - losses[1]))
        if step == 0:
            for name, p in trainable.items():
                report["grad"][name] = grad_error(full_tensor(p.grad, p, group), ref_params[name].grad)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for name, p in model.named_parameters():
        report["param"][name] = (full_tensor(p, p, group) - ref_params[name].detach()).abs().max().item()
    check_replicas(model.base_model.model)  # replicated adapter halves stayed equal on every TP rank
    report["sharded_adapters"] = sum(hasattr(p, "autotp_shard") for n, p in trainable.items() if "lora_" in n)
    report["sharded_copies"] = sum(hasattr(p, "autotp_shard") for n, p in trainable.items() if "modules_to_save" in n)
    return report


def assert_close(report: dict) -> None:
    assert report["loss"] <= LOSS_ATOL, report["loss"]
    worst = max(report["grad"].items(), key=lambda kv: kv[1])
    assert worst[1] <= GRAD_RTOL, worst
    worst = max(report["param"].items(), key=lambda kv: kv[1])
    assert worst[1] <= PARAM_ATOL, worst


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "family,targets,model_config",
    [
        ("llama", LLAMA_ALL, {}),
        ("llama", LLAMA_ALL, {"num_key_value_heads": 2}),  # at tp 4, k/v rows (and lora_B's) are replicated on 2 ranks
        ("gpt2", ["c_attn", "c_proj", "c_fc"], {}),  # Conv1D; c_attn fused [q | k | v]
        ("qwen2", ["q_proj", "v_proj", "lm_head"], {}),  # q/v biases; the vocab-parallel LM head (rows by vocabulary)
        (
            "qwen2",
            ["q_proj", "v_proj"],
            {"modules_to_save": ["lm_head"]},
        ),  # a trainable copy of the vocab-parallel head
        ("llama", LLAMA_ALL, {"lora_dropout": 0.2}),  # the masks of one process: shared on column, sliced on row layers
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], {}),  # fused qkv and gate_up: lora_B split alike
    ],
    ids=["llama", "llama-kv2", "gpt2", "qwen2-head", "qwen2-copy", "llama-dropout", "phi3-fused"],
)
def test_lora_after_wrap_matches_one_process_peft(family: str, targets: list[str], model_config: dict, tp: int) -> None:
    for report in run_ranks(lora_parity, tp, family, targets, model_config):
        assert_close(report)
        assert report["sharded_adapters"] == report["adapters"] // 2, report  # one half of each pair is split
        assert report["sharded_copies"] == len(model_config.get("modules_to_save", [])), report


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "family,targets",
    [("llama", LLAMA_ALL), ("gpt2", ["c_attn", "c_proj", "c_fc"]), ("qwen2", ["q_proj", "v_proj", "lm_head"])],
)
def test_lora_before_wrap_matches_one_process_peft(family: str, targets: list[str], tp: int) -> None:
    """wrap shards a model PEFT already adapted: each adapter is split from its full values like its layer."""
    for report in run_ranks(lora_parity, tp, family, targets, None, True):
        assert_close(report)
        assert report["sharded_adapters"] == report["adapters"] // 2, report


def test_lora_on_the_embedding_before_wrap_at_tp_1_matches_one_process_peft() -> None:
    """Before: refused at tp_size=1 itself, telling the user to "train this adapter at tp_size=1". Nothing is split
    there, so PEFT's LoRA on the embedding (beside the linears') trains as one-process PEFT's."""
    (report,) = run_ranks(lora_parity, 1, "llama", [*LLAMA_ALL, "embed_tokens"], None, True)
    assert_close(report)
    assert report["adapters"] == 2 * (2 * len(LLAMA_ALL) + 1), report  # two layers' linears and the embedding


def dropout_masks(rank: int, world: int) -> list[torch.Tensor]:
    """What LoRA's dropout passes on in a GPT-2 whose own dropout makes its blocks draw per-rank streams."""
    torch.manual_seed(0)
    base = tiny_model("gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    model = get_peft_model(autotp.wrap(base, world), lora_config(["c_attn", "c_fc"], lora_dropout=0.3))
    model.train()
    seen: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith("lora_dropout.default"):
            module.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    return seen


def test_lora_dropout_on_a_column_layer_is_one_mask_on_every_rank() -> None:
    """Its input is replicated, so every TP rank must drop the same elements, even inside a block whose own dropout
    draws from per-rank streams (a rank-dependent mask would make each rank's output rows a different model)."""
    first, second = run_ranks(dropout_masks, 2)
    assert len(first) == 4 and all((a == 0).any() for a in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_lora_with_gradient_checkpointing_matches_one_process_peft(dropout: float) -> None:
    for report in run_ranks(lora_parity, 2, "llama", LLAMA_ALL, {"lora_dropout": dropout}, False, True):
        assert_close(report)


def count_lora_step(rank: int, world: int) -> dict:
    _, model, _ = paired(rank, world, "llama", LLAMA_ALL)
    counts: dict[str, int] = {}
    original = dist.all_reduce

    def counting(*args, **kwargs):
        counts["n"] = counts.get("n", 0) + 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        ids = batch()
        loss = model(input_ids=ids, labels=ids).loss
        forward, counts["n"] = counts.get("n", 0), 0
        loss.backward()
    finally:
        dist.all_reduce = original
    return {"forward": forward, "backward": counts["n"], "layers": model.config.num_hidden_layers}


def test_lora_keeps_two_all_reduces_per_layer_each_way() -> None:
    """Forward: 2 all-reduces per layer, as without LoRA (a row layer's adapter output joins the base's). Backward: 2
    per layer, as without LoRA (the replicated lora_A gradients join the input gradient's); the first layer's
    attention entry too, though its input needs no gradient, for its lora_A's. Plus vocab parallelism's 3 forward
    and the LM head's 1 backward."""
    for report in run_ranks(count_lora_step, 2):
        layers = report["layers"]
        assert report["forward"] == 2 * layers + 3, report
        assert report["backward"] == 2 * layers + 1, report


def dora_after_wrap(rank: int, world: int) -> str:
    model = get_peft_model(autotp.wrap(tiny_model("llama"), world), lora_config(["q_proj"], use_dora=True))
    try:
        model(input_ids=batch())
    except NotImplementedError as err:
        return str(err)
    return "ran"


def test_dora_is_refused_naming_the_layer() -> None:
    for message in run_ranks(dora_after_wrap, 2):
        assert "model.layers.0.self_attn.q_proj" in message and "DoRA" in message, message


def mixed_batch(rank: int, world: int) -> dict:
    """Two adapters, each row of the batch through its own (PEFT's adapter_names, evaluation only)."""
    reference, model, _ = paired(rank, world, "llama", LLAMA_ALL)
    for m in (reference, model):
        torch.manual_seed(1)
        m.add_adapter("other", lora_config(LLAMA_ALL))
        m.eval()
    with torch.no_grad():  # the second adapter adapted at its first forward, then the same values as one process
        model(input_ids=batch())
        full = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            if ".other." in name:
                shard = getattr(param, "autotp_shard", None)
                param.copy_(full[name] if shard is None else shard.partition.shard(full[name], shard.rank))
    ids = batch()
    names = ["default", "other"] * (ids.shape[0] // 2)
    with torch.no_grad():
        error = (
            (model(input_ids=ids, adapter_names=names).logits - reference(input_ids=ids, adapter_names=names).logits)
            .abs()
            .max()
            .item()
        )
    model.train()
    try:
        model(input_ids=ids, adapter_names=names)
    except (NotImplementedError, ValueError) as err:  # PEFT's own refusal in training mode comes first
        return {"error": error, "training": str(err)}
    return {"error": error, "training": "ran"}


def test_mixed_adapter_batches_evaluate_like_one_process() -> None:
    for report in run_ranks(mixed_batch, 2):
        assert report["error"] < 1e-5, report
        assert "adapter_names" in report["training"], report


def one_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """One AdamW step at a large learning rate, so adapters move well away from their start."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def gathered_eval_and_save(rank: int, world: int, path: str) -> dict:
    """After a training step: logits sharded and under GatherReplacedLayerParams, and PEFT's own save_pretrained
    inside it on every rank."""
    reference, model, _ = paired(rank, world, "llama", LLAMA_ALL)
    ids = batch()
    for m in (reference, model):
        one_step(m, ids)
    inner = model.base_model.model
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        sharded = (model(input_ids=ids).logits - expected).abs().max().item()
        with autotp.GatherReplacedLayerParams(inner):
            gathered = (model(input_ids=ids).logits - expected).abs().max().item()
            model.save_pretrained(path, is_main_process=rank == 0)
        after = (model(input_ids=ids).logits - expected).abs().max().item()
    return {"sharded": sharded, "gathered": gathered, "after": after, "expected": expected}


def test_gathered_adapters_evaluate_and_save_in_peft_format(tmp_path) -> None:
    """One process loads the adapter trained and saved under TP with PeftModel.from_pretrained: the same logits."""
    from peft import PeftModel

    reports = run_ranks(gathered_eval_and_save, 2, str(tmp_path))
    for report in reports:
        assert max(report["sharded"], report["gathered"], report["after"]) < 1e-5, report
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path))
    with torch.no_grad():
        logits = loaded(input_ids=batch()).logits
    assert (logits - reports[0]["expected"]).abs().max().item() < 1e-5


def file_shapes(directory) -> dict[str, tuple[int, ...]]:
    from safetensors.torch import load_file

    return {k: tuple(v.shape) for k, v in load_file(str(directory / "adapter_model.safetensors")).items()}


SAVE_CASES = [("llama", LLAMA_ALL, {}), ("qwen2", ["q_proj", "v_proj"], {"modules_to_save": ["lm_head"]})]


def save_everywhere(rank: int, world: int, path: str, family: str, targets: list[str], model_config: dict) -> dict:
    """PEFT's save_pretrained called on every rank as a one-process script calls it: no gather, no is_main_process."""
    reference, model, _ = paired(rank, world, family, targets, model_config)
    ids = batch()
    for m in (reference, model):
        one_step(m, ids)
    model.save_pretrained(path)
    with torch.no_grad():
        after = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
        expected = reference(input_ids=ids).logits
    return {"after": after, "expected": expected}


@pytest.mark.parametrize("family,targets,model_config", SAVE_CASES)
def test_peft_save_pretrained_on_every_rank_writes_the_full_adapter(
    tmp_path, family: str, targets: list[str], model_config: dict
) -> None:
    """Split halves and the vocab-parallel head's trainable copy are written at full size, once; one process loads
    them with PeftModel.from_pretrained and gets the logits of the one-process model trained alike."""
    from peft import PeftModel

    reports = run_ranks(save_everywhere, 2, str(tmp_path), family, targets, model_config)
    assert max(r["after"] for r in reports) < 1e-5, reports  # the shards are back and unchanged after saving
    options = {k: v for k, v in model_config.items() if k in LORA_OPTIONS}
    get_peft_model(tiny_model(family), lora_config(targets, **options)).save_pretrained(str(tmp_path / "one"))
    assert file_shapes(tmp_path) == file_shapes(tmp_path / "one")  # PEFT's own keys, at one process's shapes
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(tiny_model(family), str(tmp_path))
    with torch.no_grad():
        logits = loaded(input_ids=batch()).logits
    assert (logits - reports[0]["expected"]).abs().max().item() < 1e-5


def save_before_any_forward(rank: int, world: int, path: str) -> None:
    get_peft_model(autotp.wrap(tiny_model("llama"), world), LoraConfig(r=4, target_modules=LLAMA_ALL)).save_pretrained(
        path
    )


def test_an_adapter_saved_right_after_get_peft_model_is_full_size(tmp_path) -> None:
    """The adapters PEFT just drew at shard shapes are made tensor-parallel before the save, not written as shards."""

    run_ranks(save_before_any_forward, 2, str(tmp_path))
    get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=LLAMA_ALL)).save_pretrained(
        str(tmp_path / "one")
    )
    assert file_shapes(tmp_path) == file_shapes(tmp_path / "one")


def load_into_wrapped(rank: int, world: int, path: str, low_cpu_mem_usage: bool) -> dict:
    """PeftModel.from_pretrained on a wrapped model: each rank keeps its slices; then it trains like one process."""
    from peft import PeftModel

    torch.manual_seed(0)
    reference = PeftModel.from_pretrained(tiny_model("llama"), path, is_trainable=True)
    torch.manual_seed(0)
    model = PeftModel.from_pretrained(
        autotp.wrap(tiny_model("llama"), world), path, is_trainable=True, low_cpu_mem_usage=low_cpu_mem_usage
    )
    ids = batch()
    errors = []
    for _ in range(2):
        with torch.no_grad():
            errors.append((model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item())
        for m in (reference, model):
            one_step(m, ids)
    check_replicas(model.base_model.model)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    return {"errors": errors, "rows": q.lora_B["default"].weight.shape[0], "full": q.base_layer.full_out}


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_an_adapter_loads_into_a_wrapped_model_as_slices(tmp_path, low_cpu_mem_usage: bool) -> None:
    torch.manual_seed(0)
    reference = get_peft_model(tiny_model("llama"), lora_config(LLAMA_ALL))
    one_step(reference, batch())
    reference.save_pretrained(str(tmp_path))
    for report in run_ranks(load_into_wrapped, 2, str(tmp_path), low_cpu_mem_usage):
        assert max(report["errors"]) < 1e-5, report  # loaded, and after a training step from it
        assert report["rows"] * 2 == report["full"], report  # this rank's rows of q_proj's lora_B only


def merge_under_tp(rank: int, world: int, path: str) -> dict:
    """PEFT's merge_and_unload after a training step: the base layers hold the merged shards and reduce again."""
    reference, model, _ = paired(rank, world, "llama", LLAMA_ALL)
    ids = batch()
    for m in (reference, model):
        one_step(m, ids)
    merged, expected = model.merge_and_unload(), reference.merge_and_unload()
    with torch.no_grad():
        error = (merged(input_ids=ids).logits - expected(input_ids=ids).logits).abs().max().item()
    autotp.save_pretrained(merged, path)
    return {"logits": error, "expected": {k: v.clone() for k, v in expected.state_dict().items()}}


def test_merge_and_unload_gives_the_one_process_merge(tmp_path) -> None:
    from safetensors.torch import load_file

    reports = run_ranks(merge_under_tp, 2, str(tmp_path / "merged"))
    assert max(r["logits"] for r in reports) < 1e-5, reports
    saved = load_file(str(tmp_path / "merged" / "model.safetensors"))
    expected = reports[0]["expected"]
    assert set(saved) <= set(expected)
    worst = max((saved[k] - expected[k]).abs().max().item() for k in saved)
    assert worst < 1e-6, worst  # the merged full checkpoint equals the one-process merge


def full_save_with_adapters(rank: int, world: int, path: str) -> list[str]:
    _, model, _ = paired(rank, world, "llama", ["q_proj"])
    messages = []
    for target in (model, model.base_model.model):  # ours, and the wrapped model's own save_pretrained
        try:
            (autotp.save_pretrained(target, path) if target is model else target.save_pretrained(path))
        except TypeError as err:
            messages.append(str(err))
    return messages


def test_a_full_save_of_a_model_holding_adapters_is_refused(tmp_path) -> None:
    """It would write q_proj.base_layer.weight, which transformers does not load (it would re-initialise q_proj)."""
    for messages in run_ranks(full_save_with_adapters, 2, str(tmp_path / "out")):
        assert len(messages) == 2 and all("merge_and_unload" in m and "peft" in m for m in messages), messages
    assert not (tmp_path / "out").exists()


def load_adapter_then_wrap(rank: int, world: int, path: str) -> torch.Tensor:
    """PEFT's own loading of a saved adapter, before wrap: the logits of the one-process model that saved it."""
    from peft import PeftModel

    torch.manual_seed(0)
    model = PeftModel.from_pretrained(tiny_model("llama"), path)
    autotp.wrap(model.base_model.model, world)
    with torch.no_grad():
        return model(input_ids=batch()).logits


def test_an_adapter_saved_by_one_process_loads_before_wrap(tmp_path) -> None:
    torch.manual_seed(0)
    reference = get_peft_model(tiny_model("llama"), lora_config(LLAMA_ALL))
    one_step(reference, batch())
    reference.save_pretrained(str(tmp_path))
    with torch.no_grad():
        expected = reference(input_ids=batch()).logits
    for logits in run_ranks(load_adapter_then_wrap, 2, str(tmp_path)):
        assert (logits - expected).abs().max().item() < 1e-5


def lora_on_a_resized_head(rank: int, world: int) -> bool:
    """After resize_token_embeddings rebuilt the vocab-parallel head, LoRA put around it is still made parallel."""
    torch.manual_seed(0)
    wrapped = autotp.wrap(tiny_model("llama"), world)
    wrapped.resize_token_embeddings(262)
    model = get_peft_model(wrapped, lora_config(["lm_head"]))
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    check_replicas(wrapped)
    return hasattr(wrapped.lm_head, "autotp_lora")


def test_lora_on_the_head_after_a_vocabulary_resize() -> None:
    assert all(run_ranks(lora_on_a_resized_head, 2))
