"""benchmarks/state_owners.py's reach-in count (issue 30, point 3) on a small package
written here: each way code outside a component changes its state is found, and a
component's own code, a method call and a read are not counted."""

from __future__ import annotations

import textwrap
from pathlib import Path

from helpers import load_benchmark

COMPONENT = '''
class Table:
    def __init__(self):
        self.rows = {}
        self.order = []
        self.open = False

    def add(self, k, v):
        self.rows[k] = v
        self.order.append(k)
'''

EXECUTOR = '''
from .table import Table


class Run:
    def __enter__(self):
        self._table = Table()
        t = self._table
        self._rows, self._order = t.rows, t.order

    def good(self, k):
        self._table.add(k, 1)
        n = len(self._rows) + len(self._table.order)
        return self._rows.get(k), n

    def bad(self, k):
        self._table.open = True
        self._rows[k] = 2
        self._order.pop()
        order = self._order
        order.clear()
        table = self._table
        del table.rows[k]
'''

OTHER = '''
def helper(run, k):
    run._table.order.append(k)
'''


def _package(tmp_path: Path) -> Path:
    for name, text in (("table", COMPONENT), ("executor", EXECUTOR), ("other", OTHER)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return tmp_path


def test_reach_in_writes_are_found_through_the_component_and_runs_aliases(tmp_path):
    so = load_benchmark("state_owners")
    writes = so.reach_in_writes(_package(tmp_path), {"_table": "Table"})
    assert [w.split(" ", 1)[1] for w in writes["_table"]] == [
        "_table.open=", "_table.rows[]=", "_table.order.pop()", "_table.order.clear()", "_table.rows[]=",
        "_table.order.append()",
    ]
    assert [w.split(":")[0] for w in writes["_table"]] == ["executor"] * 5 + ["other"]


def test_a_component_with_only_its_own_writers_has_none(tmp_path):
    so = load_benchmark("state_owners")
    pkg = _package(tmp_path)
    (pkg / "executor.py").write_text(textwrap.dedent(EXECUTOR.split("    def bad")[0]))
    (pkg / "other.py").write_text("")
    assert so.reach_in_writes(pkg, {"_table": "Table"}) == {"_table": []}


def test_writes_into_the_run_from_outside_its_classes_are_found(tmp_path):
    so = load_benchmark("state_owners")
    (tmp_path / "executor.py").write_text(textwrap.dedent('''
        class Run:
            def own(self):
                self._op = 1  # (its own code: not counted)
    '''))
    (tmp_path / "follower.py").write_text(textwrap.dedent('''
        class Follower:
            def __init__(self, run):
                self.run = run

            def step(self, k):
                self.run._op = k
                self.run._fire(k)  # (a call: not a write)

        def probe(run, saved):
            run._stale = False
            for k, v in saved.items():
                setattr(run, k, v)
    '''))
    assert so.writes_into_run(tmp_path, {"Run"}) == [
        "follower:7 run._op", "follower:11 run._stale", "follower:13 setattr(run, ...)"]
