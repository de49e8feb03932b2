"""A refusal for module hooks a user registered before `wrap` on a linear that tensor parallelism replaces.

`wrap` puts a new module (`LinearLayer`, `LinearAllreduce`) where each split linear was; hooks live on the module
object, so those registered on the old one would silently never run again (a probe of the LM head's logits, a
gradient hook on a projection). Carrying them over is not exact either: the new module's output is this rank's
shard (a column layer's) or a partial sum reduced after it (a row layer's). Refused by name before anything changes.
"""

from __future__ import annotations

from torch import nn

from ..planning.plan import Plan

_KINDS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}


def refuse_hooked_layers(model: nn.Module, plan: Plan) -> None:
    """Raise, naming the layer and its hooks, if a linear `plan` replaces holds any forward or backward hook."""
    for layer in plan.layers:
        module = model.get_submodule(layer.path)
        hooks = [(kind, len(getattr(module, attr, {}))) for attr, kind in _KINDS.items() if getattr(module, attr, {})]
        if not hooks:
            continue
        parent = layer.path.rpartition(".")[0] or "the model"
        described = ", ".join(f"{n} {kind}{'s' * (n > 1)}" for kind, n in hooks)
        raise ValueError(
            f"autotp: {layer.path} ({type(module).__name__}) has {described} registered before wrap; tensor "
            f"parallelism replaces this layer with a {layer.style}-parallel one, so the hook would silently never run "
            f"again (and on the new layer it would see this rank's shard, not the whole output). Remove it before wrap "
            f"and register it after wrap on a module whose output is whole ({parent}, or the model), or on the sharded layer knowing it sees a shard. Nothing was changed."
        )
