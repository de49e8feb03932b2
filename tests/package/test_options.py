"""The entry points' options come from one source, `autotp.options.WrapOptions`: `WrapKwargs` (their static type) has
its fields, every entry point takes them, and a keyword that is none of them is refused by name."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import get_type_hints

import pytest

import autotp
from autotp import options as options_module
from autotp.options import OPTION_NAMES, WrapKwargs, WrapOptions
from autotp.testing import run_ranks
from models import tiny_model


def test_wrap_kwargs_has_every_field_of_wrap_options_but_tp_size_with_its_type() -> None:
    dataclass_types = get_type_hints(WrapOptions, vars(options_module))
    kwargs_types = get_type_hints(WrapKwargs, vars(options_module))
    assert list(kwargs_types) == [f.name for f in fields(WrapOptions) if f.name != "tp_size"] == list(OPTION_NAMES)
    assert kwargs_types == {name: dataclass_types[name] for name in kwargs_types}
    assert not WrapKwargs.__required_keys__  # every option has WrapOptions' default


def test_the_entry_points_signatures_show_each_option_with_its_dataclass_default() -> None:
    defaults = {f.name: f.default for f in fields(WrapOptions)}
    for entry in autotp.wrap, autotp.explain, autotp.from_pretrained:
        parameters = inspect.signature(entry).parameters
        shown = {name: p.default for name, p in parameters.items() if name in OPTION_NAMES}
        assert shown == {name: defaults[name] for name in OPTION_NAMES}, entry.__name__
        assert [p.kind for p in parameters.values()][:2] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2


def test_tp_size_is_taken_positionally_or_by_keyword_and_is_the_options_field() -> None:
    model = tiny_model("llama")
    by_position, by_keyword = autotp.explain(model, 1), autotp.explain(model, tp_size=1, vocab_parallel=False)
    assert by_position.tp_size == by_keyword.tp_size == 1
    sizes = WrapOptions(tp_size=2, cp_size=3).sizes()
    assert list(sizes)[:2] == ["tp", "cp"] and sizes["tp"] == 2 and sizes["cp"] == 3
    assert {"ep"} <= set(sizes) and all(n == 1 for axis, n in sizes.items() if axis not in ("tp", "cp"))


@pytest.mark.parametrize("entry", ["wrap", "explain"])
def test_an_unknown_keyword_is_refused_naming_it_and_the_options(entry: str) -> None:
    model = tiny_model("llama")
    with pytest.raises(TypeError) as err:
        getattr(autotp, entry)(model, 1, cp_sise=2)
    message = str(err.value)
    assert f"{entry}() got an unexpected keyword argument 'cp_sise' (did you mean 'cp_size'?)" in message
    assert all(name in message for name in OPTION_NAMES)
    assert autotp.state.find_state(model) is None


def test_the_generic_accessors_read_the_mesh_and_the_named_ones_are_their_aliases() -> None:
    """At tp_size 1 without torch.distributed: every group None, every rank 0 and size 1, whichever way asked."""
    model = autotp.wrap(tiny_model("llama"), 1)
    for axis in "tp", "cp", "dp", "ep":
        named = [getattr(autotp, f"{axis}_{kind}")(model) for kind in ("group", "rank", "size")]
        assert named == [autotp.group(model, axis), autotp.rank(model, axis), autotp.size(model, axis)]
        assert named == [autotp.group(axis), autotp.rank(axis), autotp.size(axis)] == [None, 0, 1]
    assert autotp.dp_cp_group(model) is autotp.group(model, "dp", "cp") is None


@pytest.mark.parametrize("axes", [("xp",), ("vp",), (), ("cp", "dp")])
def test_an_unknown_axis_is_refused_naming_the_valid_ones(axes: tuple[str, ...]) -> None:
    model = autotp.wrap(tiny_model("llama"), 1)
    for accessor in autotp.group, autotp.rank, autotp.size:
        with pytest.raises(ValueError) as err:
            accessor(model, *axes)
        assert all(f"'{name}'" in str(err.value) for name in ("pp", "dp", "cp", "tp", "ep")), str(err.value)


def accessor_answers(rank: int, world: int) -> dict:
    import torch.distributed as dist

    model = autotp.wrap(tiny_model("llama"), world)
    mesh = model.autotp_state.mesh
    return {
        "tp": (
            dist.get_process_group_ranks(autotp.group(model, "tp")),
            autotp.rank("tp"),
            autotp.size("tp"),
            autotp.tp_rank(model),
        ),
        "dp": (autotp.size(model, "dp"), autotp.dp_size(), autotp.size(model, "dp", "cp")),
        "compared": [
            (label, None if group is None else dist.get_process_group_ranks(group)) for label, group in mesh.compared()
        ],
        "repr": repr(mesh),
    }


@pytest.mark.timeout(60)
def test_the_accessors_and_the_mesh_table_on_two_ranks() -> None:
    """tp 2 on 2 ranks: the TP group is both ranks; the agreement compares over TP, CP, DP (DP x CP) and EP in that
    order, as `autotp.api` listed them by hand before."""
    for rank, answer in enumerate(run_ranks(accessor_answers, 2)):
        assert answer["tp"] == ([0, 1], rank, 2, rank)
        assert answer["dp"] == (1, 1, 1)
        known = {"TP": [0, 1], "CP": None, "DP": [rank], "EP": None}  # any other axis: size 1 here, so no group
        assert [label for label, _ in answer["compared"] if label in known] == ["TP", "CP", "DP", "EP"]
        assert all(ranks == known.get(label) for label, ranks in answer["compared"]), answer["compared"]
        assert answer["repr"].startswith("Mesh(pp=1, dp=1, cp=1, ") and answer["repr"].endswith("tp=2, ep=1)")
        shown = dict(item.split("=") for item in answer["repr"].removeprefix("Mesh(").removesuffix(")").split(", "))
        assert all(n == "1" for axis, n in shown.items() if axis != "tp"), shown
