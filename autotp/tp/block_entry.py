"""`BlockEntry`: where a block's input enters the TP span, once for every column layer reading it.

q/k/v (or gate/up) all read the block input; summing their input gradients locally and then
all-reducing once is what keeps a block at one backward all-reduce. The entry also carries what the
block's other mechanics need from that one point, each behind a method:
- overlap: the readers' weight gradients are computed during the input gradient's all-reduce;
- LoRA: replicated adapter weights `join` the input, their partial gradients summed in the same all-reduce;
- sequence parallelism: the gathered input is saved once, as this rank's chunk (`saved_chunk`);
- `autotp.tp.glu`: the readers' outputs are recorded until the block's forward ends.
Its options are fixed when `apply_plan` builds it. The owning block clears it after each call, one that raised
included (a hook with `always_call`), so no activation outlives the forward: a step retried after an out-of-memory
error would otherwise find the failed step's activations still held.
"""

from __future__ import annotations

import torch
from torch import nn

from ..mesh import Group, group_size
from ..runtime.collectives import copy_to_tp
from ..runtime.seq_collectives import SavedChunk
from .overlap import DeferredWeights, copy_to_tp_joined, deferred_column_linear


class BlockEntry:
    """The shared entry of the column layers reading one block input (see the module docstring).

    Its readers are `autotp.tp.layers.LinearLayer`s (typed `nn.Linear` here: layers imports this module).
    """

    def __init__(self, group: Group, *, overlap: bool = True, sequence_parallel: bool = False):
        self.group = group
        self.overlap = overlap  # weight gradients computed during the input gradient's all-reduce (wrap(overlap=...))
        self.sequence_parallel = sequence_parallel  # readers keep only their sequence chunk (autotp.sp.sequence)
        self._joining: list[nn.Parameter] = []  # replicated LoRA weights of the layers reading it
        self._readers: list[nn.Linear] = []  # the column layers reading it, for overlap
        self._source: torch.Tensor | None = None
        self._copy: torch.Tensor | None = None
        self._joined: dict[int, torch.Tensor] = {}
        self._deferred: dict[int, tuple[torch.Tensor, int]] = {}
        self._pending: DeferredWeights | None = None
        self._saved: SavedChunk | None = None
        self._outputs: dict[int, torch.Tensor] = {}  # the readers' outputs in this call, by autograd node (glu)

    def add_reader(self, layer: nn.Linear) -> None:
        self._readers.append(layer)

    def fresh(self, reader: nn.Linear) -> BlockEntry:
        """An entry with the same options for `reader` alone (a copied layer reads its input by itself)."""
        entry = BlockEntry(self.group, overlap=self.overlap, sequence_parallel=self.sequence_parallel)
        entry.add_reader(reader)
        return entry

    def join(self, weight: nn.Parameter) -> None:
        """`weight` (replicated, its gradient partial on each rank) enters with the input from the next call on."""
        self._joining.append(weight)

    def unjoin(self, weights: list[nn.Parameter]) -> None:
        """`weights` no longer enter with the input (their LoRA layer was unloaded)."""
        self._joining[:] = [w for w in self._joining if all(w is not other for other in weights)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` entered into the TP span: the same tensor for every reader of the same `x` in this call."""
        if x is self._copy:  # already inside (a LoRA wrapper entered for its base layer and adapter)
            return x
        if x is not self._source:
            grads = torch.is_grad_enabled()
            weights = [w for w in self._joining if w.requires_grad] if grads else []
            readers = (
                # a float8 layer's backward is torchao's (autotp.tp.float8): its weight gradient is not deferred
                [r for r in self._readers if r.weight.requires_grad and getattr(r, "float8", None) is None]
                if (grads and self.overlap and not torch.compiler.is_compiling())
                else []
            )
            entered, self._pending = copy_to_tp_joined(
                x, weights, self.group, [r.weight for r in readers], [r.transposed for r in readers]
            )
            self._source, self._copy = x, entered[0]
            self._clear_after_backward(x)
            self._joined = {id(w): view for w, view in zip(weights, entered[1:])}
            self._deferred = (
                {}
                if self._pending is None
                else {  # tp 1: nothing to overlap
                    id(r.weight): (view, i) for i, (r, view) in enumerate(zip(readers, entered[1 + len(weights) :]))
                }
            )
        return self._copy

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """`layer`'s matmul on the input entered last (`x`), its weight gradient deferred to the entry if it entered."""
        # no lookup when nothing was deferred (tp 1, under compile): id() of a weight would make torch.compile guard
        # on that weight object, and recompile for every block of a per-block compiled model
        deferred = self._deferred.get(id(layer.weight)) if self._deferred and x is self._copy else None
        if deferred is None:
            return layer.local_linear(x, layer.bias)
        view, index = deferred
        assert self._pending is not None  # always: _deferred is filled only with a pending set, and cleared with it
        return deferred_column_linear(x, view, layer.bias, self._pending, index)

    def record(self, output: torch.Tensor) -> torch.Tensor:
        """Remember a reader's output until the block's forward ends, for the row layer to recognise (`column_output`)."""
        if not torch.compiler.is_compiling() and output.grad_fn is not None:
            self._outputs[id(output.grad_fn)] = output
        return output

    def column_output(self, node, output_nr: int) -> torch.Tensor | None:
        """The reader's output whose autograd edge is (`node`, `output_nr`), if one was recorded in this call."""
        output = self._outputs.get(id(node))
        return output if output is not None and output.grad_fn is node and output.output_nr == output_nr else None

    def saved_chunk(self, x: torch.Tensor) -> SavedChunk | None:
        """Under sequence parallelism, this rank's chunk of the gathered input `x`, one for every layer reading it."""
        if group_size(self.group) == 1 or not torch.is_grad_enabled():
            return None
        if self._saved is None or self._saved.source() is not x:
            self._saved = SavedChunk(x, self.group, 1)
            self._clear_after_backward(x)
        return self._saved

    def current_chunk(self) -> SavedChunk | None:
        """The chunk saved in this call, for the row layer's backward to start gathering it again early."""
        return self._saved

    def weight(self, weight: nn.Parameter) -> torch.Tensor:
        """A replicated weight as used inside the span entered last: its partial gradient is summed in the input
        gradient's all-reduce, or alone if it did not enter with the input."""
        joined = self._joined.get(id(weight)) if self._joined else None  # (as in `linear`: no id() guard)
        return joined if joined is not None else copy_to_tp(weight, self.group)

    def _clear_after_backward(self, x: torch.Tensor) -> None:
        """Clear once `x`'s gradient is complete (the block's backward is done): a checkpointed recomputation may stop
        before the block's forward hook clears, and would leave its input (and the graph behind it) held. Not under
        compile, where a hook on an intermediate tensor breaks the graph."""
        if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
            x.register_hook(lambda grad: self.clear())

    def holds_input(self) -> bool:
        """Whether it still holds the input of its last call (after the block's backward it must not)."""
        return self._source is not None

    def clear(self, *_) -> None:
        if self._saved is not None:
            self._saved.release()  # the readers' saved copies remain
        self._source = self._copy = self._saved = self._pending = None
        self._joined, self._deferred, self._outputs = {}, {}, {}
