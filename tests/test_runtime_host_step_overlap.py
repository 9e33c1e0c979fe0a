"""Host-side optimizer steps executed by the runtime (``runtime/host_step.py``): plans
with :class:`~tierflow.plan.HostStep` records (``zero_offload``'s; tierflow's and the
peers' on more models are in ``test_runtime_host_step.py``) train bitwise equal to
plain PyTorch in CPU mode (losses, every gradient, final parameters, optimizer state),
within the budget, with the user's optimizer object, its ``state_dict()`` and an LR
scheduler working as without tierflow; updates start in backward where that is exact,
and wait for the step, or are refused, where it is not."""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch

from tierflow.capture import zoo
from tierflow.plan import HostStep, Plan
from tierflow.runtime import OffloadError, offload
from tierflow.runtime.host_step import update_groups

# DeepSpeed's default gradient bucket (5e8 elements) is far larger than the tiny models:
# ZeRO-Offload plans for them only with a bucket of their scale
ZERO = {"reduce_bucket_size": 1000}
GPT_BUDGET = "2.5MiB"  # ZeRO-Offload's planned peak for gpt-tiny is 2.36 MiB (activations)
STEPS = 12


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _optimizer(kind: str, params):
    params = list(params)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "sgd-foreach":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)
    raise ValueError(kind)


def _build(model: str, kind: str = "adamw"):
    m = zoo.build(model, seed=0)
    return m, _optimizer(kind, m.model.parameters())


def _loop(m, opt, batches, run=None, sched=None, micro: int = 1, at_backward=None):
    """The user's loop; losses, every step's gradients (copied where GPU code would copy
    to the host: inside ``run.untracked()``), the learning rate each step used.
    ``at_backward``: called when backward begins (from the loss's gradient hook)."""
    losses, grads, lrs = [], [], []
    for x, y in batches:
        for k in range(micro):
            xs, ys = (x, y) if micro == 1 else (x[k::micro], y[k::micro])
            loss = m.loss_fn(m.model(xs), ys)
            if at_backward is not None:
                loss.register_hook(lambda g: at_backward())
            loss.backward()
        with run.untracked() if run is not None else torch.no_grad():
            losses.append(loss.detach().clone())
            grads.append([None if p.grad is None else p.grad.clone() for p in m.model.parameters()])
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return losses, grads, lrs


def _assert_same(a, b, what: str) -> None:
    la, ga, _ = a
    lb, gb, _ = b
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        assert torch.equal(x, y), f"{what}: loss of step {i}"
    for i, (xs, ys) in enumerate(zip(ga, gb)):
        for j, (x, y) in enumerate(zip(xs, ys)):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"{what}: step {i} gradient {j}"


def _assert_same_model(m0, o0, m1, o1) -> None:
    for (n, p), q in zip(m0.model.named_parameters(), m1.model.parameters()):
        assert torch.equal(p, q), f"final parameter {n}"
    s0, s1 = o0.state_dict(), o1.state_dict()
    assert s0["param_groups"] == s1["param_groups"]
    assert s0["state"].keys() == s1["state"].keys()
    for k, st in s0["state"].items():
        assert st.keys() == s1["state"][k].keys()
        for key, v in st.items():
            w = s1["state"][k][key]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, f"optimizer state {k}.{key}"


def _pair(model: str, kind: str, budget, policy="zero_offload", tmp_path=None, steps=STEPS, batches=None,
          micro: int = 1, **options):
    m0, o0 = _build(model, kind)
    batches = batches or [m0.make_batch(4)] * steps
    ref = _loop(m0, o0, batches, micro=micro)
    m1, o1 = _build(model, kind)
    with offload(m1.model, o1, budget=budget, policy=policy, ssd_dir=tmp_path,
                 policy_options=ZERO if policy.startswith("zero") else None, **options) as run:
        got = _loop(m1, o1, batches, run, micro=micro)
    _assert_same(ref, got, f"{model} {kind} {policy}")
    _assert_same_model(m0, o0, m1, o1)
    return run, (m0, o0), (m1, o1)


def _host_stepped(run) -> None:
    s = run.stats
    assert s.plan_error is None, s.plan_error
    assert s.host_stepped_params > 0 and s.host_steps >= s.host_stepped_params * s.planned_steps
    assert s.stale_plans == 0 and s.planned_steps >= STEPS - 3
    assert s.peak_device_bytes <= s.budget_bytes
    assert s.host_step_s > 0


