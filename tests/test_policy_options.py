"""Policy options: every policy declares what it reads, and one checker (used by
make_plan, the runtime's train, and every command's --set) refuses the rest."""

import importlib
import inspect
import json
import re

import pytest

from helpers import chain_trace
from tierflow import PolicyError, load_hardware
from tierflow.cli import main
from tierflow.policies import (
    _MODULES,
    check_options,
    make_plan,
    options_from_settings,
    policy_names,
    policy_options,
)


@pytest.fixture
def trace_file(tmp_path):
    return str(chain_trace().save(tmp_path / "chain.json.gz"))


def _keys_read(module: str) -> set[str]:
    """The option keys a policy module reads through ``options.get("key", ...)`` /
    ``opts.get("key", ...)``, found in its source."""
    src = inspect.getsource(importlib.import_module(module))
    return set(re.findall(r"\bopt(?:ion)?s\.get\(\s*\"([a-z_0-9]+)\"", src))


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_declares_exactly_the_options_it_reads(name):
    # a module may serve several policies (zero_offload and zero_offload+checkpoint):
    # every key it reads is declared by one of them, and each declares its own knobs
    module = _MODULES[name][0]
    declared = {o.name for n in policy_names() if _MODULES[n][0] == module for o in policy_options(n)}
    assert _keys_read(module) <= declared
    for o in policy_options(name):
        assert o.type in (int, float, str, bool) and o.help and "\n" not in o.help
        assert o.default is None or isinstance(o.default, o.type)
        assert o.choices is None or o.default in o.choices


def test_text_is_coerced_to_the_declared_type():
    assert check_options("deepum", {"lookahead": "4", "liveness": "off", "headroom": "0.1"}) == {
        "lookahead": 4, "liveness": False, "headroom": 0.1}
    assert check_options("deeptm", {"page_bytes": "4MiB"}) == {"page_bytes": 4 * 2**20}
    assert check_options("vdnn", {"mode": "all", "tier": None}) == {"mode": "all"}  # None: the policy picks


@pytest.mark.parametrize("values, words", [
    ({"lookahead": "four"}, "lookahead='four': expected a whole number"),
    ({"lookahead": 2.5}, "expected a whole number"),
    ({"lookahead": True}, "expected a whole number"),
    ({"liveness": "maybe"}, "expected true or false"),
    ({"headroom": "nan"}, "expected a number"),
])
def test_a_bad_value_names_the_option(values, words):
    with pytest.raises(PolicyError, match=re.escape(words)):
        check_options("deepum", values)


def test_a_value_outside_the_choices_lists_them():
    with pytest.raises(PolicyError, match="not one of stick-to-limit, no-overhead"):
        check_options("singa", {"mode": "fast"})


def test_an_unknown_key_lists_the_policys_options():
    with pytest.raises(PolicyError) as e:
        check_options("g10", {"foo": 1})
    msg = str(e.value)
    assert "g10 has no option 'foo'" in msg and "line_share (float, default 0.99)" in msg
    with pytest.raises(PolicyError, match="ideal takes no options"):
        check_options("ideal", {"foo": 1})


def test_make_plan_checks_before_planning():
    hw = load_hardware("rtx4090-24g")
    with pytest.raises(PolicyError, match="lru has no option 'lookahead'"):
        make_plan("lru", chain_trace(), hw, lookahead=4)
    assert make_plan("deepum", chain_trace(), hw, lookahead="2").meta["lookahead"] == 2


def test_settings_go_to_the_policies_that_declare_them():
    got = options_from_settings(["lru", "deepum"], ["lookahead=4", "liveness=true", "lru.headroom=0.1"])
    assert got == {"lru": {"liveness": True, "headroom": 0.1}, "deepum": {"lookahead": 4, "liveness": True}}
    with pytest.raises(PolicyError, match="no policy here has option 'lookhead'"):
        options_from_settings(["lru", "deepum"], ["lookhead=4"])
    with pytest.raises(PolicyError, match="'g10' is not among the policies run here"):
        options_from_settings(["lru"], ["g10.delta=1"])
    with pytest.raises(PolicyError, match="expected KEY=VALUE"):
        options_from_settings(["lru"], ["liveness"])


def test_simulate_unknown_option_is_one_line_and_exit_2(trace_file, capsys):
    assert main(["simulate", trace_file, "--hardware", "rtx4090-24g", "--policy", "g10", "--set", "foo=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "g10 has no option 'foo'" in err and "delta" in err


def test_compare_applies_scoped_options(trace_file, capsys):
    argv = ["compare", trace_file, "--hardware", "rtx4090-24g", "--policies", "lru,deepum",
            "--set", "deepum.lookahead=1", "--json"]
    assert main(argv) == 0
    assert [r["policy"] for r in json.loads(capsys.readouterr().out)] == ["lru", "deepum"]
    assert main(argv[:-3] + ["--set", "lru.lookahead=1", "--json"]) == 2
    assert "lru has no option 'lookahead'" in capsys.readouterr().err


def test_policies_json_lists_every_policys_options(capsys):
    assert main(["policies", "--json"]) == 0
    out = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert sorted(out) == sorted(policy_names())
    for name, entry in out.items():
        assert [o["name"] for o in entry["options"]] == [o.name for o in policy_options(name)]
    singa = {o["name"]: o for o in out["singa"]["options"]}
    assert singa["mode"]["choices"] == ["stick-to-limit", "no-overhead"] and singa["min_bytes"]["type"] == "int"


def test_train_checks_options_before_training(monkeypatch):
    from tierflow.capture import zoo
    from tierflow.runtime import train

    def no_build(*a, **k):
        raise AssertionError("trained before checking the options")

    monkeypatch.setattr(zoo, "build", no_build)
    with pytest.raises(PolicyError, match="singa has no option 'min_byte'"):
        train("gpt-tiny", policy="singa", policy_options={"min_byte": 4096})
