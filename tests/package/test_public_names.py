"""The mission's public names stay, and say what they are on their first line (DeepSpeed's names, Megatron's terms)."""

from __future__ import annotations

import pytest

import autotp


@pytest.mark.parametrize(
    "name, words",
    [
        ("LinearLayer", ["column-parallel"]),
        ("LinearAllreduce", ["row-parallel"]),
        ("GatherReplacedLayerParams", ["column-parallel", "row-parallel"]),
    ],
)
def test_the_layers_and_the_gather_keep_their_names_and_say_column_or_row_parallel_first(
    name: str, words: list[str]
) -> None:
    assert name in autotp.__all__
    first_line = getattr(autotp, name).__doc__.splitlines()[0].lower()
    assert all(word in first_line for word in words), first_line