@pytest.mark.parametrize("model, budget", [("gpt-tiny", GPT_BUDGET), ("vit-tiny", "70%")])
def test_zero_offload_parity_within_the_budget(model, budget, tmp_path):
    """ZeRO-Offload's plan (every parameter stepped on the host): bitwise equal to plain
    PyTorch over 12 steps, peak within the budget, gradients and parameters moved."""
    run, _, _ = _pair(model, "adamw", budget, tmp_path=tmp_path)
    _host_stepped(run)
    s = run.stats
    assert s.policy == "zero_offload"
    params = list(zoo.build(model, seed=0).model.parameters())
    assert s.host_stepped_params == len(params)
    # on the host: master copies, gradient buffers, AdamW's two moments, its step counters
    assert s.host_step_bytes == 4 * sum(p.numel() * p.element_size() for p in params) + 4 * len(params)
    assert s.transfers["device->host"] > 0 and s.transfers["host->device"] > 0


@pytest.mark.parametrize("kind", ["adamw-foreach", "adamw-fused", "sgd-foreach"])
def test_zero_offload_foreach_and_fused_optimizers(kind):
    """The host runs the optimizer's own foreach/fused code for each parameter: still
    bitwise equal (those kernels are elementwise per tensor)."""
    run, _, _ = _pair("gpt-tiny", kind, GPT_BUDGET)
    _host_stepped(run)


def test_the_model_and_optimizer_are_whole_after_the_block():
    """After the block the optimizer's state is back where it was (device tensors, not
    the host copies), and training on without tierflow stays bitwise equal."""
    run, (m0, o0), (m1, o1) = _pair("gpt-tiny", "adamw", GPT_BUDGET)
    assert run.stats.host_steps > 0
    for st in o1.state.values():
        for v in st.values():
            assert not isinstance(v, torch.Tensor) or id(v) not in run._host_held
    batch = [m0.make_batch(4)] * 2
    _assert_same(_loop(m0, o0, batch), _loop(m1, o1, batch), "after the block")
    _assert_same_model(m0, o0, m1, o1)


def test_state_dict_round_trip_and_lr_scheduler_inside_the_block():
    """``state_dict()`` inside the block equals plain PyTorch's at the same step;
    ``load_state_dict()`` of it (device tensors back in the optimizer) is taken up by the
    next host updates; a StepLR's learning rates are the plain run's."""
    m0, o0 = _build("gpt-tiny")
    s0 = torch.optim.lr_scheduler.StepLR(o0, step_size=3, gamma=0.5)
    batches = [m0.make_batch(4)] * STEPS
    ref_a = _loop(m0, o0, batches[:6], sched=s0)
    sd0 = copy.deepcopy(o0.state_dict())
    o0.load_state_dict(copy.deepcopy(sd0))
    ref_b = _loop(m0, o0, batches[6:], sched=s0)

    m1, o1 = _build("gpt-tiny")
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=3, gamma=0.5)
    with offload(m1.model, o1, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO) as run:
        got_a = _loop(m1, o1, batches[:6], run, sched=s1)
        with run.untracked():  # (a copy kept for the check below: not the budget's)
            sd1 = copy.deepcopy(o1.state_dict())
        held = run.stats.host_steps
        o1.load_state_dict(copy.deepcopy(sd1))
        got_b = _loop(m1, o1, batches[6:], run, sched=s1)
    assert held > 0 and run.stats.host_steps > held  # host steps before and after the reload
    assert run.stats.stale_plans == 0
    for k, st in sd0["state"].items():
        for key, v in st.items():
            assert torch.equal(v, sd1["state"][k][key]), f"state_dict() inside the block: {k}.{key}"
    assert sd0["param_groups"] == sd1["param_groups"]
    _assert_same(ref_a, got_a, "before the reload")
    _assert_same(ref_b, got_b, "after the reload")
    assert ref_a[2] + ref_b[2] == got_a[2] + got_b[2]  # the learning rate of every step
    assert len(set(got_a[2] + got_b[2])) == 4  # (StepLR halved it three times)
    _assert_same_model(m0, o0, m1, o1)


