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
    assert WrapOptions(tp_size=2, cp_size=3).sizes() == {"tp": 2, "cp": 3, "ep": 1}


@pytest.mark.parametrize("entry", ["wrap", "explain"])
def test_an_unknown_keyword_is_refused_naming_it_and_the_options(entry: str) -> None:
    model = tiny_model("llama")
    with pytest.raises(TypeError) as err:
        getattr(autotp, entry)(model, 1, cp_sise=2)
    message = str(err.value)
    assert f"{entry}() got an unexpected keyword argument 'cp_sise' (did you mean 'cp_size'?)" in message
    assert all(name in message for name in OPTION_NAMES)
    assert autotp.state.find_state(model) is None
