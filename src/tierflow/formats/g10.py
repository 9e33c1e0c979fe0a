"""Reader for G10's workloads (platformxlab/G10): a case directory with ``kernels.config``
(kernels in execution order, their no-fault time in cycles at 1.2 GHz, and the tensors
each reads and writes) and ``tensors.config`` (every tensor's size and whether it is a
persistent "global" weight).

Kinds are not in G10's files; they are inferred so that policies that care (vDNN,
FlashNeuron) can tell activations from the rest:

* global tensors are ``parameter`` and persistent (their gaps wrap across iterations);
* the batch produced by ``LoadData`` is ``input``;
* a non-global tensor read by a weight-update (``*Apply_Grad*``) kernel is ``gradient``;
* a non-global tensor that no kernel reads (cuDNN workspaces) is ``temporary``;
* everything else is ``activation``.

Phases: kernels up to and including ``makeLoss`` are forward (BERT and ViT have no
``makeLoss``; there the first ``*_Backward*`` kernel starts backward), weight updates
are ``optimizer``, the rest backward.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import TraceError
from ..trace import Op, TensorInfo, Trace

G10_CLOCK_HZ = 1.2e9

_KERNEL_RE = re.compile(r"^Kernel ID:\s*(\d+),\s*Name:\s*(\S+)")
_TIME_RE = re.compile(r"^Execution Time:\s*(\d+)")
_TENSOR_RE = re.compile(r"^tensor(\d+) Is weight \(global\)\?:\s*([01]),\s*Size in byte:\s*(\d+)")


def _read_tensors(path: Path) -> list[tuple[int, bool, int]]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        m = _TENSOR_RE.match(line)
        if not m:
            raise TraceError(f"{path}:{lineno}: not a tensor line: {line[:80]!r}")
        tid, glob, size = int(m.group(1)), m.group(2) == "1", int(m.group(3))
        if tid != len(out):
            raise TraceError(f"{path}:{lineno}: tensor id {tid} out of order (expected {len(out)})")
        out.append((tid, glob, size))
    return out


def _read_kernels(path: Path, n_tensors: int) -> list[tuple[str, int, list[int], list[int]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e})") from None
    kernels: list[tuple[str, int, list[int], list[int]]] = []
    name, cycles, ins, outs, section = None, None, [], [], None
    for lineno, line in enumerate(lines, 1):
        if line.startswith("Kernel ID:"):
            m = _KERNEL_RE.match(line)
            if not m:
                raise TraceError(f"{path}:{lineno}: malformed kernel header {line[:80]!r}")
            if int(m.group(1)) != len(kernels):
                raise TraceError(f"{path}:{lineno}: kernel id {m.group(1)} out of order (expected {len(kernels)})")
            name, cycles, ins, outs, section = m.group(2), None, [], [], None
        elif line.startswith("Execution Time:"):
            m = _TIME_RE.match(line)
            if not m:
                raise TraceError(f"{path}:{lineno}: field 'Execution Time' is not an integer: {line[:80]!r}")
            cycles = int(m.group(1))
        elif line.startswith("Input Tensors:"):
            section = ins
        elif line.startswith("Output Tensors:"):
            section = outs
        elif line.startswith("tensor"):
            m = _TENSOR_RE.match(line)
            if not m or section is None:
                raise TraceError(f"{path}:{lineno}: unexpected tensor line {line[:80]!r}")
            tid = int(m.group(1))
            if tid >= n_tensors:
                raise TraceError(f"{path}:{lineno}: kernel {len(kernels)} names tensor{tid}, not in tensors.config")
            section.append(tid)
        elif line.startswith("____"):
            if name is None or cycles is None:
                raise TraceError(f"{path}:{lineno}: kernel block {len(kernels)} has no name or no 'Execution Time'")
            kernels.append((name, cycles, ins, outs))
            name = None
    if name is not None:
        raise TraceError(f"{path}: the last kernel block ({len(kernels)}) is not closed by a line of underscores")
    return kernels


def load_g10_case(path: str | Path) -> Trace:
    """Load a G10 case directory as a :class:`Trace`.

    Raises:
        TraceError: a file is missing or a line is malformed (file and line named).
    """
    path = Path(path)
    for f in ("kernels.config", "tensors.config"):
        if not (path / f).exists():
            raise TraceError(f"{path}: not a G10 case: {f} is missing")
    tensors = _read_tensors(path / "tensors.config")
    kernels = _read_kernels(path / "kernels.config", len(tensors))

    loss_at = next((i for i, k in enumerate(kernels) if k[0] == "makeLoss"), None)
    if loss_at is None:
        loss_at = next((i - 1 for i, k in enumerate(kernels) if "_Backward" in k[0]), len(kernels) - 1)
    read_by_update, read, produced_by_load = set(), set(), set()
    for kname, _, ins, outs in kernels:
        read.update(ins)
        if "Apply_Grad" in kname:
            read_by_update.update(ins)
        if kname.startswith("LoadData"):
            produced_by_load.update(outs)

    infos = []
    for tid, glob, size in tensors:
        if glob:
            kind = "parameter"
        elif tid in produced_by_load:
            kind = "input"
        elif tid in read_by_update:
            kind = "gradient"
        elif tid not in read:
            kind = "temporary"
        else:
            kind = "activation"
        infos.append(TensorInfo(tid, size, kind, persistent=glob, name=f"tensor{tid}"))

    ops = []
    total_cycles = 0
    for i, (kname, cycles, ins, outs) in enumerate(kernels):
        phase = "optimizer" if "Apply_Grad" in kname else ("forward" if i <= loss_at else "backward")
        total_cycles += cycles
        ops.append(Op(kname, phase, cycles / G10_CLOCK_HZ, tuple(ins), tuple(outs)))
    try:
        return Trace(
            ops,
            infos,
            name=path.name,
            meta={
                "source": "g10",
                "clock_hz": G10_CLOCK_HZ,
                "total_cycles": total_cycles,
                "kernel_cycles": [k[1] for k in kernels],
            },
        )
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None