def test_a_new_signature_mid_run_keeps_host_steps_exact(tmp_path):
    """A batch of another shape mid-run: a new signature (runtime/signatures.py), so the
    host steps are given up, that iteration is profiled and planned; the long batches
    come back to their cached plan, whose host steps are taken up again; every step
    bitwise equal."""
    g = zoo.build("gpt-tiny", seed=0).make_batch
    long, short = g(4, 32), g(4, 16)
    batches = [long] * 5 + [short] + [long] * 6
    run, _, _ = _pair("gpt-tiny", "adamw", GPT_BUDGET, tmp_path=tmp_path, batches=batches)
    s = run.stats
    assert s.stale_plans == 0 and s.plans_by_reason == {"first": 1, "new signature": 1}
    assert s.signature_hits == 1 and s.step_kinds[-6:] == ["planned"] * 6
    assert s.host_steps > 0 and s.host_stepped_params > 0
    assert s.peak_device_bytes <= s.budget_bytes


def test_gradient_accumulation_updates_once_per_step():
    """Two backward passes per optimizer step: the host update starts after the last
    one (the first pass's gradient hook is an earlier write), once."""
    run, _, _ = _pair("gpt-tiny", "adamw", GPT_BUDGET, micro=2)
    s = run.stats
    assert s.stale_plans == 0 and s.host_steps >= s.host_stepped_params * s.planned_steps > 0
    assert s.host_steps == s.host_stepped_params * (s.planned_steps + s.steps - s.planned_steps - s.profiled_steps)


def test_a_parameter_written_between_steps_is_updated_from_its_new_value():
    """Writing a host-stepped parameter between steps (a checkpoint restored, weights
    clipped), inside ``untracked()`` or not: its host update starts from the new value."""
    def run_loop(m, opt, batches, run=None):
        losses = []
        for i, (x, y) in enumerate(batches):
            loss = m.loss_fn(m.model(x), y)
            loss.backward()
            losses.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
            p = next(m.model.parameters())
            with torch.no_grad(), (run.untracked() if run is not None and i % 2 else contextlib.nullcontext()):
                p.mul_(0.5)
        return losses

    m0, o0 = _build("gpt-tiny")
    batches = [m0.make_batch(4)] * 8
    ref = run_loop(m0, o0, batches)
    m1, o1 = _build("gpt-tiny")
    with offload(m1.model, o1, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO) as run:
        got = run_loop(m1, o1, batches, run)
    assert run.stats.host_steps > 0 and run.stats.stale_plans == 0
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    _assert_same_model(m0, o0, m1, o1)


def _clipped(m, opt, batches, clip_every: int):
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = m.loss_fn(m.model(x), y)
        loss.backward()
        if i % clip_every == 0:
            torch.nn.utils.clip_grad_norm_(m.model.parameters(), 0.05)
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    return losses


def _loop_pair(loop, every: int, **kw):
    """A user ``loop`` (one of those above) run plain and under ZeRO-Offload's plan on
    gpt-tiny: the run, both results, both (model, optimizer) pairs."""
    m0, o0 = _build("gpt-tiny")
    batches = [m0.make_batch(4)] * STEPS
    ref = loop(m0, o0, batches, every)
    m1, o1 = _build("gpt-tiny")
    with offload(m1.model, o1, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO, **kw) as run:
        got = loop(m1, o1, batches, every)
    return run, ref, got, (m0, o0), (m1, o1)


def _clip_pair(clip_every: int, **kw):
    return _loop_pair(_clipped, clip_every, **kw)


def test_gradients_clipped_every_step_are_updated_clipped():
    """Clipping after backward on every step (the profile saw it): no update starts in
    backward; they start when the step runs, with the clipped gradients; bitwise equal."""
    run, ref, got, a, b = _clip_pair(1)
    assert run.stats.host_steps > 0 and run.stats.stale_plans == 0
    assert run.stats.host_steps_in_backward == 0  # (the trace reads every gradient after backward)
    assert all(torch.equal(x, y) for x, y in zip(ref, got))
    _assert_same_model(*a, *b)


def test_gradients_clipped_on_some_steps_only():
    """Clipping on some steps only: updates begun in backward would miss it; the run
    says so (OffloadError); with ``host_step_overlap=False`` updates wait for the step
    and training is bitwise equal."""
    with pytest.raises(OffloadError, match="changed after backward"):
        _clip_pair(5)
    run, ref, got, a, b = _clip_pair(5, host_step_overlap=False)
    assert run.stats.host_steps > 0
    assert all(torch.equal(x, y) for x, y in zip(ref, got))
    _assert_same_model(*a, *b)


