"""A `model.loss_function` of the user's own, set before or after `autotp.wrap`: it runs on whole logits and trains as
one process with the same function trains, or the wrap or the step is refused by name.

Before: set before `wrap(model, 2)` it was silently replaced by the vocab-parallel cross-entropy; set after, it got
one rank's vocabulary shard (an IndexError); under context or pipeline parallelism it was added up per chunk or
micro-batch as if it were transformers' token sums (a loss of 0.37 or 11 for one process's 5.5).

Tolerances are `autotp.testing.parity`'s fp32 ones: only the order of sums differs.
"""

from __future__ import annotations

import copy

import torch

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, focal_loss, labels_with_ignored, tiny_model


def set_loss(model: torch.nn.Module) -> None:
    model.loss_function = focal_loss


def set_loss_and_resize(model: torch.nn.Module) -> None:
    """After wrap: the loss, then a vocabulary resize (which re-splits the vocabulary and must keep the loss)."""
    model.loss_function = focal_loss
    model.resize_token_embeddings(264)


def refusal(rank: int, world: int, size: str, when: str) -> str:
    """The error of a step at `size`=`world` with the user's loss set `when` ("before" or "after") wrap."""
    model = tiny_model("llama")
    ids = batch()
    if when == "before":
        set_loss(model)
    try:
        model = autotp.wrap(model, 1, **{size: world})
        if when == "after":
            set_loss(model)
        autotp.forward_backward(model, input_ids=ids, labels=ids)
    except NotImplementedError as err:
        return str(err)
    return "no error"


def user_loss_runs(rank: int, world: int) -> dict:
    """At tp 1 (a DP replica of `world`) and tp `world`, the user's loss set before wrap, after it, and after it with a
    resize: `compare_training`'s report against one process given the same loss (and resize); then each refusal
    under CP and PP."""
    ids = batch()
    labels = labels_with_ignored(ids)
    report: dict = {}
    for tp in (1, world):
        for when, edit in (("before", None), ("after", set_loss), ("after+resize", set_loss_and_resize)):
            reference = tiny_model("llama")
            if edit is None:
                set_loss(reference)  # before wrap: compare_training wraps a deep copy holding it
            compared = parity.compare_training(copy.deepcopy(reference), ids, tp, labels=labels, edit=edit)
            report[f"tp{tp} {when}"] = compared
    for size in ("cp_size", "pp_size"):
        for when in ("before", "after"):
            report[f"{size} {when}"] = refusal(rank, world, size, when)
    return report


def test_a_users_loss_function_trains_as_one_process_or_is_refused_by_name() -> None:
    for report in run_ranks(user_loss_runs, 2):
        for tp in (1, 2):
            for when in ("before", "after", "after+resize"):
                parity.assert_parity(report[f"tp{tp} {when}"])
        for size in ("cp_size", "pp_size"):
            for when in ("before", "after"):
                message = report[f"{size} {when}"]
                assert "loss_function" in message and "focal_loss" in message, (size, when, message)
                assert f"use {size}=1" in message, message
