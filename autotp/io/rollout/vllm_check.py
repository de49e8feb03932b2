"""The engine side's check of a received round, before any of it is loaded: its names and full shapes against what
autotp would send for the engine's own model.

Why: vLLM's loaders check little. A round that leaves a layer out (a 1-layer trainer into a 2-layer engine) is
loaded as new layer 0 beside the old layer 1, with one server-log line; a name the engine lacks or a smaller tensor
raises midway through the layerwise reload, which leaves meta tensors behind and kills the engine at its next
forward (EngineDeadError); a larger tensor can be cut to size by a loader's TP `narrow`, silently. The expected list
is `AutotpWeightSource.metadata()` of a transformers model built from the engine's config on the meta device (the
class its `architectures` names): the checkpoint names and full shapes the trainer declares for the same model,
without any memory.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

from .vllm_source import AutotpWeightSource

logger = logging.getLogger(__name__)
SHOWN = 4  # names quoted per kind of mismatch


def expected_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]] | None:
    """Checkpoint name -> full shape of every tensor a round for a model of `config` holds; None (with a warning in
    the server's log) where transformers cannot build that model, which then goes unchecked. Built once per config
    (a 70B Llama's takes seconds), which the cache holds, so its id stays its own."""
    if id(config) not in _built:
        _built[id(config)] = config, _shapes(config)
    return _built[id(config)][1]


_built: dict[int, tuple[PretrainedConfig, dict[str, tuple[int, ...]] | None]] = {}


def _shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]] | None:
    """The class the config names (the checkpoint's, which vLLM serves), else transformers' causal LM for it."""
    named = getattr(transformers, (config.architectures or [""])[0], None)
    try:
        with torch.device("meta"):
            model = named(config) if isinstance(named, type) else AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 (any failure to build the reference means: not checked)
        logger.warning(
            "autotp: the rounds' names and shapes go unchecked: transformers cannot build this engine's model (%s: %s)",
            type(error).__name__,
            error,
        )
        return None
    return {meta.name: tuple(meta.shape) for meta in AutotpWeightSource(model).metadata()}


def check_round(
    received: Sequence[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]], engine: str
) -> None:
    """Raise naming what differs (tensors left out, tensors the engine lacks, other shapes), with the numbers."""
    sent = {name: tuple(tensor.shape) for name, tensor in received}
    missing = [name for name in expected if name not in sent]
    extra = [name for name in sent if name not in expected]
    reshaped = [name for name in sent if name in expected and sent[name] != expected[name]]
    if not (missing or extra or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the engine's tensors left out ({_some(missing, expected)})")
    if extra:
        parts.append(f"{len(extra)} tensors the engine's model lacks ({_some(extra, sent)})")
    if reshaped:
        shown = ", ".join(
            f"{name} sent {sent[name]} where the engine holds {expected[name]}" for name in reshaped[:SHOWN]
        )
        parts.append(f"{len(reshaped)} of other shapes ({shown}{', ...' if len(reshaped) > SHOWN else ''})")
    raise ValueError(
        f"autotp-gloo: the round does not fit the engine's model ({engine}), refused before loading "
        f"anything; the engine keeps serving its previous weights: {'; '.join(parts)}. Send the model "
        f"the engine serves (the same config), or restart the engine with the trainer's model"
    )


def _some(names: list[str], shapes: dict[str, tuple[int, ...]]) -> str:
    listed = ", ".join(f"{name} {shapes[name]}" for name in names[:SHOWN])
    return listed + (", ..." if len(names) > SHOWN else "")