class _Witnessed(torch.optim.AdamW):
    """AdamW as users subclass it (its step calls ``super().step()``) that notes when a
    step begins on another thread than the main one: a host update (the runtime runs
    the class's own step for it on its worker thread)."""

    def step(self, closure=None):
        began = self.__dict__.get("began")  # (a host update's stand-in shares the dict)
        if began is not None and threading.current_thread() is not threading.main_thread():
            began.set()
        return super().step(closure)


def _peeking(m, opt, batches, read_every: int):
    """A loop that reads every parameter between ``backward()`` and ``step()`` (a weight
    norm logged, an average kept) every ``read_every`` steps: losses and what it read."""
    losses, reads = [], []
    for i, (x, y) in enumerate(batches):
        loss = m.loss_fn(m.model(x), y)
        loss.backward()
        if i % read_every == 0:
            with torch.no_grad():
                reads.append(torch.stack([p.sum() for p in m.model.parameters()]))
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    return losses, reads


def _peek_pair(read_every: int, **kw):
    return _loop_pair(_peeking, read_every, **kw)


@pytest.mark.parametrize("overlap", [True, False])
def test_parameters_read_before_the_step_every_step_are_their_old_values(overlap):
    """Parameters read between ``backward()`` and ``step()`` on every step (the profile
    saw it): the reads see the values before the update (no update starts in
    backward; a parameter fetched back for the read is dropped again when its update
    starts), and training is bitwise equal."""
    run, (l0, r0), (l1, r1), a, b = _peek_pair(1, host_step_overlap=overlap)
    assert run.stats.host_steps > 0 and run.stats.stale_plans == 0
    assert run.stats.host_steps_in_backward == 0
    assert all(torch.equal(x, y) for x, y in zip(r0, r1)), "what the loop read"
    assert all(torch.equal(x, y) for x, y in zip(l0, l1))
    _assert_same_model(*a, *b)


def test_parameters_read_before_the_step_on_some_steps_only():
    """Read on some steps only: an update begun in backward has already changed the
    parameter the loop reads, so the run says so (OffloadError) instead of handing it
    the new value; with ``host_step_overlap=False`` the reads and training are exact."""
    with pytest.raises(OffloadError, match="were read between backward"):
        _peek_pair(5)
    run, (l0, r0), (l1, r1), a, b = _peek_pair(5, host_step_overlap=False)
    assert run.stats.host_steps > 0
    assert all(torch.equal(x, y) for x, y in zip(r0, r1)) and all(torch.equal(x, y) for x, y in zip(l0, l1))
    _assert_same_model(*a, *b)


def test_optimizer_state_dict_between_backward_and_step_is_refused_once_updates_began():
    """``state_dict()`` between ``backward()`` and ``step()`` after updates began in
    backward would show some parameters' state updated: refused (OffloadError); with
    ``host_step_overlap=False`` it is plain PyTorch's, before the step."""
    def loop(m, opt, batches):
        sds = []
        for x, y in batches:
            m.loss_fn(m.model(x), y).backward()
            with torch.no_grad():  # (clones: tensors the runtime holds away come back for them)
                sds.append({i: {n: v.clone() for n, v in st.items()} for i, st in opt.state_dict()["state"].items()})
            opt.step()
            opt.zero_grad()
        return sds

    m0, o0 = _build("gpt-tiny")
    batches = [m0.make_batch(4)] * 6
    ref = loop(m0, o0, batches)
    m1, o1 = _build("gpt-tiny")
    with pytest.raises(OffloadError, match="state read or loaded between backward"):
        with offload(m1.model, o1, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO):
            loop(m1, o1, batches)
    m2, o2 = _build("gpt-tiny")
    with offload(m2.model, o2, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO,
                 host_step_overlap=False) as run:
        got = loop(m2, o2, batches)
    assert run.stats.host_steps > 0
    for a, b in zip(ref, got):
        assert a.keys() == b.keys()
        for k, st in a.items():
            assert all(torch.equal(v, b[k][n]) for n, v in st.items())
    _assert_same_model(m0, o0, m2, o2)


