"""Building a plan: from a policy (shipped or the user's), else from HF's plan or detection, then verified.

`build_plan` reads a model (meta device is fine) and returns a `Plan`. Every inconsistency is
reported here, before the model is changed. Where the policy comes from, in order: the user's, a
shipped one, the model config's `base_model_tp_plan` (translated), structural detection (see
`autotp.planning.derive`); derived plans keep only the blocks `autotp.planning.verify` proves exact.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from transformers import PretrainedConfig

from ..compat.hf import is_causal_lm, own_loss
from ..options import WrapOptions
from .components import as_planned, components, joined, rebased
from .derive import derive_policy
from .logits_path import logits_path_refusal
from .mixers import with_mixers
from .plan import VOCAB_OFF, LayerPlan, Plan, VocabPlan
from .policy import Policy, as_policy, find_policy
from .policy_plan import plan_from_policy
from .sharding import Partition
from .ties import keep_ties
from .twin import structural_twin
from .verify import apply_verdicts, under, verdicts, verify_by_emulation, without_blocks

PolicyArg = Policy | str | Path | Mapping[str, Any] | None


def build_plan(
    model: nn.Module,
    tp_size: int,
    policy: PolicyArg = None,
    vocab_parallel: bool = True,
    example_inputs: Mapping[str, Any] | None = None,
) -> Plan:
    """The plan for `model` at `tp_size`: from `policy`, else a shipped policy, HF's plan or detection.

    `vocab_parallel` shards the embedding and LM head by vocabulary where the model allows it (causal LMs whose
    loss goes through `self.loss_function`; one no policy covers once its logits' path is checked by emulation).
    `example_inputs` are forward keyword arguments verification runs the model on, for a model that takes no token
    ids.
    """
    if not isinstance(getattr(model, "config", None), PretrainedConfig):
        raise TypeError(
            f"autotp shards Hugging Face models (a transformers PreTrainedModel with a .config); got "
            f"{type(model).__name__}. Wrap the PreTrainedModel itself, not a module around it"
        )
    twin = functools.cache(lambda: structural_twin(model))  # built once, for verification and the logits' path
    plan = with_mixers(model, keep_ties(model, _build_plan(model, tp_size, policy, example_inputs, twin)))
    if not vocab_parallel:
        return replace(plan, vocab_reason=VOCAB_OFF)
    logits_path = None if components(model) else lambda: logits_path_refusal(model, tp_size, twin, example_inputs)
    return with_vocab(model, plan, logits_path)


def plan_for(model: nn.Module, tp_size: int, options: WrapOptions, split_vocab: bool = False) -> Plan:
    """`build_plan` with `wrap`'s options (`autotp.api` and an engine's layout plan alike); `split_vocab`: by
    vocabulary whatever they say (an engine that always splits it: vLLM)."""
    return build_plan(model, tp_size, options.policy, options.vocab_parallel or split_vocab, options.example_inputs)


def _build_plan(
    model: nn.Module, tp_size: int, policy, example: Mapping[str, Any] | None, twin: Callable[[], nn.Module | None]
) -> Plan:
    parts = components(model) if policy is None else []
    if parts:
        return _composite_plan(model, tp_size, parts, example)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    chosen = as_policy(policy) if policy is not None else find_policy(model_type)
    derived = chosen is None
    policy = derive_policy(model) if derived else chosen
    return _verified(
        model,
        plan_from_policy(model, tp_size, policy),
        not derived,
        twin,
        lambda twin: plan_from_policy(twin, tp_size, policy),
        example,
    )


def _verified(
    model: nn.Module,
    plan: Plan,
    only_custom: bool,
    make_twin: Callable[[], nn.Module | None],
    twin_plan: Callable[[nn.Module], Plan],
    example: Mapping[str, Any] | None,
) -> Plan:
    """`plan` with the blocks verification could not prove exact moved to replicated (`only_custom`: a shipped
    policy, whose transformers classes need no check).

    A loaded model is verified itself. A meta-device model is verified on its structural twin (from
    `make_twin`, planned by `twin_plan` as the model was); blocks the twin lacks stay replicated.
    """
    if not any(p.device.type == "meta" for p in model.parameters()):
        return verify_by_emulation(model, plan, only_custom, example)
    if not any(layer.block for layer in plan.layers):
        return plan
    with torch.device("cpu"):  # the caller may have made meta the default device
        twin = make_twin()
        if twin is None:
            return apply_verdicts(
                model,
                plan,
                {},
                only_custom,
                "the model is on the meta device and no structural twin of it could be built to run",
            )
        try:
            planned = twin_plan(twin)
        except ValueError as err:
            return apply_verdicts(model, plan, {}, only_custom, f"its structural twin plans differently ({err})")
        return apply_verdicts(
            model,
            plan,
            verdicts(twin, planned, only_custom, example),
            only_custom,
            "its block is not in the structural twin built from the config",
        )


def _composite_plan(model: nn.Module, tp_size: int, parts, example: Mapping[str, Any] | None) -> Plan:
    """A vision-language (or other composite) model: each sub-model planned from its own config and policy,
    then verified inside the whole model (or its structural twin, built once, on the meta device), whose
    forward on `autotp.planning.probe` inputs reaches every block."""
    twin = functools.cache(lambda: structural_twin(model))
    planned = []
    for path, component in parts:
        chosen = find_policy(component.config.model_type)
        policy = chosen or derive_policy(as_planned(component)[0])
        plan = _component_plan(component, path, tp_size, policy)
        planned.append(
            (
                path,
                _verified(
                    model,
                    plan,
                    chosen is not None,
                    twin,
                    functools.partial(_twin_component_plan, path=path, tp_size=tp_size, policy=policy),
                    example,
                ),
            )
        )
    own = _own_plan(model, tp_size, [path for path, _ in parts], twin, example)
    return joined(model, planned + ([("", own)] if own is not None else []), tp_size)


def _own_plan(
    model: nn.Module, tp_size: int, paths: list[str], twin: Callable[[], nn.Module | None], example
) -> Plan | None:
    """A composite's blocks outside its sub-models, by the shipped policy of its own model type (Phi-4-multimodal's
    language model is the root model itself, beside its vision and audio sub-models); None where nothing is planned.
    Verified as any shipped policy is (its custom classes only), on the structural twin for a meta-device model."""
    policy = find_policy(model.config.model_type)
    outside = [name for name, _ in model.named_modules() if not under(name, paths)]
    if policy is None or not any(fnmatchcase(name, rule.match) for rule in policy.rules for name in outside):
        return None
    plan = _verified(
        model,
        _outside(plan_from_policy(model, tp_size, policy), paths),
        True,
        twin,
        lambda other: _outside(plan_from_policy(other, tp_size, policy), paths),
        example,
    )
    return plan if plan.layers else None


def _outside(plan: Plan, paths: list[str]) -> Plan:
    """`plan` without what it plans inside the sub-models at `paths`: each of those is planned from its own config."""
    out = without_blocks(plan, {layer.block: "" for layer in plan.layers if under(layer.block or layer.path, paths)})
    return replace(
        out,
        regions=tuple(r for r in out.regions if not under(r.path, paths)),
        replicated=tuple(r for r in out.replicated if not under(r[0], paths)),
    )


def _component_at(model: nn.Module, path: str) -> nn.Module:
    """The sub-model at `path` of a composite (the twin's counterpart of a component), or ValueError."""
    found = dict(components(model)).get(path)
    if found is None:
        raise ValueError(f"it has no sub-model {path}")
    return found


def _twin_component_plan(twin: nn.Module, path: str, tp_size: int, policy: Policy) -> Plan:
    """The twin's counterpart of the component at `path`, planned as the component was."""
    return _component_plan(_component_at(twin, path), path, tp_size, policy)


def _component_plan(component: nn.Module, path: str, tp_size: int, policy: Policy) -> Plan:
    planned, prefix = as_planned(component)
    try:
        return rebased(plan_from_policy(planned, tp_size, policy), prefix, path)
    except ValueError as err:
        raise ValueError(f"{path} ({type(component).__name__}): {err}") from None


def with_vocab(model: nn.Module, plan: Plan, logits_path: Callable[[], str] | None = None) -> Plan:
    """Add vocab parallelism when it is known to be safe, else say why not. A plan no policy wrote needs
    `logits_path`: it says why the LM head's output does not reach the loss and the logits elementwise along the
    vocabulary, "" when it does (`autotp.planning.logits_path`); without it such a plan is refused."""
    why = _vocab_refusal(model, plan, logits_path)
    if why:
        return replace(plan, vocab_reason=why)
    modules = {id(m): name for name, m in model.named_modules()}
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = embedding is not None and embedding.weight is head.weight
    rows = head.out_features
    partition = Partition.even(0, rows, plan.tp_size)
    # an embedding holding parameters besides its rows (Inkling2's norm after the lookup) would train them on only
    # the tokens of this rank's rows: it stays whole
    embedding_ok = (
        isinstance(embedding, nn.Embedding)
        and embedding.weight.shape[0] == rows
        and [name for name, _ in embedding.named_parameters()] == ["weight"]
    )
    if tied and not embedding_ok:
        return replace(plan, vocab_reason=f"the LM head is tied to a {type(embedding).__name__} autotp cannot split")
    head_path = modules[id(head)]
    layer = LayerPlan(head_path, "column", tuple(head.weight.shape), partition, f"vocab {rows}", head_path)
    vocab = VocabPlan(head_path, modules[id(embedding)] if embedding_ok else None, tied, partition)
    return replace(
        plan,
        layers=plan.layers + (layer,),
        vocab=vocab,
        replicated=tuple(r for r in plan.replicated if r[0] != head_path),
    )


def _vocab_refusal(model: nn.Module, plan: Plan, logits_path: Callable[[], str] | None) -> str:
    if plan.tp_size == 1:
        return "tp_size=1"
    if plan.vocab_reason:  # the policy says why not
        return plan.vocab_reason
    if not plan.origin.checked_by_hand and logits_path is None:
        return "only models covered by a policy (the loss and logits path of others is unchecked)"
    if not is_causal_lm(model):
        return f"{type(model).__name__} is not a causal LM"
    loss = own_loss(model)
    if loss is not None:  # the sharded loss computes transformers' cross-entropy; the user's runs on whole logits
        return f"the model's loss_function is {loss}, not transformers' causal-LM loss, so it gets whole logits"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or any(layer.path.endswith(".lm_head") for layer in plan.layers):
        return "no plain nn.Linear LM head"
    if head.out_features < plan.tp_size:
        return f"the LM head's vocabulary ({head.out_features}) is smaller than tp_size={plan.tp_size}"
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    allowed = {id(embedding.weight)} if embedding is not None and embedding.weight is head.weight else set()
    names: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        names[id(param)] = names.get(id(param), 0) + 1
    shared = [p for p in (head.weight, head.bias) if p is not None and names.get(id(p), 0) > 1 and id(p) not in allowed]
    if shared:
        return "the LM head shares a parameter with another module (besides a tied embedding)"
    if not plan.origin.checked_by_hand and logits_path is not None:  # last: it runs the model (or its twin)
        return logits_path()
    return ""
