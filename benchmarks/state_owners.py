"""Who reads and who writes the eager runtime's state: the figures of issue 30, point 3.

For each ``self.<attr>`` of the runtime's files that is not a method or property (a
*state attribute*), the files that read it and the files that write it (an assignment,
an augmented assignment or a ``del`` of ``self.<attr>``; a call on it,
``self._lru.pop(...)``, is a read). Printed: the number of state attributes, those used
in three or more files, those written in two or more (not counting ``__init__`` and
``__enter__``, which give every attribute its first value), and with ``--list`` each of
them. On main at 0d5bbb2 (the commit the issue was filed at) it prints 154 / 51 / 31:
the issue's "about 154 ... 51 ... 33" are these figures.

The files are the ones the eager ``Run`` is assembled from (``--files`` to change them).
A component that owns state and is held by ``Run`` (``self.tiers = Tiers(...)``) counts
as one attribute of ``Run``; its own ``self.`` attributes are counted in its own file,
which is why ``--files`` accepts the component files too.

Usage:
    python benchmarks/state_owners.py                 # the nine files of the issue
    python benchmarks/state_owners.py --list          # and which attributes, where
    python benchmarks/state_owners.py --root /work/main/src/tierflow/runtime
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

NINE = ["executor", "storages", "moves", "follow", "recompute", "host_step", "profiling", "opfacts", "retime"]


@dataclass
class Usage:
    """Where one attribute of ``self`` is read and written."""

    readers: set[str] = field(default_factory=set)
    writers: set[str] = field(default_factory=set)
    # (written outside ``__init__``/``__enter__``, which set every attribute's first value)
    later_writers: set[str] = field(default_factory=set)


# Methods that give the attributes their first values: a write there is not a second owner.
INITIALISERS = ("__init__", "__enter__")


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def measure(root: Path, files: list[str]) -> tuple[dict[str, Usage], list[str]]:
    """Per state attribute (any ``self.<attr>`` that no class of the files defines as a
    method or property), the files (stems) that read and write it; and the writes into a
    held component's attributes from outside it (``self.tiers.host = ...``), as
    ``file:line attr.sub``."""
    usage: dict[str, Usage] = defaultdict(Usage)
    methods: set[str] = set()
    reach_in: list[str] = []
    for stem in files:
        tree = ast.parse((root / f"{stem}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods |= {i.name for i in node.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Attribute):
                    continue
                if _is_self(node.value):
                    u = usage[node.attr]
                    if isinstance(node.ctx, (ast.Store, ast.Del)):
                        u.writers.add(stem)
                        if fn.name not in INITIALISERS:
                            u.later_writers.add(stem)
                    else:
                        u.readers.add(stem)
                elif (isinstance(node.ctx, (ast.Store, ast.Del)) and isinstance(node.value, ast.Attribute)
                      and _is_self(node.value.value)):
                    reach_in.append(f"{stem}:{node.lineno} {node.value.attr}.{node.attr}")
    # (a nested function is walked once per enclosing function: the sets make that harmless)
    return {a: u for a, u in usage.items() if a not in methods}, sorted(set(reach_in))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "src/tierflow/runtime"))
    ap.add_argument("--files", nargs="+", default=NINE, help="file stems under --root (default: the nine of the issue)")
    ap.add_argument("--list", action="store_true", help="list the attributes read in >=3 files or written in >=2")
    args = ap.parse_args(argv)
    usage, reach_in = measure(Path(args.root), args.files)
    wide = {a: u for a, u in usage.items() if len(u.readers | u.writers) >= 3}
    shared = {a: u for a, u in usage.items() if len(u.later_writers) >= 2}
    print(f"files: {len(args.files)} ({', '.join(args.files)})")
    print(f"state attributes: {len(usage)}")
    print(f"used (read or written) in >=3 files: {len(wide)}")
    print(f"written in >=2 files (not counting {'/'.join(INITIALISERS)}): {len(shared)}")
    print(f"written in >=2 files (counting them): {sum(len(u.writers) >= 2 for u in usage.values())}")
    print(f"writes into a held component's attributes: {len(reach_in)}")
    if args.list:
        for a in sorted(set(wide) | set(shared), key=lambda a: (-len(usage[a].later_writers), a)):
            u = usage[a]
            print(f"  {a:28} writers={','.join(sorted(u.writers)):40} readers={','.join(sorted(u.readers))}")
        for r in reach_in:
            print(f"  reach-in {r}")


if __name__ == "__main__":
    main()
