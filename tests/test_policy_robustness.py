"""Robustness: a faster SSD or PCIe link, or more host memory, never makes a policy slower.

For every policy in the registry at test time, over random small training-shaped traces
(forward, backward, optimizer; parameters, activations, gradients), random budgets and
random machine upgrades (``Hardware.scaled_links`` on all links, the host's or the SSD's;
``with_tier("host", capacity=...)``): the simulated step time on the upgraded machine is
at most the step time on the base machine. A policy that cannot fit the base machine
(``PlanError``) counts as infinitely slow there; one that fits the base machine must fit
the upgrade.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import MB, simple_hw
from tierflow import Op, TensorInfo, Trace
from tierflow.errors import PlanError
from tierflow.policies import make_plan, min_working_set, policy_names
from tierflow.simulate import simulate

# Some tiny traces would make the LP pager's step time hinge on float ties; a relative
# tolerance keeps the property about real slowdowns, not rounding.
REL_TOL = 1e-9


@st.composite
def training_traces(draw):
    """A forward pass that saves activations, a backward pass that reads them in
    reverse with the weights, and an optimizer step that updates the weights."""
    layers = draw(st.integers(1, 4))
    tensors: list[TensorInfo] = []
    ops: list[Op] = []

    def tensor(kind, persistent=False):
        tensors.append(TensorInfo(len(tensors), draw(st.integers(1, 60)) * MB, kind, persistent))
        return len(tensors) - 1

    def dur():
        return draw(st.integers(1, 30)) * 1e-3

    weights = [tensor("parameter", True) for _ in range(layers)]
    x = tensor("input")
    saved = []
    for w in weights:
        y = tensor("activation")
        ops.append(Op("fwd", "forward", dur(), (x, w), (y,)))
        saved.append(x)
        x = y
    dy = tensor("activation")
    ops.append(Op("loss", "forward", dur(), (x,), (dy,)))
    grads = []
    for w, a in zip(reversed(weights), reversed(saved)):
        g = tensor("gradient")
        dx = tensor("activation")
        ops.append(Op("bwd", "backward", dur(), (dy, a, w), (g, dx)))
        grads.append((w, g))
        dy = dx
    ops.append(Op("bwd_end", "backward", dur(), (dy,), ()))
    for w, g in grads:
        ops.append(Op("step", "optimizer", dur(), (w, g), (w,)))
    return Trace(ops, tensors, "random-training")


@st.composite
def upgrades(draw):
    """(name, function hardware -> upgraded hardware)."""
    kind = draw(st.sampled_from(["links", "host-links", "ssd-links", "host-memory"]))
    factor = draw(st.sampled_from([1.5, 2.0, 4.0, 10.0]))
    if kind == "links":
        return f"all links x{factor}", lambda hw: hw.scaled_links(factor)
    if kind == "host-links":
        return f"host links x{factor}", lambda hw: hw.scaled_links(factor, "host")
    if kind == "ssd-links":
        return f"ssd links x{factor}", lambda hw: hw.scaled_links(factor, "ssd")
    return f"host memory x{factor}", lambda hw: hw.with_tier("host", capacity=hw.tier("host").capacity * factor)


def _step(name, trace, hw, budget):
    try:
        plan = make_plan(name, trace, hw, budget=budget)
    except PlanError:
        return math.inf
    r = simulate(trace, hw, plan)
    return r.time_s if r.error is None else math.inf


@pytest.mark.parametrize("name", policy_names())
@given(data=st.data())
def test_faster_links_or_more_host_memory_never_slow_a_policy(name, data):
    trace = data.draw(training_traces(), label="trace")
    need, _ = min_working_set(trace)
    budget = data.draw(st.integers(need, max(need, trace.peak_live_bytes)), label="budget")
    base = simple_hw(
        pcie_gbps=data.draw(st.sampled_from([1.0, 4.0, 16.0]), label="pcie GB/s"),
        host_gib=data.draw(st.sampled_from([0.05, 0.2, 64.0]), label="host GiB"),
        fault_us=data.draw(st.sampled_from([0.0, 45.0]), label="fault us"),
    )
    label, upgrade = data.draw(upgrades(), label="upgrade")
    before = _step(name, trace, base, budget)
    after = _step(name, trace, upgrade(base), budget)
    assert after <= before * (1 + REL_TOL) + 1e-12, (
        f"{name}: {label} made the step slower: {before:.6f} s -> {after:.6f} s "
        f"(budget {budget} bytes, trace {trace.n_ops} ops)"
    )
