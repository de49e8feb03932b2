"""`WrapOptions`: every option of `wrap`, `from_pretrained` and `explain`, documented once, shared by the whole pipeline.

The entry points take `tp_size` and `**kw: Unpack[WrapKwargs]` (its other fields, typed for IDEs and type
checkers), and `takes_wrap_options` spells those keywords out in their runtime signature (`help`, `inspect`), so a new
option is one field here and one key of `WrapKwargs` (tests/package/test_options.py holds the two alike). They build
one `WrapOptions` by keyword (its fields are keyword-only, so a field added in the middle cannot shift the others);
`apply_plan` fixes the options into the layers and block entries it builds, and the wrapped model's state keeps them.
Every field is either compared between the ranks before sharding or named per-rank, with the reason, in
`autotp.runtime.agreement`.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Callable, Mapping, TypedDict, TypeVar

PolicyArg = Any  # a TOML path, a dict, or None (autotp.planning.planner.PolicyArg)


@dataclass(frozen=True, kw_only=True)
class WrapOptions:
    """How a model is sharded; every field has the default `wrap` gives it.

    - `tp_size`: tensor parallelism, each layer split over that many consecutive ranks (the entry points' second
      positional argument; 1: no tensor parallelism).
    - `tp_group`: a process group to shard over, instead of consecutive ranks of the world; the DP
      groups are then built to match.
    - `policy`: a TOML path or a dict naming each module's style; by default a shipped policy,
      transformers' `base_model_tp_plan`, or structural detection.
    - `vocab_parallel`: split the embedding and LM head by vocabulary where the model allows (the
      plan says why not, otherwise), so logits stay sharded and the loss runs on the shards.
    - `sequence_parallel`: also split the residual stream between blocks along the sequence.
    - `check_inputs`: verify on every forward that all TP ranks of a replica got the same tensors,
      and every 100 training forwards that the replicated parameters still agree.
    - `timeout`: how long autotp's collectives wait for a failed or hung peer (a timedelta, or
      seconds); None: the one given to `init_process_group`, else 5 minutes.
    - `overlap`: compute the column layers' weight gradients while their input gradient's
      all-reduce runs (Megatron's overlap).
    - `recompute_glu`: keep a gated MLP's gate and up outputs for the backward, not act(gate) and
      the product (`autotp.tp.glu`).
    - `example_inputs`: forward keyword arguments for a small batch (`{"pixel_values": tensor}`), on which the plan
      is verified by running the model once, for a model whose forward takes no `input_ids`. Without them, an
      explicit plan (`policy=`, or transformers' `base_model_tp_plan`) that cannot be verified is refused.
    - `cp_size`: context parallelism, the sequence split over that many ranks (TP groups innermost, CP groups next:
      world = dp x cp x tp). Every rank of a CP group is given the same whole batch; the loss and gradients are
      those of one process (`autotp.cp.apply`, docs/long-context.md).
    - `ep_size`: expert parallelism, each MoE layer's routed experts split by expert over that many consecutive ranks
      (taking the TP ranks first), tokens sent to them by an all-to-all; the rest of the world holds copies of them
      (`autotp.ep`). The dense layers keep dp x cp x tp.
    - `pp_size`: pipeline parallelism, the decoder layers cut into that many stages, one per group of ranks (PP
      outermost: world = pp x dp x cp x tp); a step is `autotp.forward_backward(model, **batch)` (`autotp.pp`,
      docs/pipeline.md). Every rank is given the same whole batch.
    - `pp_schedule`: torch.distributed.pipelining's schedule, as torch names it: "GPipe", "1F1B", "Interleaved1F1B",
      or the zero-bubble "ZBVZeroBubble" and "DualPipeV" (2 stages per rank in a V, the backward split into the
      input's and the weights' parts: `autotp.pp.zero_bubble`).
    - `pp_stages_per_rank`: the stages each rank runs under a looped schedule (None: 2 for "Interleaved1F1B", 1
      for "GPipe" and "1F1B", which take only 1; the zero-bubble schedules take exactly 2).
    - `pp_microbatches`: the micro-batches each batch is split into along its rows (None: pp_size).
    - `pp_split_points`: the index of the first decoder layer of every stage but the first (None: balanced by a cost
      model in which the embedding and the head each count as one layer).
    - `loss_chunk`: tokens per chunk of the LM head and loss in a training forward with labels, vocab-parallel or
      replicated, at tp 1 too (`autotp.vocab.chunked`): the batch x seq x vocab logits are never held whole; None or 0
      turns it off. Where it would not be exact (FSDP2, a float8 or LoRA head, logits
      transformed other than by a number or a tanh) the whole logits are used; second-order gradients through it are
      refused (`autotp.runtime.second_order`).
    """

    tp_size: int = 1
    tp_group: Any = None  # torch.distributed.ProcessGroup; not imported here: planning has no torch.distributed
    policy: PolicyArg = None
    vocab_parallel: bool = True
    sequence_parallel: bool = False
    check_inputs: bool = False
    timeout: timedelta | float | None = None
    overlap: bool = True
    recompute_glu: bool = True
    example_inputs: Mapping[str, Any] | None = None
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int | None = None
    pp_microbatches: int | None = None
    pp_split_points: tuple[int, ...] | None = None
    loss_chunk: int | None = 512

    def sizes(self) -> dict[str, int]:
        """Every mesh axis's size but DP's, by axis name: each `<axis>_size` field (an axis of `autotp.mesh.AXES`),
        `tp_size` first. The ranks agree on these before any group is built."""
        return {f.name.removesuffix("_size"): getattr(self, f.name) for f in fields(self) if f.name.endswith("_size")}

    def size_words(self, value: int | None = None) -> str:
        """Every size of `sizes` named in a sentence ("tp_size, cp_size and ep_size"), each `=value` if given: an
        error about sizes that differ between ranks names them all, since any one of them may be the one."""
        names = [f"{axis}_size" + ("" if value is None else f"={value}") for axis in self.sizes()]
        return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]

    def __post_init__(self) -> None:
        if self.pp_split_points is not None:
            object.__setattr__(self, "pp_split_points", tuple(self.pp_split_points))
        chunk = self.loss_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
            raise ValueError(f"loss_chunk={chunk!r}: a number of tokens per chunk, or None or 0 to turn chunks off")
        if isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            object.__setattr__(self, "timeout", timedelta(seconds=self.timeout))


# Every field of `WrapOptions` is on one side (`autotp.runtime.agreement` compares the first over every group;
# tests/parallelize/test_rank_agreement.py fails on a field on neither side):
AGREED_OPTIONS = frozenset(
    {"vocab_parallel", "sequence_parallel", "check_inputs", "overlap", "recompute_glu", "loss_chunk"}
    | {"pp_schedule", "pp_stages_per_rank", "pp_microbatches", "pp_split_points"}
    | {f.name for f in fields(WrapOptions) if f.name.endswith("_size")}
)  # compared as given: ranks that differ would
# shard or synchronise apart; every axis's size among them, so a new dimension's field needs no entry here
PER_RANK_OPTIONS = frozenset(
    {
        "tp_group",  # a process group: each rank holds its own object, of its own members
        "timeout",  # how long this rank waits; ranks may wait differently without training apart
        "policy",  # a path or dict, which may differ between ranks: the plan, compared below, holds its effect
        "example_inputs",  # each rank's own tensors: the plan verified on them, compared below, holds their effect
    }
)


class WrapKwargs(TypedDict, total=False):
    """The keyword options of `wrap`, `from_pretrained` and `explain`: every field of `WrapOptions` but `tp_size` (their
    second positional argument), with its type; the defaults and the meaning are `WrapOptions`'."""

    tp_group: Any
    policy: PolicyArg
    vocab_parallel: bool
    sequence_parallel: bool
    check_inputs: bool
    timeout: timedelta | float | None
    overlap: bool
    recompute_glu: bool
    example_inputs: Mapping[str, Any] | None
    cp_size: int
    ep_size: int
    pp_size: int
    pp_schedule: str
    pp_stages_per_rank: int | None
    pp_microbatches: int | None
    pp_split_points: tuple[int, ...] | None
    loss_chunk: int | None


OPTION_NAMES = tuple(f.name for f in fields(WrapOptions) if f.name != "tp_size")  # the keywords, in the fields' order
Entry = TypeVar("Entry", bound=Callable[..., Any])


def takes_wrap_options(entry: Entry) -> Entry:
    """Give an entry point whose last parameter is `**kw: Unpack[WrapKwargs]` a runtime signature (`help`,
    `inspect.signature`, a notebook's tooltip) that names each option, typed and with `WrapOptions`' default, in place
    of `**kw`; another `**` parameter stays after them (`from_pretrained`'s `**hf_kwargs`)."""
    signature = inspect.signature(entry)
    *named, rest = signature.parameters.values()
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in fields(WrapOptions)
        if f.name in OPTION_NAMES
    ]
    keep = [] if "WrapKwargs" in str(rest.annotation) else [rest]
    entry.__signature__ = signature.replace(parameters=[*named, *options, *keep])  # type: ignore[attr-defined]
    return entry


def wrap_options(call: str, tp_size: int, keywords: Mapping[str, Any]) -> WrapOptions:
    """`WrapOptions` from an entry point's `tp_size` and keyword options; a keyword that is no option is refused,
    as Python refuses an unexpected keyword, with the options named."""
    unknown = [name for name in keywords if name not in OPTION_NAMES]
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTION_NAMES, n=1)
        raise TypeError(
            f"{call}() got an unexpected keyword argument {unknown[0]!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; its options are tp_size and {', '.join(OPTION_NAMES)} (autotp.options.WrapOptions)"
        )
    return WrapOptions(tp_size=tp_size, **keywords)
