"""A refusal for backwards that autograd cannot differentiate again exactly.

Autograd runs a backward with grad mode on exactly when it builds the gradients' own graph (`create_graph=True`,
for a gradient penalty or a Hessian-vector product). A backward that scales gradients kept from the forward (the
chunked loss), reads values saved without a graph (the vocab-parallel loss's softmax) or runs a collective (which
has no derivative) then gives a graph that misses terms: second-order gradients silently off. Such a backward
refuses there instead, before it passes any gradient on.
"""

from __future__ import annotations

import torch


def refuse_second_order(what: str, fix: str) -> None:
    """Raise, naming `what` and `fix`, when this backward runs to build a graph for second-order gradients."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"autotp: second-order gradients (a backward with create_graph=True) through {what} would miss "
            f"terms, silently; {fix}"
        )
