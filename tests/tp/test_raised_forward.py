"""A forward that raises inside the model (an out-of-memory error in a late layer) leaves nothing of its step behind.

accelerate's `find_executable_batch_size` (and the GPU benchmark) retry a step that ran out of memory with a smaller
batch: the retry must find none of the failed step's activations still held (a block entry kept its input, and the
graph behind it, when its block raised) and must train as one process retrying the same way does. Memory is checked
deterministically: weak references to the failed try's decoder-layer outputs are dead once it has unwound, and no
tensor the failed try made is held by autotp's objects on the model (`held_by_autotp`). Losses at LOSS_ATOL, gradients
at GRAD_RTOL (fp32, only the order of sums differs: `autotp.testing.parity`).
"""

from __future__ import annotations

import copy
import gc
import time
import weakref

import torch
import torch.distributed as dist
from accelerate.utils import find_executable_batch_size
from peft import LoraConfig, get_peft_model
from torch import nn

import autotp
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, full_tensor, grad_error
from autotp.testing.spawn import run_ranks
from models import GPT2_DROPOUT, OUT_OF_MEMORY, FailOnce, batch, held_by_autotp, tiny_model

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], lora_dropout=0.0)
# tp, LoRA, a deep copy of the wrapped model, where the first try raises: inside the last decoder layer's MLP, or in
# the LM head's or the embedding's forward (after its own computation, before autotp's hooks after it: a hook of the
# user's there), the head computing whole logits (loss_chunk=None; the chunked loss's head returns a stand-in)
CASES = [
    (1, False, False, "mlp"),
    (1, True, False, "mlp"),
    (2, False, False, "mlp"),
    (2, True, False, "mlp"),
    (2, False, True, "mlp"),
    (2, False, False, "head"),
    (2, False, False, "embedding"),
]
RETURNED = {"mlp": 1, "head": 2, "embedding": 0}  # decoder layers that return in the failed try, by where it raises


def build(tp: int | None, lora: bool, copied: bool, reference: nn.Module | None = None, **options) -> nn.Module:
    """The tiny Llama, wrapped at `tp` (None: one process) with `options`, deep-copied as an EMA or reference model is,
    under LoRA with `reference`'s adapter values."""
    model = tiny_model("llama")
    if tp is not None:
        model = autotp.wrap(model, tp, **options)
    if copied:
        model = copy.deepcopy(model)
    if not lora:
        return model
    model = get_peft_model(model, LoraConfig(**LORA, init_lora_weights=False))
    if reference is not None:  # PEFT draws the adapters at local shapes under TP: give them one process's values
        with torch.no_grad():
            model(input_ids=batch())  # each block adapts its LoRA layers on its first run
            full = dict(reference.named_parameters())
            for name, param in model.named_parameters():
                if "lora_" in name:
                    shard = getattr(param, "autotp_shard", None)
                    param.copy_(full[name] if shard is None else shard.partition.shard(full[name], shard.rank))
    return model


def held_after_unwinding(failed: list[weakref.ref]) -> int:
    """How many of the failed try's decoder-layer outputs are still alive once it has unwound. A gloo worker thread
    drops its reference to a collective's tensors just after the waiting rank resumes (on a loaded machine, a moment
    later): a tensor only it holds is released within the second given here; a leak is held for good."""
    deadline = time.monotonic() + 2.0
    while True:
        gc.collect()
        held = sum(ref() is not None for ref in failed)
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.01)


