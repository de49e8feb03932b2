"""The default chunked loss (`loss_chunk=512`) walked through docs' edge rows (held-out probing, issue 49's ring), at
tp 1 in the test process and tp 2 in one `run_ranks` spawn, each case against one process set up as a user would
(plain transformers, same seed, same calls): bf16 autocast and bf16 / fp16 parameters, Gemma 2's softcap on a bf16
head; batch 1, one token, sequence parallelism on a sequence TP does not divide; a frozen head, a frozen body, tied
embeddings; `.logits` read after backward, a tuple output with labels; a forward hook on the head registered before
wrap; activation checkpointing (reentrant or not); gradient accumulation with `num_items_in_batch`; PEFT's LoRA put on
before wrap, on the attention and on the head.

fp32 tolerances are `autotp.testing.parity`'s (chunks and shards only reorder sums). Half precision: one process in
that dtype against its own fp32 run gives a yardstick d per metric; the wrapped run must be within 3 d of one process
in the same dtype (both round at the same places; chunks and shards reorder bf16 sums, each reordering of the size
that separates the dtype from fp32; see tests/pp/test_pp_edges.py's docstring for the 3).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, labels_with_ignored, tiny_model

IDS = batch(vocab=256, size=(2, 15))
LABELS = labels_with_ignored(IDS)
HALF_FACTOR = 3  # see the module's docstring
CHUNK = 4  # several chunks per row at these tiny batches (the default 512 would be one chunk)


def message(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def gathered(model: torch.nn.Module, tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    return parity.full_tensor(tensor, param, autotp.tp_group(model)).float()


def grad_errors(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
    """Each trained parameter's gradient error against one process's (names as the reference names them); a parameter
    with a gradient on one side only is infinitely wrong."""
    want = dict(reference.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        theirs = want[name].grad
        if p.grad is None or theirs is None:
            out[name] = 0.0 if p.grad is None and theirs is None else float("inf")
            continue
        out[name] = parity.grad_error(gathered(model, p.grad, p), theirs.float())
    return out


def step_pair(
    world: int,
    build: Callable[[], torch.nn.Module],
    run: Callable[[torch.nn.Module], Any],
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    **options: Any,
) -> dict:
    """`run` (forward and backward, returning the output) on one process's `build()` and on the wrapped one: the
    loss's difference and the worst gradient error, and the logits' difference where the output has them."""
    reference = build()
    model = (wrap or (lambda m: autotp.wrap(m, world, **options)))(build())
    expected, got = run(reference), run(model)
    report: dict[str, Any] = {
        "loss": abs(float(loss_of(got)) - float(loss_of(expected))),
        "grad": max(grad_errors(model, reference).values()),
    }
    logits = logits_of(got), logits_of(expected)
    if logits[0] is not None:
        report["logits"] = (logits[0].float() - logits[1].float()).abs().max().item()
    return report


def loss_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.loss


def logits_of(output: Any) -> torch.Tensor | None:
    return output[1] if isinstance(output, tuple) else getattr(output, "_read_logits", None)


def llama(**config: Any) -> Callable[[], torch.nn.Module]:
    return lambda: tiny_model("llama", **config).train()


def forward_backward(**extra: Any) -> Callable[[torch.nn.Module], Any]:
    """A forward with labels (`ids`, `labels` or the module's, and `extra`) and its loss's backward."""
    return lambda m: run_with(m, dict(extra))


def run_with(m: torch.nn.Module, extra: dict) -> Any:
    ids, labels = extra.pop("ids", IDS), extra.pop("labels", LABELS)
    out = m(input_ids=ids, labels=labels, **extra)
    loss_of(out).backward()
    return out


def half(world: int, family: str, dtype: torch.dtype | None, autocast: bool = False) -> dict:
    """3 SGD steps of one process in fp32 and in `dtype` (parameters, or fp32 parameters under CPU autocast to it) and of
    the wrapped run: per metric (yardstick, error) as the module's docstring says."""
    fp32 = tiny_model(family).train()
    low = copy.deepcopy(fp32) if autocast else copy.deepcopy(fp32).to(dtype)
    runs = {"fp32": fp32, "low": low, "wrapped": autotp.wrap(copy.deepcopy(low), world, loss_chunk=CHUNK)}
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in runs.items()}  # fp16 AdamW: NaN
    for step in range(3):
        ids = batch(size=(2, 15), seed=step + 1)
        for name, m in runs.items():
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast and name != "fp32"):
                loss = m(input_ids=ids, labels=labels_with_ignored(ids)).loss
            loss.backward()
            losses[name].append(loss.detach().float())
            optimizers[name].step()
            optimizers[name].zero_grad()
    model, params = runs["wrapped"], {name: dict(runs[name].named_parameters()) for name in ("fp32", "low")}
    param = [
        (
            (params["fp32"][n].detach() - params["low"][n].float()).abs().max().item(),
            (gathered(model, p.detach(), p) - params["low"][n].float()).abs().max().item(),
        )
        for n, p in model.named_parameters()
    ]
    loss = [torch.stack(losses[name]) for name in runs]
    return {
        "loss": ((loss[0] - loss[1]).abs().max().item(), (loss[2] - loss[1]).abs().max().item()),
        "param": (max(y for y, _ in param), max(e for _, e in param)),
        "finite": all(torch.isfinite(x).all() for x in loss[2]),
    }


