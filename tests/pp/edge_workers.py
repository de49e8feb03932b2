"""Pipeline parallelism's edges (bf16, a frozen stage, the Trainer's evaluation, inputs that differ between stages,
the calls refused by name): the rank workers of tests/pp/test_pp_edges.py (a helper module beside them)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator

import numpy as np
import torch
import transformers as tf
from peft import LoraConfig, get_peft_model
from transformers import Trainer

import autotp
from autotp.testing import parity, tiny_config
from compose_workers import Padded, trainer_arguments
from ep_workers import whole
from models import batch, tiny_model
from pp_workers import pp_batch, pp_parity, replica_rows, replicas_loss

BF16_METRICS = ("loss", "param", "eval loss", "eval logits", "generate logits")


def bf16_parity(rank: int, world: int, tp: int, pp: int, options: dict) -> dict:
    """One process in fp32 and in bf16, and the wrapped model in bf16, from one seed through the same calls: 3 AdamW
    steps, an evaluation and a greedy `generate`. Per metric (`BF16_METRICS`): (yardstick, error), the yardstick one
    process's bf16 against its fp32, the error the wrapped bf16 against one process's bf16; and the tokens."""
    options = dict(options)
    pads = options.pop("pads", (0, 3, 6, 9))
    fp32 = tiny_model("llama", num_hidden_layers=options.pop("layers", 2))
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    model = autotp.wrap(copy.deepcopy(bf16), tp, pp_size=pp, **options)
    runs = {"fp32": fp32, "bf16": bf16, "wrapped": model}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in runs.items()}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(3):
        inputs = pp_batch(seq=16 - 2 * step, seed=step + 1, pads=pads)
        for name, m in runs.items():
            if name == "wrapped":
                losses[name].append(replicas_loss(m, autotp.forward_backward(m, **replica_rows(m, inputs)).loss))
                autotp.allreduce_gradients(m)
            else:
                losses[name].append(autotp.forward_backward(m, **inputs).loss.item())
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=name != "wrapped")  # the wrapped: what its stages train, below
    trained = {n: whole(p, p, model).float() for n, p in model.named_parameters() if p.grad is not None}
    params = {name: dict(runs[name].named_parameters()) for name in ("fp32", "bf16")}
    inputs = pp_batch(seed=7)
    ids = batch(size=(2, 6), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left-padded, as generation pads
    settings = dict(
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    evaluated, generated = {}, {}
    with torch.no_grad():
        for name, m in runs.items():
            out = m(**inputs)
            evaluated[name] = (out.loss.float(), out.logits.float())
            gen = m.generate(input_ids=ids, attention_mask=mask, **settings)
            generated[name] = (gen.sequences.tolist(), torch.stack(gen.logits).float())

    def pair(value: Callable[[str], Any]) -> tuple[float, float]:
        one, bf, got = value("fp32"), value("bf16"), value("wrapped")
        return (one - bf).abs().max().item(), (got - bf).abs().max().item()

    report = {
        "loss": pair(lambda name: torch.tensor(losses[name])),
        "param": (
            max((params["fp32"][n].detach() - params["bf16"][n].float()).abs().max().item() for n in trained),
            max((t - params["bf16"][n].float()).abs().max().item() for n, t in trained.items()),
        ),
        "eval loss": pair(lambda name: evaluated[name][0]),
        "eval logits": pair(lambda name: evaluated[name][1]),
        "generate logits": pair(lambda name: generated[name][1]),
    }
    return {**report, "tokens": {name: generated[name][0] for name in runs}, "trained": len(trained)}


def frozen_stage(rank: int, world: int, case: str) -> dict:
    """A stage with nothing to train (`case` "frozen": the embedding and layer 0, all of stage 0; "lora": LoRA on
    layer 0 only, so stage 1 holds no adapter): 2 steps, each clipped to a norm below the gradients', against one
    process clipping with torch's `clip_grad_norm_`: the norms, and the trained parameters after the steps."""
    reference = tiny_model("llama")
    if case == "frozen":
        for name, p in reference.named_parameters():
            p.requires_grad_(not name.startswith(("model.embed_tokens.", "model.layers.0.")))
        model = autotp.wrap(copy.deepcopy(reference), 1, pp_size=2)
    else:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[0])
        reference = get_peft_model(reference, lora)
        model = copy.deepcopy(reference)
        autotp.wrap(model.base_model.model, 1, pp_size=2)
    optimizers = [torch.optim.AdamW(m.parameters()) for m in (reference, model)]  # frozen ones: no gradient, no step
    norms = []
    for step in range(2):
        inputs = pp_batch(seed=step + 1)
        autotp.forward_backward(reference, **inputs)
        expected = torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], 1e-3)
        autotp.forward_backward(model, **inputs)
        autotp.allreduce_gradients(model)
        norms.append((autotp.clip_grad_norm_(model, 1e-3).item(), expected.item()))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    ref = dict(reference.named_parameters())
    errors = {n: (p - ref[n]).abs().max().item() for n, p in model.named_parameters() if p.grad is not None}
    return {"norms": norms, "errors": errors}