def retried_steps(model: nn.Module, group: dist.ProcessGroup | None, where: str) -> dict:
    """Two AdamW steps through `find_executable_batch_size`: its first try (4 rows) raises at `where`, its retry
    (2 rows) trains. What the retry finds held of the failed try, and what it trains."""
    inner = model.base_model.model if hasattr(model, "peft_config") else model
    fault, failed, before = FailOnce(), [], held_by_autotp(model)
    if where == "mlp":
        inner.model.layers[-1].mlp.act_fn.register_forward_hook(fault)
    else:
        edge = inner.get_output_embeddings() if where == "head" else inner.get_input_embeddings()
        edge.register_forward_hook(fault, prepend=True)

    def keep(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
        if fault.armed:
            failed.append(weakref.ref(output if torch.is_tensor(output) else output[0]))

    for layer in inner.model.layers:  # those that return in the failed try
        layer.register_forward_hook(keep)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = batch(size=(4, 16))

    @find_executable_batch_size(starting_batch_size=4, reduce_batch_size_fn=lambda: 2)
    def train(rows: int) -> dict:
        report = {"rows": rows, "held": held_after_unwinding(failed), "losses": [], "grads": {}}
        report["kept"] = sorted(path for key, path in held_by_autotp(model).items() if key not in before)
        if not fault.armed:  # after the raise, the LM head called alone (RL code's log-probabilities) gives logits
            with torch.no_grad():
                report["head"] = type(inner.get_output_embeddings()(torch.randn(2, 3, 64))).__name__
        for step in range(2):
            loss = model(input_ids=ids[:rows], labels=ids[:rows]).loss
            loss.backward()
            if step == 0:
                report["grads"] = {
                    n: full_tensor(p.grad, p, group) for n, p in model.named_parameters() if p.requires_grad
                }
            optimizer.step()
            optimizer.zero_grad()
            report["losses"].append(loss.item())
        return report

    report = train()
    report["failed"] = len(failed)
    return report


def dropout_after_a_raise(rank: int, world: int) -> list[bool]:
    """GPT-2 with dropout at tp=world: a forward raising inside a block's TP span (after its column layer drew under
    the rank's seed), then a training step: whether each block's output (replicated) is the same on every rank."""
    torch.manual_seed(1000 + rank)  # wrap aligns the ranks' shared stream
    model = autotp.wrap(tiny_model("gpt2", **GPT2_DROPOUT), world)
    model.train()
    model.transformer.h[-1].mlp.act.register_forward_hook(FailOnce())
    ids = batch()
    try:
        model(input_ids=ids, labels=ids)
    except RuntimeError as err:
        assert OUT_OF_MEMORY in str(err)
    captured: list[torch.Tensor] = []
    for block in model.transformer.h:
        block.register_forward_hook(
            lambda m, a, out: captured.append((out[0] if isinstance(out, tuple) else out).detach())
        )
    model(input_ids=ids, labels=ids).loss.backward()
    same = []
    for tensor in captured:
        everyone = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(everyone, tensor.contiguous())
        same.append(all(torch.equal(everyone[0], t) for t in everyone))
    return same


def retries(rank: int, world: int) -> dict:
    """Each case of `CASES` (its tp at most `world`) beside one process (plain, or PEFT) retrying alike; GPT-2's
    replicated streams after a raise."""
    gc.freeze()  # the imported modules' objects: each gc.collect (accelerate's, the check's) then takes milliseconds
    expected, reports = {}, {}
    for tp, lora, copied, where in CASES:
        if (lora, where) not in expected:
            expected[(lora, where)] = retried_steps(build(None, lora, False), None, where)
        reference = build(None, lora, False) if lora else None
        model = build(tp, lora, copied, reference, loss_chunk=None if where == "head" else 512)
        inner = model.base_model.model if lora else model
        reports[(tp, lora, copied, where)] = retried_steps(model, autotp.tp_group(inner), where)
    return {"expected": expected, "reports": reports, "dropout": dropout_after_a_raise(rank, world)}


def test_a_step_retried_after_a_raise_holds_nothing_of_it_and_trains_as_one_process() -> None:
    """tp 1 and 2, with and without LoRA, a deep copy of the wrapped model (a reference model), a raise in the LM head:
    the retry holds none of the failed try's activations (a block entry kept its input after its block raised, and
    with it the whole step's graph; a deep copy's layers kept theirs after every forward), its LM head called alone is
    not left armed for the chunked loss, and both steps match one process."""
    for result in run_ranks(retries, 2):
        for (tp, lora, copied, where), report in result["reports"].items():
            case = f"tp={tp} lora={lora} copy={copied} raised in {where}"
            expected = result["expected"][(lora, where)]
            assert report["failed"] == expected["failed"] == RETURNED[where], (case, report["failed"])
            assert report["rows"] == expected["rows"] == 2, case
            assert report["held"] == expected["held"] == 0, (case, "decoder-layer outputs of the failed try held")
            assert report["kept"] == [], (case, "tensors of the failed try held by autotp", report["kept"])
            assert report["head"] == expected["head"] == "Tensor", (case, report["head"])
            worst = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"]))
            assert worst <= LOSS_ATOL, (case, report["losses"], expected["losses"])
            errors = {n: grad_error(g, expected["grads"][n]) for n, g in report["grads"].items()}
            assert errors.keys() == expected["grads"].keys(), case
            assert max(errors.values()) <= GRAD_RTOL, (case, max(errors.items(), key=lambda kv: kv[1]))
        # the block's seed was left on after the raise: the next step's replicated dropout drew apart on each rank
        assert result["dropout"] == [True, True], result["dropout"]