def frozen(names: tuple[str, ...]) -> Callable[[], torch.nn.Module]:
    """A llama whose parameters starting with one of `names` do not train (set before wrap, as a user does)."""

    def build() -> torch.nn.Module:
        model = tiny_model("llama").train()
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(names))
        return model

    return build


def tied() -> torch.nn.Module:
    model = tiny_model("llama", tie_word_embeddings=True).train()
    model.tie_weights()
    return model


def read_after_backward(m: torch.nn.Module) -> Any:
    """`output.logits` first read after the backward, before any step."""
    out = m(input_ids=IDS, labels=LABELS)
    out.loss.backward()
    out._read_logits = out.logits.detach()
    return out


def hooked(world: int) -> dict | tuple[str, bool]:
    """A forward hook on the head, registered before wrap, recording the mean logit of each call (a user's probe):
    at tp 1 it sees the logits one process's sees; where wrap replaces the head (tp 2), refused by name, the model
    left as it was."""
    seen: dict[str, list[float]] = {"reference": [], "wrapped": []}

    def build(name: str) -> torch.nn.Module:
        model = tiny_model("llama").train()
        model.lm_head.register_forward_hook(lambda mod, args, out: seen[name].append(out.float().mean().item()))
        return model

    reference, model = build("reference"), build("wrapped")
    head = model.lm_head
    try:
        autotp.wrap(model, world, loss_chunk=CHUNK)
    except ValueError as error:
        return message(error), model.lm_head is head and not hasattr(model, "autotp_state")
    for m in (reference, model):
        m(input_ids=IDS, labels=LABELS).loss.backward()
    return {"grad": max(grad_errors(model, reference).values()), "seen": seen}


def checkpointing(reentrant: bool) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        model = tiny_model("llama").train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model

    return build


def accumulate(m: torch.nn.Module) -> Any:
    """Gradient accumulation over the batch's two rows, each loss divided by the whole batch's label count
    (`num_items_in_batch`, as transformers' Trainer passes it)."""
    count = torch.tensor(int((LABELS[:, 1:] != -100).sum()))
    total = 0.0
    for row in range(2):
        loss = m(input_ids=IDS[row : row + 1], labels=LABELS[row : row + 1], num_items_in_batch=count).loss
        loss.backward()
        total += loss.item()
    return Loss(torch.tensor(total))


class Loss:
    """An output holding only a loss."""

    def __init__(self, loss: torch.Tensor):
        self.loss = loss


def lora_pair(world: int, targets: list[str]) -> dict:
    """PEFT's LoRA put on before wrap (`wrap(model.base_model.model)`), the same adapter values as one process's."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return get_peft_model(tiny_model("llama").train(), config)

    reference, model = build(), build()
    autotp.wrap(model.base_model.model, world, loss_chunk=CHUNK)
    expected, got = run_with(reference, {}), run_with(model, {})
    return {"loss": abs(got.loss.item() - expected.loss.item()), "grad": max(grad_errors(model, reference).values())}


def one_token(world: int) -> dict:
    """A batch of one token a row: no label after the shift. NaN losses and all-zero gradients, as one process's."""
    reference, model = tiny_model("llama").train(), autotp.wrap(tiny_model("llama").train(), world, loss_chunk=CHUNK)
    losses, nonzero = [], []
    for m in (reference, model):
        loss = m(input_ids=IDS[:, :1], labels=IDS[:, :1]).loss
        loss.backward()
        losses.append(loss.item())
        nonzero.append(sum(int((p.grad != 0).sum()) for p in m.parameters()))
    return {"losses": losses, "nonzero gradients": nonzero}


def sp_odd(world: int) -> str:
    """Sequence parallelism on a 15-token sequence at tp 2: refused by name, or the loss's and gradients' error."""
    reference, model = (
        tiny_model("llama").train(),
        autotp.wrap(tiny_model("llama").train(), world, sequence_parallel=True),
    )
    try:
        out = model(input_ids=IDS, labels=LABELS)
        out.loss.backward()
    except (ValueError, RuntimeError) as error:
        return message(error)
    expected = reference(input_ids=IDS, labels=LABELS)
    expected.loss.backward()
    return f"ran: loss {abs(out.loss.item() - expected.loss.item())}"


def id_out_of_range(world: int) -> str:
    """A token id past the vocabulary: one process's embedding raises IndexError; the vocab-parallel one (whose every
    rank masks it) must raise too, not look up zeros and train."""
    model = autotp.wrap(tiny_model("llama").train(), world)
    ids = IDS.clone()
    ids[0, 3] = model.config.vocab_size + 5
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except (IndexError, RuntimeError) as error:
        return message(error)
    return "ran"