def metric(prediction: Any) -> dict[str, float]:
    """A `compute_metrics` that reads the logits: the mean log-probability of each next label token."""
    logits, labels = torch.from_numpy(np.asarray(prediction.predictions)), torch.from_numpy(prediction.label_ids)
    targets = labels[:, 1:]
    scores = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets.clamp_min(0).unsqueeze(-1))[..., 0]
    kept = targets != -100
    return {"log_likelihood": (scores * kept).sum().item() / kept.sum().item()}


def one_process_evaluation(rank: int, world: int, path: str) -> dict[str, float]:
    """transformers' own Trainer in one process: `evaluate` of 10 rows (batches of 4, 4 and 2) with `metric`."""
    trainer = Trainer(
        tiny_model("llama"), trainer_arguments(path), eval_dataset=Padded(size=10), compute_metrics=metric
    )
    return trainer.evaluate()


def trainer_cases(path: str) -> dict:
    """AutoTPTrainer at pp 2: `evaluate` as `one_process_evaluation` does it; training on 10 rows in batches of 4
    (the epoch's last batch 2 rows) at 4 micro-batches, refused before the first step, the weights unchanged; and with
    a sampler of no known length, refused at that batch (the steps before it taken)."""
    from autotp.hf_trainer import AutoTPTrainer

    model = autotp.wrap(tiny_model("llama"), 1, pp_size=2, pp_microbatches=2)
    trainer = AutoTPTrainer(model, trainer_arguments(path), eval_dataset=Padded(size=10), compute_metrics=metric)
    report: dict[str, Any] = {"evaluate": trainer.evaluate()}
    model = autotp.wrap(tiny_model("llama"), 1, pp_size=2, pp_microbatches=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = AutoTPTrainer(model, trainer_arguments(path, max_steps=3), train_dataset=Padded(size=10))
    try:
        trainer.train()
    except ValueError as err:
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        report["short batch"] = (str(err), trainer.state.global_step == 0 and unchanged)

    class Unsized(AutoTPTrainer):  # a sampler of no known length: the short batch is only seen when it comes
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return InOrder(10)

    trainer = Unsized(model, trainer_arguments(path, max_steps=3), train_dataset=Padded(size=10))
    try:
        trainer.train()
    except ValueError as err:
        report["unsized short batch"] = (str(err), trainer.state.global_step)
    return report


class InOrder(torch.utils.data.Sampler):
    """The indices 0 to `size` - 1 in order, with no `__len__`."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.size))


def refused_calls(rank: int) -> dict:
    """What a pipeline refuses when it is called, each on every rank: batches that differ between the stages (with
    check_inputs=True), in training and evaluation; resize_token_embeddings; forward_backward of a compiled model."""
    refused: dict[str, Any] = {}
    model = autotp.wrap(tiny_model("llama"), 1, pp_size=2, check_inputs=True)
    inputs = pp_batch(seed=1 + rank)  # each stage its own batch
    for call in ("forward_backward", "evaluate"):
        try:
            if call == "forward_backward":
                autotp.forward_backward(model, **inputs)
            else:
                with torch.no_grad():
                    model(**inputs)
        except RuntimeError as err:
            refused[call] = (str(err), all(p.grad is None for p in model.parameters()))
    model = autotp.wrap(tiny_model("llama"), 1, pp_size=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    try:
        model.resize_token_embeddings(300)
    except NotImplementedError as err:
        unchanged = model.get_input_embeddings() is embedding and model.get_output_embeddings() is head
        unchanged &= model.config.vocab_size == 256 and before.keys() == dict(model.named_parameters()).keys()
        unchanged &= all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        refused["resize"] = (str(err), unchanged)
    try:
        autotp.forward_backward(torch.compile(model), **pp_batch())
    except NotImplementedError as err:
        refused["compile"] = (str(err), all(p.grad is None for p in model.parameters()))
    return refused


def pp2_edges(rank: int, world: int, path: str) -> dict:
    """Every 2-rank case of tests/pp/test_pp_edges.py in one spawn; the ranks that disagree on pp_size last (rank 1
    wraps alone at pp 1 and leaves)."""
    report: dict[str, Any] = {"bf16": bf16_parity(rank, world, 1, 2, dict(pp_microbatches=2))}
    report["frozen"] = {case: frozen_stage(rank, world, case) for case in ("frozen", "lora")}
    reference, model = tiny_model("llama"), autotp.wrap(tiny_model("llama"), 1, pp_size=2)
    with torch.no_grad():
        got, want = model(**pp_batch(), return_dict=False), reference(**pp_batch(), return_dict=False)
    report["tuple"] = (type(got).__name__, len(got), *((a - b).abs().max().item() for a, b in zip(got, want)))
    report["trainer"] = trainer_cases(path)
    report["refused"] = refused_calls(rank)
    report["opt"] = pp_parity(rank, world, "opt", 1, 2, dict(pp_microbatches=2))
    torch.manual_seed(0)
    llama4 = tf.AutoModelForCausalLM.from_config(tiny_config("llama4"))  # Llama4ForCausalLM
    ids, labels, inputs = parity.training_inputs(llama4, batch=2, seq=16, seed=1)
    report["llama4"] = parity.compare_training(llama4, ids, 1, labels=labels, inputs=inputs, pp_size=2)
    try:
        autotp.wrap(tiny_model("llama"), 1, pp_size=2 if rank == 0 else 1, timeout=20)
        report["pp_size"] = "wrapped"
    except RuntimeError as err:
        report["pp_size"] = str(err)
    return report


def pp4_edges(rank: int, world: int) -> dict:
    """The 4-rank cases of tests/pp/test_pp_edges.py in one spawn: bf16 at pp 2 x tp 2, at pp 2 x dp 2 (each DP
    replica's half of the batch holding as many labels as the other), at pp 4 and under Interleaved1F1B at pp 2 x dp 2, and at pp 2 x tp 2 with sequence parallelism
    a sequence that does not split over TP, refused on every rank before the schedule."""
    report: dict[str, Any] = {
        "tp": bf16_parity(rank, world, 2, 2, dict(pp_microbatches=2)),
        "dp": bf16_parity(rank, world, 1, 2, dict(pp_microbatches=2, pads=(0, 6, 3, 3))),
        "pp4": bf16_parity(rank, world, 1, 4, dict(pp_microbatches=4, layers=4)),
        "interleaved dp": bf16_parity(
            rank, world, 1, 2, dict(pp_schedule="Interleaved1F1B", pp_microbatches=2, layers=4, pads=(0, 6, 3, 3))
        ),
    }
    model = autotp.wrap(tiny_model("llama"), 2, pp_size=2, sequence_parallel=True)
    inputs = pp_batch(seq=15, pads=(0, 0, 0, 0))
    try:
        autotp.forward_backward(model, **inputs)
    except ValueError as err:
        report["sp"] = (str(err), all(p.grad is None for p in model.parameters()))
    autotp.forward_backward(model, **pp_batch(seq=16))  # the ranks go on together
    return report
