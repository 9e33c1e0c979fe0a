"""``tierflow`` with all three levers: keep, move to any tier, recompute, host step.

How the levers are chosen together (:func:`plan_joint`):

1. **Candidates** (:mod:`.levers`): every activation forward makes and backward reads
   again that pure forward ops can re-create (its *recompute option*: chain, compute
   seconds, bytes), and every unit of optimizer work that can run on the host (its
   *host-step option*: gradient bytes down, parameter bytes up, host bytes processed,
   device time and optimizer state freed).
2. **Variants.** Host-step sets (none; every unit, where the hardware says what the host
   computes) with a ladder of recompute prices:
   an option is worth taking where it frees bytes faster, per second of compute, than
   ``m`` times the fastest link carries them, for ``m`` in ``_LADDER`` (16, 4, 1; no
   recompute beside host steps). For each, :func:`.levers.choose_recomputes` takes
   options cheapest per byte first where the live curve (what the host steps leave) is
   still over the budget, so recompute goes only where memory is short and only as far
   as it is; the movers then carry what is left. Each price is tried twice: with a
   tensor that a taken chain reads while dropped re-made early for it; at the best
   price, also with such tensors skipped (fewer re-run ops, more left to the movers; on
   gpt2-large b8 that won at 4x before the loop), and with every host step beside it
   and beside the next cheaper price (host steps free memory for the whole iteration,
   so less recompute may do). Each variant is lowered
   (:func:`.levers.lower`: the trace as those levers leave it), planned with
   tierflow's own greedy pass (:func:`.greedy.greedy_moves`) and simulated.
3. **Closed loop.** The best variants by that score (at most ``_LOOPS``, each only
   where it can still win: see :func:`plan_joint`) get the whole move-only pipeline
   (:func:`.moves.plan_moves`: portfolio seeds and the simulator-driven repairs) on
   their lowered trace, and the best plan is mapped back to the original trace's ids
   with the recompute and host-step records. On traces small enough for the work
   budget (G10's workloads) the move-only pipeline also runs on the original trace and
   the faster plan wins, so the levers never cost a plan that moving alone had.
4. **Peers as seeds.** The plans of the peers users run today (checkpointing,
   ZeRO-Offload, ...: ``_PEERS``, each where it can plan and this machine can run it,
   see :func:`_peer_seeds`) are simulated on the original trace and compete too; where
   one leads, the repair loop (:mod:`.loop`) repairs it, so tierflow is never behind a
   peer by construction.

Scoring. A variant is scored by the simulator on the *lowered* trace, whose re-run
ops are real ops on the compute stream (their time and their outputs' memory counted
as the simulator counts any op's); ``LEVERS_SIMULATED`` switches to simulating the
mapped-back plan itself once the simulator prices ``Recompute`` and ``HostStep``
records (until then host-step variants are not offered: the lowered trace cannot price
their link traffic and host time).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from ...errors import PlanError, PolicyError, SimulationError
from ...hardware import Hardware
from ...plan import Plan, validate
from ...trace import Trace
from .. import PolicyOptions, get_policy, policy_names
from .greedy import DEFAULT_KNOBS, greedy_moves
from .levers import (
    Lowered,
    choose_recomputes,
    group,
    host_step_options,
    lower,
    recompute_options,
    reserve_for_moves,
)
from .loop import gains, improve, improve_targeted, simulate_score
from .moves import WORK_OPS, plan_moves

# Recompute prices tried, as multiples of the fastest link's bandwidth: an option is
# taken if it frees bytes at least this many times faster per second of compute than
# that link moves them (no recompute is tried only beside host steps; 0 would be
# any price: it never won on the zoo rows or G10's workloads, and cost a variant each).
_LADDER: tuple[float, ...] = (16.0, 4.0, 1.0)

# Link room left to moves, in forward passes' worth of one-way bytes (see plan_joint).
_RESERVES = (0.5, 1.0)

# At most this many variants get the closed loop (see plan_joint).
_LOOPS = 2

# A variant gets the loop only if its lowered ideal is this much below the best step so
# far (on llama-7b the second loop, 4 s, could at most have gained 0.1%).
_LOOP_MARGIN = 0.005

# ... and only if its own pass is within this factor of the best step so far: the loop
# took gpt2-large b8's 16x variant 13% down (0.806 -> 0.703 s) and gpt2-xl b16's
# variant that leaves a forward pass of bytes to the links 23% (3.49 -> 2.68 s); on
# gpt2-xl b16 a loop on a variant 81% behind gained nothing.
_LOOP_REACH = 1.3

# Whether the simulator prices Recompute and HostStep records (then plans are scored as
# mapped back; see the module docstring).
LEVERS_SIMULATED = True

# Traces the work budget buys this many simulations of also get the move-only pipeline
# on the original trace (see step 3).
_BOTH_PIPELINES = 28


@dataclasses.dataclass
class _Variant:
    label: str
    lowered: Lowered
    score: float
    plan: Plan  # on the lowered trace


def _score(lowered: Lowered, hw: Hardware, plan: Plan) -> float:
    """Simulated step of a plan made on the lowered trace (see the module docstring)."""
    if LEVERS_SIMULATED:
        if plan.reactive and (lowered.recomputes or lowered.host_steps):
            return float("inf")  # a demand pager's hints cannot carry the levers' records
        try:
            return simulate_score(lowered.original, hw, lowered.plan(plan))[0]
        except PlanError:
            return float("inf")
    return simulate_score(lowered.trace, hw, plan)[0]


def _over_original(lowered: Lowered, budget: float) -> np.ndarray:
    """Bytes over the budget per original op, as the lowered trace's live curve has them
    (0 at ops the levers removed)."""
    over = np.zeros(lowered.original.n_ops)
    keep = lowered.op_of >= 0
    over[lowered.op_of[keep]] = lowered.trace.live_bytes[keep] - budget
    return over


def plan_joint(trace: Trace, hw: Hardware, options: PolicyOptions, move_plan: Plan | None = None) -> Plan:
    """tierflow's plan with all levers (see the module docstring).

    Args:
        trace, hw, options: as for any policy.
        move_plan: the move-only pipeline's plan for ``trace``, if already made (it
            competes on traces small enough, see ``_BOTH_PIPELINES``).
    """
    t0, c0 = time.perf_counter(), time.process_time()
    opts = dict(options.extra or {})
    budget = options.budget_bytes
    ideal = trace.ideal_s * (1 + 1e-9)
    per = int(opts.get("work_ops", WORK_OPS)) // max(trace.n_ops, 1)
    if move_plan is None and per >= _BOTH_PIPELINES:
        move_plan = plan_moves(trace, hw, options)
    if move_plan is not None and move_plan.meta.get("predicted_step_s", float("inf")) <= ideal:
        return move_plan
    rec_opts = recompute_options(trace)
    hs_opts = host_step_options(trace, hw) if LEVERS_SIMULATED else []
    if not rec_opts and not hs_opts:
        return move_plan if move_plan is not None else plan_moves(trace, hw, options)
    routes = [hw.route_bandwidth(hw.device, t) for t in hw.offload_tiers]
    bw = max(routes) if routes else 1.0
    variants: list[_Variant] = []
    seen: set[tuple] = set()
    c_v0 = time.process_time()
    def variant(hs: tuple, mult: float | None, early: bool = True, reserve: float = 0.0) -> _Variant | None:
        over = overs.setdefault(len(hs), _over_original(lower(trace, (), hs), budget))
        if mult is None:
            chosen = []
        else:
            limit = float("inf") if mult == 0 else 1.0 / (mult * bw)
            opts_, over_ = rec_opts, over
            if reserve:
                kept, nbytes = reserve_for_moves(trace, rec_opts, reserve * bw * forward_s, bw)
                opts_, over_ = [o for o in rec_opts if o.tensor not in kept], over - nbytes
            chosen = choose_recomputes(trace, opts_, over_, limit, remake_early=early)
        key = (len(hs), tuple((o.tensor, o.before_op) for o in chosen))
        if key in seen or (not hs and not chosen):
            return None
        seen.add(key)
        low = lower(trace, group(chosen, trace), hs)
        plan = Plan("tierflow", greedy_moves(low.trace, hw, budget, DEFAULT_KNOBS, opts), budget_bytes=budget)
        score = _score(low, hw, plan)  # inf where it does not validate (no fallback:
        # a variant the own pass cannot fit loses; moving alone is the fallback)
        price = "none" if mult is None else ("any" if mult == 0 else f"{mult:g}x")
        label = f"host steps {len(hs)}, recompute {price}{'' if early else ', read-dropped skipped'}"
        if reserve:
            label += f", links keep {reserve:g} forward pass"
        v = _Variant(label, low, score, plan)
        variants.append(v)
        return v

    overs: dict[int, np.ndarray] = {}
    forward_s = float(sum(o.duration_s for o in trace.ops if o.phase == "forward"))
    # the price ladder without host steps, then at its best price: read-dropped tensors
    # skipped, and every host step with that recompute and with none
    best_mult = None
    for mult in _LADDER:
        v = variant((), mult)
        if v is not None and (best_mult is None or v.score < best_mult[0]):
            best_mult = (v.score, mult)
    if best_mult is not None:
        variant((), best_mult[1], early=False)
    if hs_opts:
        if best_mult is None:
            variant(tuple(hs_opts), None)
        else:
            # host steps free memory for the whole iteration: beside them, the best
            # price and the next cheaper one (less recompute) are worth trying
            variant(tuple(hs_opts), best_mult[1])
            cheaper = [m for m in _LADDER if m > best_mult[1]]
            if cheaper:
                variant(tuple(hs_opts), min(cheaper))
    # the best so far, with the dearest recomputes whose gaps can hide a round trip left
    # to the links, as many bytes as they carry one way in _RESERVES forward passes
    # (gpt2-xl b16 with host steps: 0.867 -> 0.918 after the loop at 1)
    lead = min((v for v in variants if v.lowered.recomputes), key=lambda v: v.score, default=None)
    if lead is not None and best_mult is not None:
        lead_hs = tuple(hs_opts) if lead.lowered.host_steps else ()
        for share in _RESERVES:
            variant(lead_hs, best_mult[1], reserve=share)
    c_var = time.process_time() - c_v0
    m_score = move_plan.meta.get("predicted_step_s", float("inf")) if move_plan is not None else float("inf")
    # The closed loop (moving's whole pipeline, on a variant's lowered trace) for at most
    # _LOOPS variants, least re-run time first (the most a loop can reach: its lowered
    # trace's ideal; on gpt2-large b8 the 16x variant, third by its own pass, went
    # 0.806 -> 0.703 s, the best), each only if it can still win: its
    # lowered trace's ideal (the original's plus its re-run ops) is below the best step
    # so far, and its own pass already beats moving's whole pipeline where that ran (on
    # SENet-154 it did not, 141.1 s against 136.7 s; the loop took it to 139.7 s, and
    # its deeptm seed alone took 10 s). A variant already at its ideal gains nothing.
    # On gpt2-large b8 the variant best by the own pass (4x, 0.938, at its ideal) is not
    # the best after the loop: 16x went 0.848 -> 0.974 there.
    best_score = min([m_score] + [v.score for v in variants])
    loops = 0
    # the loops share one work budget (each its part), so that two cost what one did
    loop_options = PolicyOptions(budget, options.seed, {**opts, "work_ops": int(opts.get("work_ops", WORK_OPS)) // _LOOPS})
    for v in sorted(variants, key=lambda v: (round(v.lowered.trace.ideal_s, 9), round(v.score, 9), variants.index(v))):
        if loops >= _LOOPS:
            break
        low_ideal = v.lowered.trace.ideal_s * (1 + 1e-9)
        if not (v.lowered.recomputes or v.lowered.host_steps) or v.score <= low_ideal:
            continue
        if not low_ideal < best_score * (1 - _LOOP_MARGIN) or not gains(v.score, m_score):
            continue
        if v.score > best_score * _LOOP_REACH:
            continue
        inner = plan_moves(v.lowered.trace, hw, loop_options)
        loops += 1
        s2 = _score(v.lowered, hw, inner)
        if gains(s2, v.score):
            v.plan, v.score = inner, s2
            best_score = min(best_score, s2)
    # (no variant at all: nothing to recompute and no host compute; moving alone then)
    best = min(variants, key=lambda v: (round(v.score, 9), variants.index(v)), default=None)
    if best is not None and (best.lowered.recomputes or best.lowered.host_steps):
        plan, score = best.lowered.plan(best.plan), best.score
    else:
        plan, score = None, float("inf")
    # NOTE: a variant that does not validate scores inf; where every variant does, the
    # move-only pipeline is the plan, whatever the trace's size (it returned the best
    # invalid variant before: HF GPT-2 12 x 64 at 50% in CPU mode, a recompute chain
    # 9 MB over the budget, executed anyway with 400-1,500 on-demand fetches)
    if plan is None or per >= _BOTH_PIPELINES or not math.isfinite(score):
        if move_plan is None:
            move_plan = plan_moves(trace, hw, options)
        m_score = move_plan.meta.get("predicted_step_s", float("inf"))
        if plan is None or not gains(score, m_score):
            plan, score = move_plan, m_score
    seed = "levers" if plan.recomputes or plan.host_steps else plan.meta.get("seed", "tierflow")
    peer_scores: dict[str, float] = {}
    if LEVERS_SIMULATED and opts.get("portfolio", True):
        # the peers' plans (checkpointing, ZeRO-Offload, ...) are seeds too, repaired by
        # the same loop where one leads: tierflow is never behind a peer by construction
        for name, p_plan, p_score in _peer_seeds(trace, hw, options):
            if p_plan.reactive and not opts.get("reactive", True):
                continue  # (see plan_moves: the runtime asks for planned plans)
            peer_scores[name] = p_score
            if gains(p_score, score):
                plan, score, seed = p_plan, p_score, name
        if seed in peer_scores:
            rounds = max(per, 1)
            s0, res = simulate_score(trace, hw, plan)
            s1, p1, r1, used = improve(trace, hw, plan, s0, res, min(12, rounds // 2))
            s1, p1, _, _ = improve_targeted(trace, hw, p1, s1, r1, rounds - used)
            if gains(s1, score):
                plan, score = p1, s1
    # what competed here, each as simulated on this trace: moving's whole pipeline, the
    # lever variants (after their loops) and the peers; a lever plan's own loop's seeds
    # (scored on its lowered trace) are under levers["loop"]
    lever_plan = seed == "levers"
    inner = dict(plan.meta) if lever_plan else {}
    meta = {} if lever_plan else dict(plan.meta)
    candidates = ({"moves": m_score} if move_plan is not None else {})
    candidates.update({v.label: v.score for v in variants})
    candidates.update(peer_scores)
    meta.update({
        "seed": seed,
        "seed_scores": candidates if lever_plan or seed in peer_scores else
        {**candidates, **plan.meta.get("seed_scores", {})},
        "peer_scores": peer_scores,
        "levers": {
            "loop": {k: inner[k] for k in ("seed", "seed_scores", "repaired_seeds", "repair_simulations")
                     if k in inner},
            "variant": best.label if plan.recomputes or plan.host_steps else "moves only",
            "variants": {v.label: v.score for v in variants},
            "recomputes": len(plan.recomputes),
            "recompute_ops": sum(len(r.ops) for r in plan.recomputes),
            "recompute_s": float(sum(trace.durations[list(r.ops)].sum() for r in plan.recomputes)),
            "host_steps": len(plan.host_steps),
            "variants_cpu_s": c_var,
            "scored_as": "mapped back" if LEVERS_SIMULATED else "lowered trace",
        },
        "predicted_step_s": score,
        "planning_s": time.perf_counter() - t0,
        "planning_cpu_s": time.process_time() - c0,
        "closed_loops": loops,
    })
    final = dataclasses.replace(plan, policy="tierflow", meta=meta)
    if not final.recomputes and not final.host_steps:
        validate(final, trace, hw)
    return final


# The peers whose plans seed the joint planner, where this build has them.
_PEERS = ("checkpoint", "selective", "save_on_cpu", "offload_activations", "zero_offload",
          "zero_offload+checkpoint", "zero_infinity")


def _peer_seeds(trace: Trace, hw: Hardware, options: PolicyOptions):
    """(name, plan, simulated step) of each peer policy present that can plan here.

    A peer that cannot plan, or whose plan this machine cannot run, is no candidate: its
    plan's host steps where the hardware has no host compute model (the runtime removes
    it on CUDA, where host steps are off by default, but the ZeRO peers step on the host
    by construction), or a plan the simulator refuses."""
    present = set(policy_names())
    for name in _PEERS:
        if name not in present:
            continue
        try:
            plan = get_policy(name)(trace, hw, PolicyOptions(options.budget_bytes, options.seed))
        except (PlanError, PolicyError):
            continue
        if plan.host_steps and hw.host_compute is None:
            continue
        try:
            score = simulate_score(trace, hw, plan)[0]
        except SimulationError:
            continue
        yield name, plan, score