def test_updates_start_before_backward_ends_and_stay_bitwise():
    """The overlap happens: with ZeRO-Offload's plan on gpt-tiny, on every planned step
    a host update has begun on the worker thread before backward returns (observed in
    order, no timing: backward's last callback waits for the update to begin, and fails
    the test if none does), and 12 steps are bitwise equal to plain PyTorch."""
    m0, o0 = _build("gpt-tiny")
    batches = [m0.make_batch(4)] * STEPS
    ref = _loop(m0, o0, batches)
    m1 = zoo.build("gpt-tiny", seed=0)
    o1 = _Witnessed(m1.model.parameters(), lr=1e-3)
    began = o1.began = threading.Event()
    seen: list[tuple[int, bool]] = []  # per backward: updates started from hooks, one began before its end

    def at_backward_end():  # (backward's last callback: every gradient hook has run)
        started = run.stats.host_steps_in_backward - sum(n for n, _ in seen)
        seen.append((started, began.wait(60) if started else began.is_set()))

    def at_backward():  # (the last step's updates all ended in its step(): none runs now)
        began.clear()
        torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)

    with offload(m1.model, o1, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO) as run:
        got = _loop(m1, o1, batches, run, at_backward=at_backward)
    _assert_same(ref, got, "updates begun in backward")
    _assert_same_model(m0, o0, m1, o1)
    _host_stepped(run)
    s = run.stats
    overlapped = [ok for n, ok in seen if n]
    assert len(overlapped) >= s.planned_steps - 1 > 0 and all(overlapped), seen
    assert s.host_steps_in_backward >= s.host_stepped_params * (s.planned_steps - 1)


def test_an_optimizer_subclass_calling_super_step_steps_once():
    """A user's optimizer class whose step calls ``super().step()`` runs the step hooks
    twice per step (both classes' steps are wrapped by ``Optimizer``): the host updates
    run its step without them and each parameter is updated once per step, bitwise; the
    user's own hooks run as often as in plain PyTorch."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # (AdamW's step is wrapped from the first AdamW made)

    def trained(run_kw):
        m = zoo.build("gpt-tiny", seed=0)
        opt = _Witnessed(m.model.parameters(), lr=1e-3)
        calls = []
        opt.register_step_post_hook(lambda *a: calls.append(1))
        batches = [m.make_batch(4)] * 8
        with offload(m.model, opt, **run_kw) if run_kw else contextlib.nullcontext() as run:
            out = _loop(m, opt, batches, run)
        return (m, opt), out, len(calls), run

    a, ref, ref_calls, _ = trained(None)
    b, got, calls, run = trained(dict(budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO))
    _assert_same(ref, got, "subclass")
    _assert_same_model(*a, *b)
    assert calls == ref_calls == 16
    s = run.stats
    assert s.host_steps > 0 and s.host_steps == s.host_stepped_params * (s.steps - s.profiled_steps)


def _retuned(m, opt, batches, at: int):
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = m.loss_fn(m.model(x), y)
        loss.backward()
        if i == at:  # the learning rate set between backward() and step(), once
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 0.5
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    return losses


def test_a_learning_rate_changed_after_backward_is_refused_or_waited_for():
    """An LR changed between ``backward()`` and ``step()`` on one step: updates begun in
    backward used the old one, so the run says so (OffloadError) instead of differing
    from plain PyTorch; with ``host_step_overlap=False`` every update waits for the step
    and training is bitwise equal."""
    m0, o0 = _build("gpt-tiny")
    batches = [m0.make_batch(4)] * STEPS
    ref = _retuned(m0, o0, batches, at=6)
    m1, o1 = _build("gpt-tiny")
    with pytest.raises(OffloadError, match="settings .* were changed between backward"):
        with offload(m1.model, o1, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO):
            _retuned(m1, o1, batches, at=6)
    m2, o2 = _build("gpt-tiny")
    with offload(m2.model, o2, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO,
                 host_step_overlap=False) as run:
        got = _retuned(m2, o2, batches, at=6)
    assert run.stats.host_steps > 0
    assert all(torch.equal(x, y) for x, y in zip(ref, got))
    _assert_same_model(m0, o0, m2, o2)


def test_without_overlap_gradients_still_leave_in_backward():
    """``host_step_overlap=False``: no update starts in backward, but gradients still go
    to the host as backward makes them: the same device peak as with overlap, bitwise."""
    with_overlap, _, _ = _pair("gpt-tiny", "adamw", GPT_BUDGET)
    run, _, _ = _pair("gpt-tiny", "adamw", GPT_BUDGET, host_step_overlap=False)
    _host_stepped(run)
    assert run.stats.host_steps_in_backward == 0 < with_overlap.stats.host_steps_in_backward
    assert run.stats.peak_device_bytes == with_overlap.stats.peak_device_bytes


def test_update_groups_give_each_parameter_its_whole_update():
    """Single-tensor AdamW in CPU mode: each parameter's unit holds every optimizer op
    of its update, its step counter's (a unit of state alone) included."""
    m, o = _build("gpt-tiny")
    x, y = m.make_batch(4)
    with offload(m.model, o, budget=None, policy="lru") as run:
        for _ in range(2):
            m.loss_fn(m.model(x), y).backward()
            o.step()
            o.zero_grad()
    trace = run.trace
    units = update_groups(trace)
    names = [n for n, _ in m.model.named_parameters()]
    assert sorted(tuple(sorted(n)) for _, n in units) == sorted((n,) for n in names)
    covered = sorted(o for unit, _ in units for o in unit)
    assert covered == [i for i, op in enumerate(trace.ops) if op.phase == "optimizer"]
    for unit, (name,) in ((u, tuple(n)) for u, n in units):
        keys = {trace.tensors[t].key for o in unit for t in trace.op_tensors[o]}
        assert {f"param:{name}", f"grad:{name}", f"opt:{name}:step", f"opt:{name}:exp_avg"} <= keys