def ring(rank: int, world: int) -> dict:
    """Every case at tp=`world`."""
    chunked = dict(loss_chunk=CHUNK)
    report: dict[str, Any] = {
        "autocast bf16": half(world, "llama", torch.bfloat16, autocast=True),
        "bf16 parameters": half(world, "llama", torch.bfloat16),
        "fp16 parameters": half(world, "llama", torch.float16),
        "gemma2 bf16": half(world, "gemma2", torch.bfloat16),
        "batch 1": step_pair(world, llama(), forward_backward(ids=IDS[:1], labels=LABELS[:1]), **chunked),
        "seq 1": one_token(world),
        "seq 2": step_pair(world, llama(), forward_backward(ids=IDS[:, :2], labels=IDS[:, :2]), **chunked),
        "frozen head": step_pair(world, frozen(("lm_head",)), forward_backward(), **chunked),
        "frozen body": step_pair(world, frozen(("model.",)), forward_backward(), **chunked),
        "tied": step_pair(world, tied, forward_backward(), **chunked),
        "read after backward": step_pair(world, llama(), read_after_backward, **chunked),
        "tuple": step_pair(world, llama(), forward_backward(return_dict=False), **chunked),
        "hook before wrap": hooked(world),
        "checkpointing reentrant": step_pair(world, checkpointing(True), forward_backward(), **chunked),
        "checkpointing": step_pair(world, checkpointing(False), forward_backward(), **chunked),
        "accumulation": step_pair(world, llama(), accumulate, **chunked),
        "lora attention": lora_pair(world, ["q_proj", "v_proj"]),
        "lora head": lora_pair(world, ["q_proj", "lm_head"]),
    }
    if world > 1:
        report["sp odd"] = sp_odd(world)
        report["id out of range"] = id_out_of_range(world)
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return [ring(0, 1), *run_ranks(ring, 2)]


def test_half_precision_and_autocast_are_one_process_within_the_dtypes_noise(reports: list[dict]) -> None:
    """bf16 autocast around the forward (the head then computes whole logits), bf16 and fp16 parameters, Gemma 2's
    softcap on a bf16 head: 3 SGD steps' losses and parameters."""
    for report in reports:
        for case in ("autocast bf16", "bf16 parameters", "fp16 parameters", "gemma2 bf16"):
            assert report[case]["finite"], (case, report[case])
            for metric in ("loss", "param"):
                yardstick, error = report[case][metric]
                assert 0 < yardstick and error <= HALF_FACTOR * yardstick, (case, metric, report[case])


PARITY_CASES = (
    "batch 1",
    "seq 2",
    "frozen head",
    "frozen body",
    "tied",
    "read after backward",
    "tuple",
    "checkpointing reentrant",
    "checkpointing",
    "accumulation",
    "lora attention",
    "lora head",
)


def test_each_case_is_one_process_in_fp32(reports: list[dict]) -> None:
    for report in reports:
        for case in PARITY_CASES:
            result = report[case]
            assert result["loss"] <= parity.LOSS_ATOL and result["grad"] <= parity.GRAD_RTOL, (case, result)
            assert result.get("logits", 0.0) <= 1e-5, (case, result)  # fp32, the order of sums only


def test_one_token_a_row_gives_nan_and_zero_gradients_as_one_process(reports: list[dict]) -> None:
    for report in reports:
        losses, nonzero = report["seq 1"]["losses"], report["seq 1"]["nonzero gradients"]
        assert all(loss != loss for loss in losses) and nonzero == [0, 0], report["seq 1"]


def test_a_hook_on_the_head_sees_one_process_logits_at_tp1_and_is_refused_where_wrap_replaces_the_head(
    reports: list[dict],
) -> None:
    """Before, at tp 2 a hook registered on the head (or any split linear) before wrap silently never ran again:
    wrap puts a new module there."""
    one = reports[0]["hook before wrap"]
    assert one["grad"] <= parity.GRAD_RTOL and one["seen"]["wrapped"] == one["seen"]["reference"], one
    for report in reports[1:]:
        error, untouched = report["hook before wrap"]
        assert "lm_head (Linear) has 1 forward hook registered before wrap" in error and untouched, error
        assert "register it after wrap" in error and "Nothing was changed" in error, error


def test_sequence_parallel_on_a_sequence_tp_does_not_divide_is_refused_by_name(reports: list[dict]) -> None:
    for report in reports[1:]:
        assert "sequence_parallel needs the sequence length (15) to be a multiple of tp_size=2" in report["sp odd"]
        assert "pad_to_multiple_of=2" in report["sp odd"], report["sp odd"]


def test_a_token_id_past_the_vocabulary_raises_under_vocab_parallelism_as_one_process_raises(
    reports: list[dict],
) -> None:
    for report in reports[1:]:
        assert "a token id outside the vocabulary of 256 rows" in report["id out of range"], report["id out of range"]
