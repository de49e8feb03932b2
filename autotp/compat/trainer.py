"""Every place autotp relies on transformers' Trainer (and its accelerate Accelerator) beyond their documented API,
in one module: `autotp.hf_trainer.AutoTPTrainer` replaces some of Trainer's private methods and reads a few
private attributes. Versions are transformers' (accelerate's for its row): CI's minimum leg (5.19) and its pinned
leg (constraints.txt); the newest-releases leg runs the fast tier on whatever is newest.

| piece                                        | used for                                        | checked on |
|----------------------------------------------|-------------------------------------------------|------------|
| `Trainer._wrap_model`                        | replaced: DDP over the DP group, not the world  | 5.19, 5.24 |
| `Trainer._get_num_items_in_batch`            | replaced (and called): tokens summed over DP    | 5.19, 5.24 |
| `Trainer._get_train_sampler`                 | replaced: the DP-aware sampler; a subclass's own is called | 5.19, 5.24 |
| `Trainer._save`                              | replaced: every rank takes part in the gather   | 5.19, 5.24 |
| `Trainer._save_optimizer_and_scheduler`      | replaced: optimizer state as a DCP directory    | 5.19, 5.24 |
| `Trainer._load_optimizer_and_scheduler`      | replaced: this rank's part of it, at any layout | 5.19, 5.24 |
| `Trainer._load_rng_state`                    | replaced (and called): TP ranks then draw alike | 5.24       |
| `Trainer._load_from_checkpoint`              | replaced: this rank's rows of a full checkpoint | 5.19, 5.24 |
| `Trainer._load_best_model`                   | replaced: the same, at load_best_model_at_end   | 5.19, 5.24 |
| `Trainer._get_collator_with_removed_columns` | called: Trainer's collator for autotp's loaders | 5.19, 5.24 |
| `Trainer._get_eval_sampler`                  | called: TRL's GRPO's own (prompts repeated)     | 5.24       |
| `Trainer._train_batch_size`                  | read: the per-device batch size                 | 5.19, 5.24 |
| `Trainer._prepare_inputs`                    | called: a pipeline's step (`autotp.forward_backward`) | 5.24 |
| `Accelerator._models` (accelerate)           | read: whether a model was prepared (autocast)   | 1.15       |

A replaced method that Trainer no longer has would silently never run, so `replace_privates` refuses it when
`autotp.hf_trainer` is imported; every piece raises `versions.missing`'s error naming it. Each private name calls
AutoTPTrainer's public method by name, so a subclass that overrides the public one is heard.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from transformers import Trainer

from .versions import require

# AutoTPTrainer's method -> the private method of Trainer that it replaces
REPLACED = {
    "wrap_for_training": "_wrap_model",
    "count_items_in_batch": "_get_num_items_in_batch",
    "train_sampler": "_get_train_sampler",
    "save_to": "_save",
    "save_optimizer_and_scheduler": "_save_optimizer_and_scheduler",
    "load_optimizer_and_scheduler": "_load_optimizer_and_scheduler",
    "load_rng_state": "_load_rng_state",
    "load_from_checkpoint": "_load_from_checkpoint",
    "load_best_model": "_load_best_model",
}


def replace_privates(cls: type) -> type:
    """Class decorator: under each private name Trainer calls (after checking that Trainer still has it), a call of the
    method of `cls` that `REPLACED` names, looked up on the trainer, so that a subclass's override of it runs."""
    for method, private in REPLACED.items():
        require(Trainer, private, f"transformers.Trainer.{private}")
        setattr(cls, private, _calling(method, private))
    return cls


def _calling(method: str, private: str) -> Callable[..., Any]:
    def call(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)

    call.__name__ = call.__qualname__ = private
    call.__doc__ = f"Trainer's `{private}`, as `{method}` (a subclass's own included)."
    return call


def replaced(trainer: Trainer, cls: type, method: str) -> Callable[..., Any]:
    """The implementation that `cls`'s `method` (a key of `REPLACED`) replaces, as the classes after `cls` in
    `trainer`'s method order have it (Trainer's own, or a subclass's such as TRL's), bound to `trainer`."""
    private = REPLACED[method]
    return require(super(cls, trainer), private, f"transformers.Trainer.{private}")


def own_train_sampler(trainer: Trainer, cls: type) -> Callable[[Any], Any] | None:
    """`trainer`'s `_get_train_sampler` where a subclass (or the instance) has its own (a fixed order, say), rather
    than `cls`'s replacement of it (`REPLACED`); else None."""
    private = REPLACED["train_sampler"]
    method = require(trainer, private, f"transformers.Trainer.{private}")
    return method if getattr(method, "__func__", None) is not vars(cls)[private] else None


def own_clipping(trainer: Trainer) -> None:
    """Keep Trainer on `accelerator.clip_grad_norm_` (autotp's norm): transformers 5.24+ computes its own norm once the
    gradients lie on several DTensor meshes (`_has_mixed_mesh_grads`), as under `autotp.fully_shard` with expert
    parallelism (experts over expert-DP), and would count each EP rank's experts as the whole model's. Trainer caches
    the answer in `_mixed_mesh_grads`; set here, it is never asked. Earlier versions lack it and ignore the field."""
    trainer._mixed_mesh_grads = False


def collator(trainer: Trainer, description: str) -> Callable[..., Any]:
    """Trainer's data collator, without the columns the model's forward does not take (as Trainer's own loaders)."""
    remove = require(
        trainer, "_get_collator_with_removed_columns", "transformers.Trainer._get_collator_with_removed_columns"
    )
    return remove(trainer.data_collator, description=description)


def eval_sampler(trainer: Trainer, dataset: Any) -> Any:
    """The trainer's own evaluation sampler (TRL's GRPO repeats each prompt once per completion it samples)."""
    return require(trainer, "_get_eval_sampler", "transformers.Trainer._get_eval_sampler")(dataset)


def train_batch_size(trainer: Trainer) -> int:
    """The per-device training batch size Trainer uses (it may differ from the arguments' after auto-find)."""
    return require(trainer, "_train_batch_size", "transformers.Trainer._train_batch_size")


def is_prepared(trainer: Trainer, model: nn.Module) -> bool:
    """Whether the trainer's accelerator has prepared `model` (its mixed-precision autocast applied)."""
    return any(m is model for m in require(trainer.accelerator, "_models", "accelerate.Accelerator._models"))


def prepare_inputs(trainer: Trainer, inputs: dict[str, Any]) -> dict[str, Any]:
    """The batch on the model's device, as Trainer's `training_step` prepares it."""
    return require(trainer, "_prepare_inputs", "transformers.Trainer._prepare_inputs")(inputs)
