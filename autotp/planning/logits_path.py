"""Whether a model's logits reach its loss and its output elementwise along the vocabulary, checked by emulation.

Vocab parallelism hands `self.loss_function` (replaced by the sharded cross-entropy) and the returned `logits` (gathered)
what the model computes from its LM head's output when the head holds one rank's rows only. That is exact when every
step between the head and them acts on each vocabulary entry alone: a scale, a softcap, a cast, a slice of positions.
A softmax, a log-sum-exp, an argmax, a slice of the vocabulary (`[..., :n]`) or an index into it mixes entries or
moves them, and on a shard computes something else. A shipped policy's family was read by hand; for any other model
(structural detection, transformers' plan) this module runs it: once whole, then once per rank with a forward hook on
the head that keeps only that rank's vocabulary slice of its output, recording the logits each call of
`self.loss_function` gets and the logits the model returns. Each must be the whole run's, sliced the same way.

A model on the meta device is checked on its structural twin (`autotp.planning.twin`): the same classes and forward
code, narrower, with a vocabulary of its own, split across the ranks as the model's is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from .probe import probe_inputs
from .sharding import Partition


def logits_path_refusal(
    model: nn.Module, tp_size: int, twin: Callable[[], nn.Module | None], example: Mapping[str, Any] | None = None
) -> str:
    """Why the LM head's output does not reach the loss and the returned logits elementwise along the vocabulary at
    `tp_size`, or the empty string when it does. `twin` builds the structural twin a meta-device model is checked on; `example` is the
    user's `example_inputs=` (forward keyword arguments), else probe inputs are used."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        return _checked(model, tp_size, example)
    with torch.device("cpu"):  # the caller may have made meta the default device
        subject = twin()
        if subject is None:
            return "the model is on the meta device and no structural twin of it could be built to check its logits"
        return _checked(subject, tp_size, None)  # the twin has a vocabulary of its own: probe inputs in it


def _checked(subject: nn.Module, tp_size: int, example: Mapping[str, Any] | None) -> str:
    """`logits_path_refusal` of a model that runs; its modules' train/eval modes are restored."""
    head = subject.get_output_embeddings()
    modes = {m: m.training for m in subject.modules()}
    subject.eval()  # dropout would make the runs differ
    try:
        return _check(subject, head, tp_size, _inputs(subject, example))
    finally:
        for module, training in modes.items():
            module.training = training


@dataclass
class _Seen:
    """What one forward gave: the logits of each `loss_function` call, and the logits it returned."""

    losses: list[torch.Tensor] = field(default_factory=list)
    logits: torch.Tensor | None = None


def _inputs(model: nn.Module, example: Mapping[str, Any] | None) -> dict[str, Any]:
    """Forward keywords with labels: the example's (its own labels, else its token ids), or probe inputs."""
    if example is None:
        inputs: dict[str, Any] = probe_inputs(model)
    else:
        device = next(model.parameters()).device
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in example.items()}
    if inputs.get("labels") is None and inputs.get("input_ids") is not None:
        inputs["labels"] = inputs["input_ids"]
    return inputs


def _check(model: nn.Module, head: nn.Module, tp_size: int, inputs: dict[str, Any]) -> str:
    if inputs.get("labels") is None:
        return "no token ids to check its loss's logits with (pass example_inputs with labels)"
    base = model.base_model
    backbone: list[Any] = []
    handle = base.register_forward_hook(lambda module, args, output: backbone.append(output))
    try:
        whole = _run(model, head, inputs, None)
    except Exception as err:  # nothing proven: the head stays whole
        return f"the forward that checks its logits' path failed ({_what(err)})"
    finally:
        handle.remove()
    rows = head.weight.shape[0]
    if not whole.losses:
        return "its forward given labels never called self.loss_function (the loss is computed some other way)"
    wide = [t.shape[-1] for t in [*whole.losses, whole.logits] if t is not None and t.shape[-1] != rows]
    if wide:
        return f"logits {wide[0]} wide reach its loss or output from an LM head of {rows} rows (a vocabulary slice)"
    partition = Partition.even(0, rows, tp_size)
    for rank in range(tp_size):
        ((start, count),) = partition.runs[rank]
        cut = slice(start, start + count)
        try:
            with _replayed(model, base, backbone):
                shard = _run(model, head, inputs, cut)
        except Exception as err:
            return f"its forward fails on rank {rank}'s vocabulary slice of the LM head's output ({_what(err)})"
        if len(shard.losses) != len(whole.losses):
            return f"on rank {rank}'s vocabulary slice it calls self.loss_function {len(shard.losses)} times, not once"
        pairs = [(got, want, "the logits given to self.loss_function") for got, want in zip(shard.losses, whole.losses)]
        if whole.logits is not None:
            pairs.append((shard.logits, whole.logits, "the logits it returns"))
        for got, want, what in pairs:
            why = _differs(got, want[..., cut], what)
            if why:
                return f"{why} on rank {rank}'s vocabulary slice of the LM head: they are not elementwise along it"
    return ""


@contextmanager
def _replayed(model: nn.Module, base: nn.Module, outputs: list[Any]) -> Iterator[None]:
    """The backbone returning what it returned in the whole run, without running (a rank's run then costs the
    head and what follows it): where the model has a backbone of its own that ran once."""
    own = vars(base).get("forward")
    if base is model or len(outputs) != 1:
        yield
        return
    base.forward = lambda *args, **kwargs: outputs[0]
    try:
        yield
    finally:
        if own is None:
            del base.forward
        else:
            base.forward = own


def _run(model: nn.Module, head: nn.Module, inputs: dict[str, Any], cut: slice | None) -> _Seen:
    """One forward with `self.loss_function` recorded (it returns a stand-in scalar) and, given `cut`, the head's
    output cut to those vocabulary rows."""
    seen = _Seen()

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = kwargs["logits"] if "logits" in kwargs else args[0]
        seen.losses.append(logits.detach().clone())
        return logits.float().mean()

    before = model.loss_function
    handle = head.register_forward_hook(lambda module, args, output: output if cut is None else output[..., cut])
    model.loss_function = record
    try:
        with torch.no_grad():
            try:
                output = model(**inputs, use_cache=False)
            except TypeError:
                output = model(**inputs)
    finally:
        model.loss_function = before
        handle.remove()
    logits = getattr(output, "logits", None)
    seen.logits = logits if torch.is_tensor(logits) else None
    return seen


def _differs(got: torch.Tensor | None, want: torch.Tensor, what: str) -> str:
    """Why `got` (from a rank's slice) is not `want` (the whole run's, sliced), or "".

    Both come from the same head output through the same elementwise steps, so they agree to rounding: a vectorised
    kernel may round an entry an ulp or so differently from a scalar loop (8 ulps of the entry allowed, and one ulp of
    the largest entry for entries near 0). A step that mixes the vocabulary moves entries by O(1) of their scale
    (a log-softmax over a slice of 1/tp of the vocabulary shifts every entry by about log(tp))."""
    if got is None or got.shape != want.shape:
        return f"{what} have shape {None if got is None else tuple(got.shape)}, not {tuple(want.shape)},"
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    got, want = got.double(), want.double()
    finite = want[want.isfinite()]
    scale = (finite.abs().max().item() if finite.numel() else 0.0) or 1.0
    close = (got - want).abs() <= 8 * eps * want.abs() + eps * scale
    if not (close | (got == want)).all():  # equal: infinities (a mask) too
        return f"{what} differ by {(got - want).abs().max().item():.3g} (scale {scale:.3g})"
    return ""


def _what(err: Exception) -> str:
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0][:120]}" if lines else type(err).__name__
