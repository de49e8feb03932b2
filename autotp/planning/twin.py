"""A structural twin: the same model classes and layers, narrower, with random weights, to verify plans on.

Plans derived from HF's `base_model_tp_plan` or from detection are verified by running the model
(`autotp.planning.verify`). A model on the meta device cannot run, and a 70B one should not have to: the
twin can. It is built from the same config with every width divided by one factor, so head and
key/value head counts, layer counts and layer kinds are exactly those of the model, and every
width that was a multiple of another stays one (q = heads x head_dim, gate|up = 2 x width). The
algebra that verification checks (do the partial outputs of the shards sum to the block's
output?) depends on the code and the head grouping, not on the widths.

A model with many routed experts (Qwen3-235B-A22B: 128 experts x 94 layers) is still too large once narrowed; its
twin also holds fewer experts (`fewer_experts`), since that algebra is per expert and the expert count changes no
block's code. Expert parallelism's checks (`autotp.ep.regions`) read the model itself, never the twin, so the twin's
count need not divide any `ep_size`.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from transformers import PretrainedConfig

from ..compat.hf import eager_experts
from .probe import IMAGE_TOKEN_KEYS, probe_inputs

log = logging.getLogger("autotp")

_WIDTHS = {
    "hidden_size",
    "intermediate_size",
    "head_dim",
    "d_model",
    "d_ff",
    "d_kv",
    "ffn_dim",
    "n_embd",
    "n_inner",
    "rotary_dim",
    "embed_dim",
    "word_embed_proj_dim",
    "ffn_hidden_size",
    "kv_channels",
    "attention_hidden_size",  # Zamba2's shared attention reads the hidden states and the embeddings, concatenated
    # a vision tower's output width, which is its language model's input width
    "out_hidden_size",
    "projection_dim",
    "vision_output_dim",
    "text_hidden_size",
    "mm_hidden_size",
}
_MIN_HEAD_DIM = 8  # keeps partial rotary fractions (1/4, 1/2) whole and even
_TWIN_VOCAB = 512
_MAX_TWIN_PARAMS = 400_000_000  # ~1.6 GB in fp32: beyond this the twin is not built
# Routed-expert counts and experts per token, by the names transformers' MoE configs give them (DBRX's ffn_config,
# Llama 4's and the vision-language MoEs' text_config are sub-configs, handled as parts).
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k", "top_k_experts")


# Mamba-2 mixers' (heads, head width, expansion) fields: the heads must fill the expanded width
SSM_HEADS = (
    ("num_heads", "head_dim", "expand"),
    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
)


def ssm_heads(config) -> list[tuple[str, str, int]]:
    """(heads field, head width field, channels) of each Mamba-2 mixer the config describes: channels are its
    expansion of the hidden size (Falcon-H1's own `mamba_d_ssm` where set), which the heads times their width fill."""
    hidden = getattr(config, "hidden_size", None)
    own = getattr(config, "mamba_d_ssm", None)
    out = []
    for heads, width, expand in SSM_HEADS:
        values = [getattr(config, name, None) for name in (heads, width, expand)]
        if not isinstance(hidden, int) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            continue
        out.append((heads, width, own if isinstance(own, int) else int(getattr(config, expand) * hidden)))
    return out


def width_fields(config) -> dict[str, int]:
    """The config's integer width fields: names above, and `*_intermediate_size` / `*_head_dim`."""
    out = {}
    for name, value in vars(config).items():
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value > 0
            and (name in _WIDTHS or name.endswith("_intermediate_size") or name.endswith("_head_dim"))
        ):
            out[name] = value
    return out


def sub_configs(config) -> dict[str, object]:
    """A composite config's sub-configs (a vision-language model's `text_config`, `vision_config`)."""
    return {name: value for name, value in vars(config).items() if isinstance(value, PretrainedConfig)}


def shrink_factor(config) -> int:
    """The largest power of two that divides every width and leaves at least `_MIN_HEAD_DIM` per head.

    A composite config takes the smallest factor of its parts, so widths shared between them (a
    tower's output and the language model's input) stay equal.
    """
    parts = sub_configs(config)
    if parts:
        return min([_own_factor(config), *(shrink_factor(part) for part in parts.values())])
    return _own_factor(config)


