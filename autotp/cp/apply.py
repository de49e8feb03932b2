"""Context parallelism (CP): the sequence split over the CP group, the script unchanged.

Every rank of a CP group is given the same whole batch. A forward pre-hook on the model keeps this rank's
tokens (`cp.layout.Layout`: two zigzag chunks, positions those of the whole sequence), so the
embedding, norms, MLPs and LM head all run on S/C tokens; attention gathers K/V over CP. The loss
(`CPLoss`) shifts the whole batch's labels before taking this rank's targets, sums its tokens' losses, adds
the sums over CP (one all-reduce) and divides by the whole batch's target count: every rank returns the loss
one process computes. Its backward multiplies by C, so each CP rank's gradient is C times its tokens' share, and
averaging over DP x CP (`allreduce_gradients`, FSDP's reduce-scatter, DDP over `dp_cp_group`) gives the sum over
CP, averaged over DP. Logits a caller reads are gathered back into the whole sequence.
"""

from __future__ import annotations

import copy
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..compat.hf import (
    FLASH_VARLEN_KWARGS,
    FUSED_LM_HEAD_KWARG,
    own_loss,
    passed_cache,
    set_config_attn_implementation,
)
from ..mesh import Group, group_size
from ..runtime.input_agreement import check_same_batch, check_same_read
from ..runtime.lazy_logits import lazy_logits
from ..runtime.process_hooks import patch_attribute, register_attention, watch_optimizer_steps
from ..runtime.rng import sync_replicated_stream
from .attention import CPAttention, is_varlen
from .dropout import WholeSequenceDropout, dropout_on
from .layout import LAYOUT_KWARG, Layout, build_layout, gather_sequence, pad_positions
from .loss import CPLoss
from .support import attention_modules, refuse_forward, refuse_unsupported

_SPLIT = (
    "input_ids",
    "inputs_embeds",
    "position_ids",
    "attention_mask",
    "labels",
    "shift_labels",
    "seq_idx",
)  # split by CP (seq_idx: TRL's padding-free document index of each token)
_ACTIVE: list[int] = []  # depth of CP forwards running now: transformers' mask functions return None inside one


@dataclass
class Asked:
    """What a caller asked of a forward's outputs that a split forward computes otherwise: a tuple (`return_dict=False`;
    the forward runs returning a ModelOutput, turned into one process's tuple once whole), the logits of some
    positions only (`logits_to_keep`: the forward computes every local position's, the whole sequence's are cut), or
    TRL's fused LM head (run on the whole sequence's last hidden states, gathered from the backbone)."""

    tuple: bool = False
    keep: int | torch.Tensor | None = None
    fused: bool = False


