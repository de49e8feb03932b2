"""Pipeline parallelism: the rank workers of tests/pp/ (a helper module beside the PP tests)."""

from __future__ import annotations

import copy

import torch
import transformers as tf
from peft import LoraConfig, get_peft_model

import autotp
from autotp.testing import parity, tiny_config
from ep_workers import whole
from models import batch, tiny_model


def pp_batch(rows: int = 4, seq: int = 16, seed: int = 1, pads: tuple[int, ...] = (0, 3, 6, 9)) -> dict:
    """A batch whose micro-batches (one row each at 4 micro-batches) hold different label counts: rows padded on the
    right by different amounts (`pads`; attention_mask 0, labels -100)."""
    ids = batch(size=(rows, seq), seed=seed)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        if pad:
            mask[row, seq - pad :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pp_parity(rank: int, world: int, family: str, tp: int, pp: int, options: dict, steps: int = 3) -> dict:
    """One process and the wrapped model, from one seed, through the same calls: each step's loss, and after the
    steps every parameter a rank trains (its stages') against one process's, as full tensors."""
    options = dict(options)
    config = options.pop("config", {})
    clip = options.pop("clip", None)  # clip both runs' gradients to this norm every step
    pads = options.pop("pads", (0, 3, 6, 9))  # under DP: rows whose halves hold equal label counts
    reference = tiny_model(family, **config)
    lora = options.pop("lora", None)  # PEFT's LoRA put on before wrap, as tests/tp's LoRA tests do
    if lora is not None:
        reference = get_peft_model(reference, lora)
    if options.pop("checkpointing", False):  # activation checkpointing, turned on before wrap as a user does
        reference.gradient_checkpointing_enable()
    compiled = options.pop("compile", False)
    images = options.pop("images", None)  # a function adding a VLM's image inputs (one image a row) to a batch
    shard = options.pop("fully_shard", False)  # FSDP2 within each stage, over its DP group
    evaluating = options.pop("eval", False)  # both models trained in eval mode (dropout configured but off)
    model = copy.deepcopy(reference)
    autotp.wrap(model.base_model.model if lora is not None else model, tp, pp_size=pp, **options)
    if shard:
        autotp.fully_shard(model)
    if evaluating:
        reference.eval()
        model.eval()
    for layer in model.model.layers if compiled else []:  # torch.compile of each decoder layer after wrap
        layer.compile()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, expected, norms = [], [], []
    for step in range(steps):
        inputs = pp_batch(len(pads), seq=16 - 2 * step, seed=step + 1, pads=pads)  # the length changes between steps
        inputs = images(inputs, reference.config) if images else inputs
        out = autotp.forward_backward(reference, **inputs)
        expected.append(out.loss.item())
        if clip is not None:
            norms.append((torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item(),))
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(replicas_loss(model, autotp.forward_backward(model, **replica_rows(model, inputs)).loss))
        autotp.allreduce_gradients(model)
        if clip is not None:
            norms[-1] += (autotp.clip_grad_norm_(model, clip).item(),)
        opt.step()
        opt.zero_grad(set_to_none=False)
    with torch.no_grad():  # evaluation: the forward-only schedule, the loss and logits on every rank
        inputs = pp_batch(seed=7)
        inputs = images(inputs, reference.config) if images else inputs
        try:
            got, want = model(**inputs), reference(**inputs)
            evaluated: tuple | str = (
                abs(got.loss.item() - want.loss.item()),
                (got.logits - want.logits).abs().max().item(),
            )
        except NotImplementedError as err:  # a layout whose evaluation is refused: the message, for the test
            evaluated = str(err)
    ref = dict(reference.named_parameters(remove_duplicate=False))  # a tied tensor under the name a stage holds
    trained = {
        name: whole(p, p, model)  # experts gathered over EP, TP shards over TP
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    errors = {name: (t - ref[name].detach()).abs().max().item() for name, t in trained.items()}
    tied = None
    if reference.config.tie_word_embeddings:
        tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    stage = autotp.pp_rank(model)
    return {
        "losses": losses,
        "expected": expected,
        "errors": errors,
        "stage": stage,
        "tied": tied,
        "norms": norms,
        "eval": evaluated,
    }


def assert_pp_parity(results: list[dict], reference_names: int | None = None, evaluated: bool = True) -> None:
    for result in results:
        for got, expected in zip(result["losses"], result["expected"]):
            assert abs(got - expected) < parity.LOSS_ATOL, (result["stage"], result["losses"], result["expected"])
        assert result["errors"] and max(result["errors"].values()) < parity.PARAM_ATOL, result["errors"]
        assert isinstance(result["eval"], tuple) or not evaluated, result["eval"]
        assert not evaluated or result["eval"][0] < parity.LOSS_ATOL and result["eval"][1] < 1e-4, result[
            "eval"
        ]  # under no_grad
        for expected, got in result["norms"]:  # clip_grad_norm_: the whole model's norm, on every stage
            assert abs(got - expected) < 1e-5 * max(1.0, expected), result["norms"]
    trained = set().union(*(r["errors"] for r in results))
    if reference_names is not None:
        assert len(trained) == reference_names, trained  # every parameter is trained on some stage


def pp_refusals(rank: int, world: int) -> dict:
    """What a pipeline refuses, each by name and before the model changes (its parameters the same objects, equal),
    and a plain forward of the wrapped model."""
    refused = {}
    for name, options in {
        "ep_size": dict(ep_size=2),
        "pp_schedule": dict(pp_schedule="InterleavedZeroBubble"),  # torch's, not offered
        "output_router_logits": dict(build=lambda: tf.AutoModelForCausalLM.from_config(router_logits("afmoe"))),
        "inline loss": dict(build=lambda: InlineLoss(tiny_model("llama").config)),
        "t5": dict(build=lambda: tf.AutoModelForSeq2SeqLM.from_config(tiny_config("t5"))),
        "pp_split_points": dict(pp_split_points=(0,)),
        "pp_stages_per_rank": dict(pp_stages_per_rank=2),  # 1F1B runs one stage per rank
    }.items():
        build = options.pop("build", None)
        model = build() if build else tiny_model(options.pop("family", "llama"), **options.pop("config", {}))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            autotp.wrap(model, 1, pp_size=2, **options)
        except (NotImplementedError, ValueError) as err:
            unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and len(before) == len(
                list(model.parameters())
            )
            refused[name] = (str(err), unchanged and not hasattr(model, "autotp_state"))
    model = autotp.wrap(tiny_model("llama"), 1, pp_size=2)
    inputs = pp_batch()
    try:
        model(**inputs)
    except RuntimeError as err:
        refused["forward"] = (str(err), True)
    try:  # a packed batch's flat sequence boundaries are not per row
        autotp.forward_backward(model, **inputs, cu_seq_lens_q=torch.tensor([0, 16]))
    except NotImplementedError as err:
        refused["cu_seq_lens_q"] = (str(err), True)
    peft = get_peft_model(model, LORA)  # LoRA added after wrap: refused at the first step, before any weight changes
    before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    try:
        autotp.forward_backward(peft, **inputs)
    except NotImplementedError as err:
        grads = any(p.grad is not None for p in peft.parameters())
        refused["peft after wrap"] = (
            str(err),
            not grads and all(torch.equal(p, before[n]) for n, p in peft.named_parameters()),
        )
    return refused


def router_logits(family: str) -> tf.PretrainedConfig:
    """A tiny `family` config with its MoE load-balancing loss on (AFMoE's is not transformers' Switch loss)."""
    config = tiny_config(family)
    config.output_router_logits = True
    return config


LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def micro_batch_means(family: str = "llama", microbatches: int = 4) -> tuple[float, float]:
    """(one process's loss on the whole batch, the mean of its micro-batches' mean losses): the control."""
    model = tiny_model(family)
    inputs = pp_batch()
    whole = model(**inputs).loss.item()
    rows = inputs["input_ids"].shape[0] // microbatches
    parts = [
        model(**{k: v[i * rows : (i + 1) * rows] for k, v in inputs.items()}).loss.item() for i in range(microbatches)
    ]
    return whole, sum(parts) / len(parts)


def replica_rows(model: torch.nn.Module, inputs: dict) -> dict:
    """This DP replica's rows of the global batch (all of them with one replica)."""
    dp, rank = autotp.dp_size(model), autotp.dp_rank(model)
    rows = inputs["input_ids"].shape[0] // dp
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in inputs.items()}


def replicas_loss(model: torch.nn.Module, loss: torch.Tensor) -> float:
    """The replicas' mean loss (one process's when their halves hold equal label counts)."""
    loss = loss.detach().clone()
    torch.distributed.all_reduce(loss, group=autotp.dp_group(model))
    return loss.item() / autotp.dp_size(model)


class InlineLoss(tf.LlamaForCausalLM):
    """A user's causal LM computing its loss inline, a mean over its own tokens, not through `loss_function`."""

    def forward(self, input_ids=None, labels=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        out = super().forward(input_ids=input_ids, **kwargs)
        logits, targets = out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
        out.loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
        return out