def _own_factor(config) -> int:
    widths = width_fields(config)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = widths.get("head_dim") or (
        widths.get("hidden_size", 0) // heads if isinstance(heads, int) and heads else 0
    )
    rotary = _rotary_fractions(config)
    factor = 1
    while (
        head_dim
        and head_dim // (factor * 2) >= _MIN_HEAD_DIM
        and all(v % (factor * 2) == 0 for v in widths.values())
        and all((head_dim // (factor * 2) * p) % 4 == 0 for p in rotary)
    ):
        factor *= 2
    return factor


def _rotary_fractions(config) -> list[float]:
    """The partial rotary fractions the config names (also per layer kind in `rope_parameters`): a narrowed head
    keeps its rotary part a multiple of 4 dims, whole frequency pairs per axis (NeoMME's quarter-rotary heads)."""
    found = [getattr(config, "partial_rotary_factor", None)]
    rope = getattr(config, "rope_parameters", None)
    for part in ([rope] + list(rope.values())) if isinstance(rope, dict) else []:
        if isinstance(part, dict):
            found.append(part.get("partial_rotary_factor"))
    return [p for p in found if isinstance(p, float) and 0 < p < 1]


def twin_config(config, factor: int | None = None):
    """`config` with every width divided by `shrink_factor` and the vocabulary cut to `_TWIN_VOCAB`.

    Sub-configs are narrowed by the same factor; image token ids move inside the cut vocabulary.
    """
    twin = copy.deepcopy(config)
    factor = factor or shrink_factor(config)
    for name, part in sub_configs(config).items():
        setattr(twin, name, twin_config(part, factor))
    for name, value in width_fields(config).items():
        setattr(twin, name, value // factor)
    vocab = getattr(twin, "vocab_size", None)
    if isinstance(vocab, int) and vocab > _TWIN_VOCAB:
        twin.vocab_size = _TWIN_VOCAB
        for key, token in (
            ("pad_token_id", 0),
            ("bos_token_id", 1),
            ("eos_token_id", 2),
            ("decoder_start_token_id", 0),
        ):
            if isinstance(getattr(twin, key, None), int) and getattr(twin, key) >= _TWIN_VOCAB:
                setattr(twin, key, token)
    text_vocab = getattr(getattr(twin, "text_config", None), "vocab_size", None)
    for key in IMAGE_TOKEN_KEYS:
        if (
            isinstance(text_vocab, int)
            and isinstance(getattr(twin, key, None), int)
            and getattr(twin, key) >= text_vocab
        ):
            setattr(twin, key, text_vocab - 1)
    for heads, width, channels in ssm_heads(twin):  # the heads kept (the plan splits them), each narrowed
        if channels % getattr(twin, heads) == 0:
            setattr(twin, width, channels // getattr(twin, heads))
    twin.use_cache = False
    return twin


def fewer_experts(config):
    """`config` (a twin's) with each routed-expert count cut to `_fewest_experts`, or None if none can be cut.
    Parts (sub-configs) are cut alike; one that names no experts per token is left as it is (its routing is unknown)."""
    cut = copy.deepcopy(config)
    changed = False
    for part in [cut, *sub_configs(cut).values()]:
        fewest = _fewest_experts(vars(part))
        for name in _EXPERT_COUNTS if fewest else ():
            value = getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > fewest:
                setattr(part, name, fewest)
                changed = True
    return cut if changed else None


def _fewest_experts(fields: dict) -> int | None:
    """The fewest experts routing still takes (None without a top-k field): two, and each token's top-k; for
    DeepSeek-style grouped routing (`n_group` groups, `topk_group` chosen) whole groups of at least two (a group is
    scored by its top two) whose chosen groups hold the top-k."""
    top = max(
        [
            k
            for name in _TOP_K
            for k in (fields[name] if isinstance(fields.get(name), list) else [fields.get(name)])
            if isinstance(k, int) and not isinstance(k, bool)
        ],
        default=None,
    )
    if top is None:
        return None
    groups = fields.get("n_group")
    if not isinstance(groups, int) or groups <= 1:
        return max(2, top)
    chosen = fields.get("topk_group")
    chosen = chosen if isinstance(chosen, int) and 0 < chosen <= groups else groups
    return groups * max(2, -(-top // chosen))


def _parameter_count(model: nn.Module, config) -> int:
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return sum(p.numel() for p in type(model)(config).parameters())


def structural_twin(model: nn.Module) -> nn.Module | None:
    """A narrow real-weight copy of `model`'s architecture (None, with the reason logged, if it cannot be built).

    Its weights are drawn from a fixed seed; the global random generators are left as they were: TP ranks
    keep them in step.
    """
    config = twin_config(model.config)
    try:
        count = _parameter_count(model, config)
        fewer = fewer_experts(config) if count > _MAX_TWIN_PARAMS else None
        if fewer is not None:
            config, count = fewer, _parameter_count(model, fewer)
        if count > _MAX_TWIN_PARAMS:
            log.info("autotp: no structural twin of %s: %d parameters even when narrowed", type(model).__name__, count)
            return None
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)  # the same twin whatever ran before: a plan depends on the config only
            twin = type(model)(config).float()
            eager_experts(twin)  # its narrow experts may break grouped_mm's 16-byte strides; the sums are the same
            if fewer is not None:  # a cut its code cannot run (routing the fields above do not describe) is no twin
                with torch.no_grad():
                    twin.eval()(**probe_inputs(twin))
    except Exception as err:  # any failure means the twin cannot stand in for the model
        log.info("autotp: no structural twin of %s (%s: %s)", type(model).__name__, type(err).__name__, err)
        return None
    return twin.eval()
