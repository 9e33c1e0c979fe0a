"""``tierflow``: our policy — a planned schedule over every tier and tensor kind,
bandwidth-aware, refined in a closed loop with the simulator.

A plan is made in layers, one module each (read them in this order):

1. **One greedy pass** (:mod:`.greedy`, :func:`.greedy.greedy_moves`): at each op the
   bytes over the budget leave the device, the idle gaps needed furthest ahead first,
   each eviction and prefetch packed into what the links, buses and tiers can still
   carry per op slot.
2. **The repair loop** (:mod:`.loop`): a plan is simulated and its stalls repaired
   (late prefetches issued earlier, tiers swapped, faults hinted, ...); a repair is kept
   only if the simulated step gets shorter.
3. **Moving alone** (:mod:`.moves`, :func:`.moves.plan_moves`, ``levers="move"``): a
   portfolio of seeds (the greedy pass, ``singa``, ``g10`` under a few settings and,
   where a planned seed leads, ``deeptm``), the best repaired by the loop, sized by a
   work budget in simulated trace ops (:class:`.moves.Budget`), not by a clock.
4. **Three levers** (:mod:`.joint`, :func:`.joint.plan_joint`, ``levers="all"``, the
   default): the move-only plan competes with plans that also recompute activations
   (re-running pure forward ops before their backward use) and run optimizer updates
   on the host (ZeRO-Offload's lever), chosen per tensor where memory is short,
   cheapest per byte first, and with the peers' plans (checkpointing, ZeRO-Offload,
   ...) as seeds: each lever setting lowers the trace (:mod:`.levers`: re-run ops in,
   host-stepped ops out) so that steps 1-3 plan its moves, and the simulator judges the
   whole plan.

Dependency order (an arrow: imports; a lower layer never imports a higher one)::

    __init__  (options, registration, the entry point :func:`tierflow`)
      -> joint  (three levers, peers as seeds)
           -> moves  (portfolio + repair loop: moving alone)
                -> greedy, loop
           -> levers  (candidates and lowering)
           -> greedy, loop
    greedy, loop, levers: none of the others

The result is whichever plan won: planned (checked by :func:`tierflow.plan.validate`)
when the own pass, ``singa``, ``deeptm``, a peer or a lever variant wins, *reactive*
(G10-style hints to the on-demand pager) when a ``g10`` seed wins; ``meta["seed"]`` says
which. It is a pure function of (trace, hardware, options): a number of simulations
fixed by the work budget, no randomness, ties by ids.

Options:
    levers (str): ``"all"`` (default) or ``"move"`` (step 4 or not).
    min_bytes (int): gaps below this size are not moved by the own pass, unless the
        fallback plan (made when the packed plan does not validate) needs them
        (default 1 MiB).
    ssd_slack (float): a gap this many times a slow tier's round trip goes there first
        (default 4).
    repair_rounds (int): at most this many repair simulations (default 48; fewer
        when ``work_ops`` buys fewer).
    work_ops (int): the loop's work budget in simulated trace ops (default 70,000:
        about 54 simulations of a 1,300-op trace, 7 of a 9,600-op one); it also sizes
        the portfolio (g10 settings, deeptm episodes; see :class:`.moves.Budget`).
    portfolio (bool): seed from the other planners too (default True); False plans
        with the own pass and the repair loop only (always planned).
    reactive (bool): a reactive plan may win (default True); False: only where no
        planned seed fits (the runtime follows planned plans move by move).
"""

from __future__ import annotations

from ...errors import PolicyError
from ...hardware import Hardware
from ...plan import Plan
from ...trace import Trace
from .. import PolicyOption, PolicyOptions, register
from .joint import LEVERS_SIMULATED, plan_joint
from .moves import MOVE_OPTIONS, plan_moves


def _default_levers() -> str:
    """'all' once the simulator and validator price recompute and host steps
    (``joint.LEVERS_SIMULATED``); until then a plan with them could not be checked, so
    'move' (the levers are still there on request)."""
    return "all" if LEVERS_SIMULATED else "move"


OPTIONS = (
    PolicyOption("levers", str, _default_levers(), "which levers to plan with: 'move' (moves only, as "
                 "before the three levers) or 'all' (moves, recompute and host-side optimizer steps)",
                 ("move", "all")),
) + MOVE_OPTIONS


@register("tierflow", OPTIONS)
def tierflow(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """Plan with ``tierflow`` (see the package docstring for the method and options).

    With ``levers="all"`` the move-only plan competes with plans that also recompute and
    host-step (:func:`.joint.plan_joint`); ``levers="move"`` is the move-only planner
    alone (:func:`.moves.plan_moves`). The default is ``"all"`` once the simulator
    prices those actions (see :func:`_default_levers`).

    The portfolio and the loop are sized by a work budget in simulated trace ops (option
    ``work_ops``, see ``moves.WORK_OPS``), not by a clock, so the plan is a pure function
    of (trace, hardware, options).

    Raises:
        PolicyError: ``levers`` is neither ``"move"`` nor ``"all"``.

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
        >>> plan = make_plan("tierflow", tr, hw, budget=int(tr.peak_live_bytes * 0.6))
        >>> plan.policy
        'tierflow'
    """
    levers = (options.extra or {}).get("levers", _default_levers())
    if levers not in ("move", "all"):
        raise PolicyError(f"tierflow: option 'levers' is {levers!r}, expected 'move' or 'all'")
    if levers == "move":
        return plan_moves(trace, hardware, options)
    return plan_joint(trace, hardware, options)
