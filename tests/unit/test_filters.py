"""Dynamic group filters: built-ins, registration, lookup by name and by "module:function"."""

from __future__ import annotations

import pytest

from megatron_flash.rollout import filters
from megatron_flash.rollout.filters import get_filter, list_filters, register_filter


def test_none_keeps_everything() -> None:
    keep = get_filter("none")
    assert keep([0.0, 0.0, 0.0]) and keep([1.0, 0.0]) and keep([])


@pytest.mark.parametrize("rewards, kept", [
    ([1.0, 0.0, 1.0, 1.0], True),
    ([0.0, 0.0, 0.0, 0.0], False),        # all wrong: every advantage is 0
    ([1.0, 1.0, 1.0], False),             # all right: same
    ([0.5, 0.5, 0.25], True),
    ([0.1 + 0.2, 0.3], False),            # equal up to rounding: no signal
    ([7.0], False),                       # one sample has no spread
    ([], False),
])
def test_nonzero_std(rewards, kept) -> None:
    assert get_filter("nonzero_std")(rewards) is kept


def test_register_and_unknown() -> None:
    name = "test_filters_some_correct"

    @register_filter(name)
    def some_correct(rewards):
        return max(rewards) > 0

    try:
        assert get_filter(name) is some_correct and name in list_filters()
        assert get_filter(name)([0.0, 1.0]) and not get_filter(name)([0.0, 0.0])
        with pytest.raises(ValueError, match="already registered"):
            register_filter(name)(some_correct)
    finally:
        filters._FILTERS.pop(name)
    with pytest.raises(ValueError) as err:
        get_filter("nonzero")
    assert "'nonzero'" in str(err.value) and "none" in str(err.value) and "nonzero_std" in str(err.value)


def test_module_function_form() -> None:
    assert get_filter("megatron_flash.rollout.filters:nonzero_std") is get_filter("nonzero_std")
    with pytest.raises(ValueError, match="cannot import"):
        get_filter("megatron_flash.rollout.filters:no_such_filter")
