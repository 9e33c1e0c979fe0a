"""Who reads and who writes the eager runtime's state: the figures of issue 30, point 3.

For each ``self.<attr>`` in the code of ``Run`` and the mixins it is assembled from that
is not a method or property (a *state attribute*), the files that read it and the files
that write it (an assignment, an augmented assignment or a ``del`` of ``self.<attr>``; a
call on it, ``self._lru.pop(...)``, is a read). Printed: the number of state
attributes, those used in three or more files, those written in two or more (not
counting ``__init__`` and ``__enter__``, which give every attribute its first value),
the writes into a held object's attributes from Run's code (``self.stats.x = ...``),
the components Run holds, and with ``--list`` each attribute counted.

Then, per component ``Run`` holds (``self._storages = StorageTable(...)``), its *reach-in
writes*: code outside the component's own class that changes the component's state:
an assignment or ``del`` of one of its attributes (``self._storages.in_iter = False``),
an item written into one of its containers (``self._storages.lru[c] = e``), or a
mutating call on one (``.pop``, ``.append``, ``.clear``, ``.move_to_end`` ...). A
container is reached through the component (``self._storages.lru``, ``run._storages``,
a local ``table = self._storages``) or through one of ``Run``'s aliases of it (``self._lru
= table.lru``, in ``__enter__``: then ``self._lru.pop(c)`` anywhere in the package is a
reach-in write). A component with none is the one writer of its state.

Last, the writes the other way: code outside ``Run``'s classes that assigns the run's
own attributes through a reference to it (``run._op = ...`` in a component holding the
run, ``setattr(run, name, ...)`` in a probe that borrows attributes by name).

``--every-class`` counts ``self.`` in every class and function of the files instead,
as the issue did when the files held nothing else: on main at 0d5bbb2 (the commit the
issue was filed at) that prints 154 / 51 / 31, the issue's "about 154 ... 51 ... 33"
(Run's own code alone: 143 / 51 / 31). A component moved into one of the files
(``retime.Retimer``) is not Run's state, so the default counts Run's classes only.

Usage:
    python benchmarks/state_owners.py                 # the nine files of the issue
    python benchmarks/state_owners.py --list          # and which attributes, where
    python benchmarks/state_owners.py --root /work/main/src/tierflow/runtime
    python benchmarks/state_owners.py --reach-in     # and each reach-in write, where
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
    # functions and methods that return one of the package's classes (``backend_for(device)
    # -> Backend``, ``Backend.attach(...) -> Tiers``): what they make is held too
    returns: dict[str, str] = {}
    for f in root.glob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
                r = n.returns.id if isinstance(n.returns, ast.Name) else (
                    n.returns.value if isinstance(n.returns, ast.Constant) else None)
                if r in known:
                    returns[n.name] = r
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
                        if name not in known:  # (made by a function or method that returns one)
                            name = returns.get(f.id if isinstance(f, ast.Name) else
                                               f.attr if isinstance(f, ast.Attribute) else "")
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


#: Records, not components: each of their fields has one writer somewhere in the package
#: (``RunStats``: counted by field, "RunStats fields written in >=2 files").
RECORDS = ("RunStats",)

#: Calls that change the container they are called on.
MUTATORS = frozenset({"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "popitem",
                      "remove", "clear", "update", "setdefault", "add", "discard", "move_to_end", "sort",
                      "reverse", "rotate"})


def _owner_classes(root: Path) -> dict[str, tuple[str, set[str]]]:
    """Each class of the package: (its file's stem, the attributes its methods assign on
    ``self``, and its annotated fields)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for f in sorted(root.glob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                attrs = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and _is_self(n.value)
                         and isinstance(n.ctx, ast.Store)}
                # (a dataclass's fields)
                attrs |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                out[node.name] = (f.stem, attrs)
    return out


def _targets(node: ast.AST) -> list[ast.AST]:
    """The assignment targets of ``node``, tuples unpacked."""
    if isinstance(node, ast.Assign):
        ts = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        ts = [node.target]
    else:
        return []
    out: list[ast.AST] = []
    for t in ts:
        out += list(t.elts) if isinstance(t, ast.Tuple) else [t]
    return out