class _FailsOnTheHost(torch.optim.SGD):
    """SGD that refuses to step a tensor that is not a model parameter (the host's
    master copies are plain tensors)."""

    def step(self, closure=None):
        for g in self.param_groups:
            if any(not isinstance(p, torch.nn.Parameter) for p in g["params"]):
                raise RuntimeError("no host for me")
        return super().step(closure)


def test_a_failing_host_update_is_reported_with_the_parameter():
    m = zoo.build("gpt-tiny", seed=0)
    opt = _FailsOnTheHost(m.model.parameters(), lr=1e-2, momentum=0.9)
    x, y = m.make_batch(4)

    def plan_all(trace, hw, budget):  # every parameter's whole unit on the host
        steps = []
        for unit, names in update_groups(trace):
            if not names:  # (the profiler range super().step() opens: no parameter's)
                continue
            (name,) = names
            ids = {trace.tensors[t].key: t for o in unit for t in trace.op_tensors[o]}
            steps.append(HostStep(ids[f"param:{name}"], ids[f"grad:{name}"],
                                  tuple(t for k, t in ids.items() if k and k.startswith("opt:")), tuple(unit)))
        return Plan("all-on-host", budget_bytes=budget, host_steps=tuple(steps))

    with pytest.raises(OffloadError, match=r"host step of .* failed: RuntimeError: no host for me"):
        with offload(m.model, opt, budget=None, policy=plan_all):
            for _ in range(4):
                m.loss_fn(m.model(x), y).backward()
                opt.step()
                opt.zero_grad()
    for p in m.model.parameters():  # the block brought every parameter back whole
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_update_is_the_cpu_kernel_within_tolerance():
    """On CUDA the host update is the CPU kernel: equal to the CUDA step up to rounding.
    AdamW's update is a few fp32 operations per element; 12 steps stay within
    rtol 1e-5, atol 1e-7 of plain CUDA training (losses and parameters)."""
    m0 = zoo.build("gpt-tiny", device="cuda", seed=0)
    o0 = torch.optim.AdamW(m0.model.parameters(), lr=1e-3)
    batches = [m0.make_batch(4)] * STEPS
    ref = _loop(m0, o0, batches)
    m1 = zoo.build("gpt-tiny", device="cuda", seed=0)
    o1 = torch.optim.AdamW(m1.model.parameters(), lr=1e-3)
    with offload(m1.model, o1, budget=GPT_BUDGET, policy="zero_offload", policy_options=ZERO) as run:
        got = _loop(m1, o1, batches, run)
    assert run.stats.host_steps > 0
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for p, q in zip(m0.model.parameters(), m1.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
