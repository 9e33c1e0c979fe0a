"""Who reads and who writes the eager runtime's state: the figures of issue 30, point 3.

For each ``self.<attr>`` in the code of ``Run`` and the mixins it is assembled from that
is not a method or property (a *state attribute*), the files that read it and the files
that write it (an assignment, an augmented assignment or a ``del`` of ``self.<attr>``; a
call on it, ``self._lru.pop(...)``, is a read). Printed: the number of state
attributes, those used in three or more files, those written in two or more (not
counting ``__init__`` and ``__enter__``, which give every attribute its first value),
the writes into a held object's attributes from Run's code (``self.stats.x = ...``),
the components Run holds, and with ``--list`` each attribute counted.

``--every-class`` counts ``self.`` in every class and function of the files instead,
as the issue did when the files held nothing else: on main at 0d5bbb2 (the commit the
issue was filed at) that prints 154 / 51 / 31, the issue's "about 154 ... 51 ... 33"
(Run's own code alone: 143 / 51 / 31). A component moved into one of the files
(``retime.Retimer``) is not Run's state, so the default counts Run's classes only.

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


def run_classes(root: Path) -> set[str]:
    """``Run`` and the mixins it is assembled from (its bases in executor.py)."""
    for node in ast.parse((root / "executor.py").read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "Run":
            return {"Run"} | {b.id for b in node.bases if isinstance(b, ast.Name)}
    raise SystemExit(f"no class Run in {root / 'executor.py'}")


def measure(root: Path, files: list[str], every_class: bool = False
            ) -> tuple[dict[str, Usage], list[str], dict[str, str]]:
    """Per state attribute of ``Run`` (any ``self.<attr>`` in the code of ``Run`` and its
    mixins that none of them defines as a method or property), the files (stems) that
    read and write it; the writes into a held component's attributes from outside it
    (``self._tiers.host = ...``), as ``file:line attr.sub``; and the components ``Run``
    holds (``self._tiers = Tiers.open(...)``: attribute -> class). ``every_class``: count
    ``self.`` in every class and function of the files (what the issue counted, when the
    files held nothing but Run's mixins)."""
    classes = run_classes(root)
    known = {n.name for f in root.glob("*.py") for n in ast.parse(f.read_text()).body if isinstance(n, ast.ClassDef)}
    usage: dict[str, Usage] = defaultdict(Usage)
    methods: set[str] = set()
    reach_in: list[str] = []
    held: dict[str, str] = {}
    for stem in files:
        tree = ast.parse((root / f"{stem}.py").read_text())
        scopes = [n for n in tree.body if isinstance(n, ast.ClassDef) and (every_class or n.name in classes)]
        if every_class:
            scopes += [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope in scopes:
            if isinstance(scope, ast.ClassDef):
                methods |= {i.name for i in scope.body if isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for fn in ast.walk(scope):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call):
                        t, f = node.targets[0], node.value.func
                        name = f.id if isinstance(f, ast.Name) else (
                            f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None)
                        if isinstance(t, ast.Attribute) and _is_self(t.value) and name in known:
                            held[t.attr] = name
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
    return {a: u for a, u in usage.items() if a not in methods}, sorted(set(reach_in)), held


def _stats_ref(node: ast.AST, aliases: set[str]) -> bool:
    """``node`` is the run's stats: ``self.stats``, ``run.stats`` or a local alias of them."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr == "stats" and isinstance(node.value, ast.Name)


def stats_writers(root: Path) -> dict[str, set[str]]:
    """Per ``RunStats`` field, the runtime's files that write it (an assignment to it, or
    into it: ``st.transfers[k] = ...``), through ``self.stats``, ``run.stats`` or a local
    alias (``st = self.stats``)."""
    out: dict[str, set[str]] = defaultdict(set)
    for f in sorted(root.glob("*.py")):
        for fn in ast.walk(ast.parse(f.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            aliases = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _stats_ref(n.value, set())
                       for t in n.targets if isinstance(t, ast.Name)}
            for node in ast.walk(fn):
                target = None
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    target = node
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                    target = node.value if isinstance(node.value, ast.Attribute) else None
                if target is not None and _stats_ref(target.value, aliases):
                    out[target.attr].add(f.stem)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "src/tierflow/runtime"))
    ap.add_argument("--files", nargs="+", default=NINE, help="file stems under --root (default: the nine of the issue)")
    ap.add_argument("--list", action="store_true", help="list the attributes read in >=3 files or written in >=2")
    ap.add_argument("--every-class", action="store_true",
                    help="count self. in every class and function of the files, not only Run's mixins")
    args = ap.parse_args(argv)
    usage, reach_in, held = measure(Path(args.root), args.files, args.every_class)
    wide = {a: u for a, u in usage.items() if len(u.readers | u.writers) >= 3}
    shared = {a: u for a, u in usage.items() if len(u.later_writers) >= 2}
    print(f"files: {len(args.files)} ({', '.join(args.files)})")
    print(f"state attributes: {len(usage)}")
    print(f"used (read or written) in >=3 files: {len(wide)}")
    print(f"written in >=2 files (not counting {'/'.join(INITIALISERS)}): {len(shared)}")
    print(f"written in >=2 files (counting them): {sum(len(u.writers) >= 2 for u in usage.values())}")
    by_target: dict[str, int] = defaultdict(int)
    for r in reach_in:
        by_target[r.split()[1].split(".")[0]] += 1
    print(f"writes into a held object's attributes: {len(reach_in)} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_target.items(), key=lambda kv: -kv[1]))})")
    multi = {k: v for k, v in stats_writers(Path(args.root)).items() if len(v) >= 2}
    print(f"RunStats fields written in >=2 files of the package: {len(multi)}"
          + "".join(f"\n  {k}: {', '.join(sorted(v))}" for k, v in sorted(multi.items())) * args.list)
    print(f"components Run holds: {', '.join(f'{a} ({c})' for a, c in sorted(held.items()))}")
    if args.list:
        for a in sorted(set(wide) | set(shared), key=lambda a: (-len(usage[a].later_writers), a)):
            u = usage[a]
            print(f"  {a:28} writers={','.join(sorted(u.writers)):40} readers={','.join(sorted(u.readers))}")
        for r in reach_in:
            print(f"  reach-in {r}")


if __name__ == "__main__":
    main()
