"""One reading of ``budget=`` for the eager runtime, the compiled front-end and the planner."""

import pytest

from helpers import chain_trace, simple_hw
from tierflow.budget import Budget, InvalidBudgetError
from tierflow.errors import PolicyError


@pytest.mark.parametrize("given, share", [("50%", 0.5), (" 30% ", 0.3), (0.5, 0.5), (1.0, 1.0), ("150%", 1.5)])
def test_shares(given, share):
    assert Budget.parse(given) == Budget(share=share)


@pytest.mark.parametrize("given, size", [(4096, 4096), ("2GiB", 2 << 30), ("512MB", 512_000_000), (4e9, 4_000_000_000), ("4096", 4096)])
def test_sizes(given, size):
    assert Budget.parse(given) == Budget(bytes=size)


def test_none_is_no_budget():
    assert Budget.parse(None) == Budget()


@pytest.mark.parametrize("given", ["0%", "-5%", "lots%", "lots", 0, -3, 0.0, -0.5, float("nan"), float("inf"), True, [1]])
def test_bad_budgets_are_refused_quoting_the_value(given):
    with pytest.raises(InvalidBudgetError, match="budget") as e:
        Budget.parse(given)
    assert repr(given) in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, PolicyError)


def test_the_planner_and_the_eager_runtime_read_a_budget_alike():
    # the eager runtime, the planner and the compiled front-end share one parser: a float
    # share and a string share are one budget everywhere
    from tierflow.policies import resolve_budget
    from tierflow.runtime.executor import _budget_spec

    assert _budget_spec(0.3) == _budget_spec("30%") == (None, 0.3)
    assert _budget_spec("1KiB") == (1024.0, None)
    trace, hw = chain_trace(), simple_hw()
    assert resolve_budget(trace, hw, 1.0) == resolve_budget(trace, hw, "100%") == trace.peak_live_bytes
    with pytest.raises(InvalidBudgetError, match="'lots'"):
        resolve_budget(trace, hw, "lots")
