"""Pipeline parallelism beyond dense decoders: the rank workers of tests/pp/test_pp_families.py (memory per stage,
MoE, hybrid and vision-language models)."""

from __future__ import annotations

import autotp
import models
from autotp.testing import tiny_config
from models import tiny_model
from pp_workers import pp_parity

# families tests/models.py does not list (its lists parametrize other packages' tests), built from their defaults
for _family in ("qwen3_moe", "jamba", "qwen3_next"):
    models.CONFIGS.setdefault(_family, lambda family=_family: tiny_config(family))


def parameter_bytes(model) -> int:  # noqa: ANN001
    """The bytes of the parameters a rank holds (a tied weight once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def expected_bytes(model, stage: int, stages: int) -> dict:  # noqa: ANN001
    """The acceptance's figure for one stage, from the one-process model: 1/P of the decoder layers, plus the
    embeddings before them on the first stage and the final norm and the head on the last."""
    base = model.base_model
    children = dict(base.named_children())
    layers = next(n for n, m in children.items() if m.__class__.__name__ == "ModuleList")
    order = list(children)
    before = sum(parameter_bytes(children[c]) for c in order[: order.index(layers)])
    after = sum(parameter_bytes(children[c]) for c in order[order.index(layers) + 1 :])
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    return {
        "layers": parameter_bytes(children[layers]) / stages,
        "ends": (before if stage == 0 else 0)
        + (after + head.numel() * head.element_size() if stage == stages - 1 else 0),
        "tied": tied,
    }


def pp_family(rank: int, world: int, family: str, tp: int, pp: int, options: dict) -> dict:
    """`pp_parity`, and this rank's parameter bytes once wrapped with the same options beside the acceptance's."""
    result = pp_parity(rank, world, family, tp, pp, options)
    config = dict(options.get("config", {}))
    wrap_options = {k: v for k, v in options.items() if k.startswith("pp_") or k == "ep_size"}
    model = autotp.wrap(tiny_model(family, **config), tp, pp_size=pp, **wrap_options)
    result["bytes"] = parameter_bytes(model)
    result["expected_bytes"] = expected_bytes(tiny_model(family, **config), autotp.pp_rank(model), pp)
    return result