def _pairs(node: ast.Assign) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) of each name an assignment binds, ``a, b = x, y`` unpacked."""
    out = []
    for t in node.targets:
        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
            out += list(zip(t.elts, node.value.elts))
        else:
            out.append((t, node.value))
    return out


def reach_in_writes(root: Path, held: dict[str, str], aliases: dict[str, tuple[str, str]] | None = None
                    ) -> dict[str, list[str]]:
    """Per component ``Run`` holds (attribute -> class), the reach-in writes into its
    state from code outside its class, as ``file:line what`` (see the module docstring).
    ``aliases``, where given, is filled with ``Run``'s aliases of the components'
    containers (its attribute -> (held attribute, container))."""
    classes = _owner_classes(root)
    runs = run_classes(root)
    comps = {h: c for h, c in held.items() if c in classes}
    trees = {f.stem: ast.parse(f.read_text()) for f in sorted(root.glob("*.py"))}
    # Run's aliases of a component's containers: self._lru = table.lru / self._storages.lru
    alias: dict[str, tuple[str, str]] = aliases if aliases is not None else {}  # run attribute -> (held, container)

    def comp_of(node: ast.AST, local: dict[str, str]) -> str | None:
        """The held attribute ``node`` refers to: ``self.h``, ``run.h`` or a local alias."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr in comps:
            return node.attr
        if isinstance(node, ast.Name):
            return local.get(node.id)
        return None

    def functions(tree: ast.AST):
        for cls in [None, *[n for n in tree.body if isinstance(n, ast.ClassDef)]]:
            body = tree.body if cls is None else cls.body
            for fn in body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield (cls.name if cls is not None else None), fn

    def is_alias(node: ast.AST, cls: str | None) -> bool:
        """``node`` is Run's alias of a component's container: ``run.<alias>``, or
        ``self.<alias>`` in Run's own code (another class's ``self._pending`` is its own)."""
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr in alias
                and (node.value.id != "self" or cls in runs))

    def locals_of(fn: ast.AST, cls: str | None) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
        comp_locals: dict[str, str] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                for t, v in _pairs(n):
                    h = comp_of(v, {})
                    if isinstance(t, ast.Name) and h is not None:
                        comp_locals[t.id] = h
        cont_locals: dict[str, tuple[str, str]] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                for t, v in _pairs(n):
                    if not isinstance(t, ast.Name):
                        continue
                    if isinstance(v, ast.Attribute) and comp_of(v.value, comp_locals) is not None:
                        cont_locals[t.id] = (comp_of(v.value, comp_locals), v.attr)
                    elif is_alias(v, cls):
                        cont_locals[t.id] = alias[v.attr]
        return comp_locals, cont_locals

    for tree in trees.values():
        for cls, fn in functions(tree):
            if cls not in runs:  # (an alias is Run's attribute)
                continue
            comp_locals, _ = locals_of(fn, cls)
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    for t, v in _pairs(n):
                        if (isinstance(t, ast.Attribute) and _is_self(t.value) and isinstance(v, ast.Attribute)
                                and comp_of(v.value, comp_locals) is not None):
                            alias[t.attr] = (comp_of(v.value, comp_locals), v.attr)

    def container(node: ast.AST, cls: str | None, comp_locals: dict[str, str],
                  cont_locals: dict[str, tuple[str, str]]
                  ) -> tuple[str, str] | None:
        """(held attribute, container) that ``node`` is, if it is a component's container."""
        if isinstance(node, ast.Attribute):
            h = comp_of(node.value, comp_locals)
            if h is not None:
                return h, node.attr
            if is_alias(node, cls):
                return alias[node.attr]
        if isinstance(node, ast.Name):
            return cont_locals.get(node.id)
        return None

    found: dict[str, set[str]] = defaultdict(set)
    for stem, tree in trees.items():
        for cls, fn in functions(tree):
            comp_locals, cont_locals = locals_of(fn, cls)
            for n in ast.walk(fn):
                hits: list[tuple[str, str, str]] = []  # (held, attribute, how)
                for t in _targets(n) + (n.targets if isinstance(n, ast.Delete) else []):
                    if isinstance(t, ast.Attribute) and comp_of(t.value, comp_locals) is not None:
                        hits.append((comp_of(t.value, comp_locals), t.attr, "="))
                    elif isinstance(t, ast.Subscript):
                        c = container(t.value, cls, comp_locals, cont_locals)
                        if c is not None:
                            hits.append((*c, "[]="))
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
                    c = container(n.func.value, cls, comp_locals, cont_locals)
                    if c is not None:
                        hits.append((*c, f".{n.func.attr}()"))
                for h, attr, how in hits:
                    owner = comps[h]
                    if cls == owner or attr not in classes[owner][1]:
                        continue  # (its own code; or a method's name, not its state)
                    found[h].add(f"{stem}:{n.lineno} {h}.{attr}{how}")
    return {h: sorted(found.get(h, ()), key=lambda r: (r.split(":")[0], int(r.split(":")[1].split()[0])))
            for h in sorted(comps)}


