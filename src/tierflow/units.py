"""Parsing and printing sizes and times. Inside tierflow: bytes and seconds only."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parse ``"20GiB"``, ``"512 MB"``, ``"4096"`` or a number into bytes.

    Raises:
        ValueError: the text is not a size, naming what was given.
    """
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"size must be non-negative, got {text}")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"not a size: {text!r} (expected a number with an optional unit such as 20GiB, 512MB)"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """Binary units for memory, as people read GPU memory: ``1.50 GiB``."""
    if n != n or n in (float("inf"), float("-inf")):
        return "inf"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    if s != s or s == float("inf"):
        return "inf"
    if -1e-9 < s < 0.0:
        s = 0.0  # rounding residue of a sum of per-op stalls: print no "-0.0 us"
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_bandwidth(bps: float) -> str:
    return f"{bps / 1e9:.3g} GB/s"
