"""tierflow's own plan with both levers (recompute and host steps), executed in real
training on five models, bitwise equal to plain PyTorch: the runtime issue's parity
figures.

The plans are made for a machine model whose host link is 10^4 times slower than an
RTX 4090's PCIe (moving is dear, as for a GPU whose activations are large beside its
bandwidth), so that tierflow recomputes and steps the optimizer on the host; the
training itself runs in CPU mode, 20 steps each, and every loss, gradient, final
parameter, optimizer state and buffer is compared with ``torch.equal``.

Usage::

    python benchmarks/levers_parity.py
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # (the tests' models and comparisons)

from test_runtime_host_step import _slow_links  # noqa: E402
from test_runtime_recompute import _assert_bitwise, _dropnorm_run  # noqa: E402
from tierflow.runtime import train  # noqa: E402


def _line(what: str, parity: bool, s) -> str:
    return (f"{what}: parity {parity}, recomputed ops {s.recomputed_ops}, host steps {s.host_steps} "
            f"(in backward {s.host_steps_in_backward}), peak {s.peak_device_bytes} <= budget "
            f"{int(s.budget_bytes)}: {s.peak_device_bytes <= s.budget_bytes}, stale plans {s.stale_plans}")


def main() -> None:
    torch.set_num_threads(1)
    hw = _slow_links()
    for model, budget in (("gpt-tiny", "50%"), ("bert-tiny", "50%"), ("vit-tiny", "50%"), ("resnet-tiny", "40%")):
        res = train(model, budget=budget, steps=20, policy="tierflow", check_parity=True, hardware=hw)
        print(_line(f"{model} {budget}", bool(res.parity), res.stats), flush=True)
    ref = _dropnorm_run(20)
    got = _dropnorm_run(20, budget="50%", policy="tierflow", hardware=hw)
    _assert_bitwise(got, ref)  # (raises on the first difference)
    print(_line("dropout+BatchNorm MLP 50%", True, got[-1].stats))


if __name__ == "__main__":
    main()