def _run_ref(node: ast.AST) -> bool:
    """``node`` is a reference to the run from outside it: ``run`` or ``self.run``/``self._run``."""
    if isinstance(node, ast.Name):
        return node.id == "run"
    return isinstance(node, ast.Attribute) and node.attr in ("run", "_run") and _is_self(node.value)


def writes_into_run(root: Path, classes: set[str]) -> list[str]:
    """Writes into the run's own state from code outside ``Run``'s classes (a component or
    a function holding a reference to the run): ``run.x = ...``, ``self.run.x = ...``,
    ``del run.x``, and ``setattr(run, ...)`` (by name), as ``file:line what``."""
    out: set[str] = set()
    for f in sorted(root.glob("*.py")):
        tree = ast.parse(f.read_text())
        scopes = [n for n in tree.body if not (isinstance(n, ast.ClassDef) and n.name in classes)]
        for scope in scopes:
            for node in ast.walk(scope):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
                        and _run_ref(node.value)):
                    out.add(f"{f.stem}:{node.lineno} run.{node.attr}")
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                      and node.args and _run_ref(node.args[0])):
                    out.add(f"{f.stem}:{node.lineno} setattr(run, ...)")
    return sorted(out, key=lambda r: (r.split(":")[0], int(r.split(":")[1].split()[0])))


def _stats_ref(node: ast.AST, aliases: set[str]) -> bool:
    """``node`` is the run's stats: ``self.stats``, ``run.stats``, a component's
    ``self._stats`` (the same object, handed to it) or a local alias of them."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr in ("stats", "_stats") and isinstance(node.value, ast.Name)


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
    ap.add_argument("--reach-in", action="store_true", help="list each reach-in write into a component")
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
    aliases: dict[str, tuple[str, str]] = {}
    writes = reach_in_writes(Path(args.root), held, aliases)
    print(f"of the state attributes, aliases of a component's container (read on every op; the component "
          f"writes them): {len(aliases)}" + (f" ({', '.join(sorted(aliases))})" if args.list else ""))
    # (RunStats is a record each file writes its own fields of: counted above, by field)
    comp = {h: w for h, w in writes.items() if held[h] not in RECORDS}
    print(f"reach-in writes into the components (from outside their class): {sum(map(len, comp.values()))} "
          f"({', '.join(f'{held[h]} {len(w)}' for h, w in sorted(comp.items(), key=lambda kv: (-len(kv[1]), kv[0])))}; "
          f"into the records {', '.join(RECORDS)}: {sum(len(w) for h, w in writes.items() if held[h] in RECORDS)})")
    into_run = writes_into_run(Path(args.root), run_classes(Path(args.root)))
    print(f"writes into the run's state from outside Run's classes (run.x = ..., setattr(run, ...)): {len(into_run)}")
    if args.reach_in:
        for w in into_run:
            print(f"  into the run: {w}")
        for h, ws in writes.items():
            for w in ws:
                print(f"  reach-in {held[h]}: {w}")
    if args.list:
        for a in sorted(set(wide) | set(shared), key=lambda a: (-len(usage[a].later_writers), a)):
            u = usage[a]
            print(f"  {a:28} writers={','.join(sorted(u.writers)):40} readers={','.join(sorted(u.readers))}")
        for r in reach_in:
            print(f"  reach-in {r}")


if __name__ == "__main__":
    main()