class ContextParallel:
    """What `wrap(..., cp_size=C)` installs: the registered attention and mask functions, the model's hooks and loss.

    `layout` is the split of the CP forward running now (None outside one: generation, a gathered model); each
    layer's attention keeps it for its recomputation in backward."""

    def __init__(self, model: nn.Module, group: Group, state, original: str):
        self.model, self.group, self.state, self.original = model, group, state, original
        self.layout: Layout | None = None
        self.asked = Asked()
        self.dropout: WholeSequenceDropout | None = None
        self.drops = dropout_on(model)  # only then is every torch call of a training forward watched for dropout
        # gradients a backward left as this rank's share, not yet summed over CP (`allreduce_gradients` sums them;
        # DDP over DP x CP, `synced_by_ddp`, and FSDP do it in backward): an optimizer step then is refused
        self.unsynced, self.synced_by_ddp = False, False
        self.loss_calls = 0  # CPLoss calls in this forward: a loss computed another way is refused
        # the layout rides down with transformers' keyword arguments where the forward takes them (for recomputation)
        self.pass_layout = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()
        )
        self.calls = 0
        self.name = f"autotp_cp_{original}"
        self._hold()
        self.modules = attention_modules(model)
        for module in self.modules:
            module.autotp_context = self
            module.autotp_eager = sys.modules[type(module).__module__].eager_attention_forward
        self.inner_loss = model.loss_function
        self.loss = patch_attribute(model, "loss_function", CPLoss(self, self.inner_loss))
        only = state.sharded_only
        self.hooks = [
            model.register_forward_pre_hook(only(self.enter), with_kwargs=True),
            model.register_forward_hook(self.leave, with_kwargs=True, always_call=True),
        ]
        base = model.base_model
        if base is not model:  # the MoE auxiliary loss reads the router logits of every token
            self.hooks.append(base.register_forward_hook(only(self._whole_base_outputs)))
        model.set_attn_implementation(self.name)
        self._per_module_configs(self.name)

    def _hold(self) -> None:
        """The process-wide effects this CP model needs while it lives: the optimizer-step check, its attention and
        mask functions in transformers' registries (`autotp.runtime.process_hooks`)."""
        masks, original = ALL_MASK_ATTENTION_FUNCTIONS, self.original
        self.holds = [
            watch_optimizer_steps(self, _refuse_unsynced_step),
            register_attention(
                self,
                self.name,
                CPAttention(original, ALL_ATTENTION_FUNCTIONS),
                _mask_function(masks[original] if original in masks else None),
            ),
        ]

    def _per_module_configs(self, name: str) -> None:
        """Attention modules given a config copy of their own (their rank's head counts, `apply_plan`) read the
        implementation from it, which `set_attn_implementation` does not reach: set there too."""
        for module in self.modules:
            if module.config is not self.model.config:
                set_config_attn_implementation(module.config, name)

    def __deepcopy__(self, memo: dict) -> ContextParallel:
        """`copy.deepcopy(model)` (an EMA or reference model): the copy's own object, sharing the CP group (a
        handle); the hook handles stay with the original (a copy is never rolled back)."""
        memo[id(self.group)] = self.group
        new = copy.copy(self)
        memo[id(self)] = new
        for name, value in vars(self).items():
            if name not in ("hooks", "holds"):
                setattr(new, name, copy.deepcopy(value, memo))
        new.hooks = []
        new._hold()
        return new

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for module in self.modules:
            del module.autotp_context, module.autotp_eager
        self.loss.remove()
        self.model.set_attn_implementation(self.original)
        self._per_module_configs(self.original)
        for hold in self.holds:
            hold.remove()

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Keep this rank's tokens of the whole batch; a forward with a cache (generation) runs whole."""
        if args:
            if len(args) > 1 or not torch.is_tensor(args[0]):
                raise TypeError("autotp context parallelism: pass the model's inputs as keywords (input_ids=...)")
            kwargs = {**kwargs, "input_ids": args[0]}
        self.layout = None
        if passed_cache(kwargs) is not None:
            return (), kwargs
        if kwargs.get("labels") is not None and module.loss_function is not self.loss.value:
            raise NotImplementedError(
                f"cp_size={group_size(self.group)}: {type(module).__name__}.loss_function was replaced after "
                f"autotp.wrap (by {own_loss(module) or 'transformers causal-LM loss'}); context parallelism computes "
                f"the loss on each rank's chunk of the sequence through its own stand-in, which adds up transformers' "
                f"causal-LM loss alone; use cp_size=1 for a loss_function of your own"
            )
        if not torch.compiler.is_compiling():  # a host sync, left out of a compiled forward (as the RNG check is)
            check_same_batch(
                self.group,
                sorted(((f"{k}=", v) for k, v in kwargs.items() if torch.is_tensor(v)), key=lambda item: item[0]),
                "CP",
            )
        refuse_forward(module, kwargs, self.drops, self.pass_layout)
        varlen = {k: kwargs.pop(k) for k in FLASH_VARLEN_KWARGS if k in kwargs}  # segments are rebuilt per chunk
        asked = self._asked(module, kwargs)
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = ids if ids is not None else embeds
        if x is None or x.dim() < 2:
            raise ValueError("autotp context parallelism needs input_ids or inputs_embeds of shape [batch, seq, ...]")
        length, device = x.shape[1], x.device
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=device)[None]
        per_token = [
            k
            for k, v in kwargs.items()
            if k not in _SPLIT and torch.is_tensor(v) and v.dim() >= 1 and length in v.shape[:2]
        ]
        if per_token:
            raise NotImplementedError(
                f"autotp context parallelism splits input_ids / inputs_embeds, position_ids, "
                f"attention_mask and the labels; {per_token} looks like a per-token input it "
                f"would leave whole; use cp_size=1 for it"
            )
        sp = group_size(self.state.tp_group) if self.state.options.sequence_parallel else 1
        boundaries = varlen.get("cu_seq_lens_q") if is_varlen(self.original) else None  # flash's documents
        layout = build_layout(
            length, self.group, positions, kwargs.get("attention_mask"), device, x.shape[0], sp, boundaries
        )
        for name in ("input_ids", "inputs_embeds", "seq_idx"):
            if kwargs.get(name) is not None:
                kwargs[name] = layout.split(kwargs[name])
        kwargs["position_ids"] = pad_positions(positions.expand(x.shape[0], -1), layout.padded).index_select(
            1, layout.local
        )
        kwargs["attention_mask"], kwargs["use_cache"] = None, False
        if self.pass_layout:
            kwargs[LAYOUT_KWARG] = layout
        self.layout, self.asked, self.calls, self.loss_calls = layout, asked, 0, 0
        self.dropout = WholeSequenceDropout(layout) if module.training and self.drops else None
        if self.dropout is not None:
            self.dropout.__enter__()
        _ACTIVE.append(1)
        return (), kwargs

    def leave(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        layout, self.layout = self.layout, None
        if layout is None:
            return output
        _ACTIVE.pop()
        if self.dropout is not None:
            self.dropout.__exit__(None, None, None)
            self.dropout = None
        if output is None:  # the forward raised
            return output
        if getattr(output, "loss", None) is not None and self.loss_calls == 0 and not self.asked.fused:
            raise NotImplementedError(
                f"{type(module).__name__} computed its loss without self.loss_function, on this "
                f"rank's chunk of the sequence alone; context parallelism needs the model's "
                f"loss_function (use cp_size=1)"
            )
        if self.calls == 0:
            raise NotImplementedError(
                f"{type(module).__name__}: its attention never called transformers' attention "
                f"interface, so context parallelism cannot gather its keys and values; use "
                f"cp_size=1"
            )
        output = self._whole_outputs(module, output, layout)
        return output.to_tuple() if self.asked.tuple and not isinstance(output, tuple) else output

    def gather(self, x: torch.Tensor, layout: Layout, later: bool = False) -> torch.Tensor:
        """A [B, S/C, ...] tensor of a forward (split as `layout`) as the whole sequence (differentiable). Its backward
        leaves this rank's share of the gradients: a gather `later` than the forward (logits read after it, for a
        metric, perhaps after `allreduce_gradients`) marks them unsynced only once a backward runs through it."""
        whole = gather_sequence(x, layout, self.group)
        if not later:
            self.unsynced |= x.requires_grad
        elif whole.requires_grad:
            whole.register_hook(self._backward_ran)
        return whole

    def _read_later(self, logits: torch.Tensor, layout: Layout) -> torch.Tensor:
        """A forward's logits read after it (a collective over CP): checked to be read on every CP rank first."""
        check_same_read(self.group, logits.device)
        return self.gather(logits, layout, later=True)

    def _backward_ran(self, grad: torch.Tensor) -> None:
        self.unsynced = True

    def _whole_base_outputs(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """The base model's router logits ([B * S/C, experts] per layer) as the whole batch's, before the causal LM's
        forward computes the load-balancing loss from them: every rank then computes one process's. Under TRL's
        fused LM head its last hidden states too, which that head reads against the whole batch's labels."""
        layout = self.layout
        if layout is None or not isinstance(output, dict):
            return None
        logits = output.get("router_logits")
        if isinstance(logits, tuple) and logits and torch.is_tensor(logits[0]):
            rows = layout.local.numel()
            output["router_logits"] = tuple(
                self.gather(x.view(-1, rows, x.shape[-1]), layout).flatten(0, 1) for x in logits
            )
        if self.asked.fused and torch.is_tensor(output.get("last_hidden_state")):
            output["last_hidden_state"] = self.gather(output["last_hidden_state"], layout)
        return output

    def _asked(self, module: nn.Module, kwargs: dict) -> Asked:
        """`Asked` of this forward, its keywords changed to what the split forward computes; refuses what it cannot
        give as one process does, before anything runs."""
        config = module.config
        returned = kwargs.get("return_dict")
        tuple_ = not (config.return_dict if returned is None else returned)
        use_cache = kwargs.get("use_cache")
        if tuple_ and (getattr(config, "use_cache", False) if use_cache is None else use_cache):
            raise NotImplementedError(
                "return_dict=False with use_cache under context parallelism: one process's "
                "tuple would hold the whole sequence's key/value cache, which a split forward "
                "does not build (it would shift every later entry); pass use_cache=False too, "
                "or read the ModelOutput (return_dict=True)"
            )
        if tuple_:
            kwargs["return_dict"] = True
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, int) and keep == 0:
            keep = None
        if keep is not None:
            if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
                raise NotImplementedError(
                    "logits_to_keep with labels under context parallelism: the loss needs every "
                    "position's logits; pass logits_to_keep=0 with labels, or no labels"
                )
            kwargs["logits_to_keep"] = 0  # every local position; the whole sequence's are cut once gathered
        return Asked(tuple_, keep, bool(kwargs.get(FUSED_LM_HEAD_KWARG)))

    def _whole_outputs(self, module: nn.Module, output: Any, layout: Layout) -> Any:
        if isinstance(output, tuple):
            return type(output)(
                self.gather(x, layout)
                if torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == layout.local.numel()
                else x
                for x in output
            )
        for key in [k for k in output.keys() if k.endswith("hidden_states")]:
            value = output[key]
            if isinstance(value, tuple):
                output[key] = tuple(self.gather(h, layout) for h in value)
        pending = getattr(output, "autotp_pending", None)  # vocab parallelism's lazy gather over TP
        logits = output["logits"] if pending is None and "logits" in output.keys() else None
        if pending is None and logits is None:
            return output
        read = pending if pending is not None else (lambda: logits)
        lazy = module.training and output.get("loss") is not None and not torch.compiler.is_compiling()
        if lazy:  # a step that reads only its loss gathers nothing (compiled: gathered, as a class swap breaks graphs)
            return lazy_logits(output, lambda: self._read_later(read(), layout))
        logits, keep = self.gather(read(), layout), self.asked.keep
        output.logits = logits if keep is None else logits[:, slice(-keep, None) if isinstance(keep, int) else keep]
        return output


def _refuse_unsynced_step(context: ContextParallel, optimizer: torch.optim.Optimizer) -> None:
    """Each CP rank's gradients are C times its own tokens' share until summed over CP: a step on them would train
    the CP ranks apart, silently. Costs nothing while every CP model's gradients are synchronised."""
    if context.unsynced and not context.synced_by_ddp and not context.state.fsdp:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(p) in held for p in context.model.parameters()):
            raise RuntimeError(
                "autotp: optimizer.step() on gradients of a context-parallel model that were not "
                "summed over CP: call autotp.allreduce_gradients(model) after the backward (it sums "
                "over CP and averages over DP), or train it under DistributedDataParallel over "
                "autotp.dp_cp_group(model) or autotp.fully_shard"
            )


def _mask_function(original: Callable | None) -> Callable:
    """transformers' mask function for the registered name: none inside a CP forward (the attention masks per chunk),
    the original's outside (none for an implementation that registered none)."""

    def mask(*args: Any, **kwargs: Any) -> Any:
        return None if _ACTIVE or original is None else original(*args, **kwargs)

    return mask


def install(model: nn.Module, group: Group, state, cp_size: int) -> ContextParallel | None:
    """Context parallelism over `group` on a wrapped model; None at cp_size 1 (the same code runs, unsplit)."""
    if group_size(group) == 1:
        return None
    original = refuse_unsupported(model, cp_size)
    sync_replicated_stream(group)  # dropout: every CP rank draws the whole sequence's masks alike
    return ContextParallel(model, group, state, original)
