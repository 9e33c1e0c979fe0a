"""Checking policy options against what each policy declares (:class:`PolicyOption`).

One place does it for every entry point: :func:`tierflow.policies.make_plan` (and so
``replan`` and the runtime, which plan through it), ``tierflow.runtime.train`` before
it trains, and the CLI's ``--set KEY=VALUE`` (values arrive as text and are coerced to
the declared type here). A key the policy does not declare, a value of the wrong type
or outside the declared choices is a :class:`PolicyError` naming the policy's options,
so that a typo is never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import PolicyError
from ..units import parse_bytes

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def describe_options(name: str, options: Iterable[Any]) -> str:
    """``"g10's options: delta (float, default 0.5), ..."`` (one line), or that it has none."""
    opts = list(options)
    if not opts:
        return f"{name} takes no options"
    parts = []
    for o in opts:
        allowed = f" one of {'|'.join(map(str, o.choices))}" if o.choices else ""
        default = "auto" if o.default is None else repr(o.default)
        parts.append(f"{o.name} ({o.type.__name__}{allowed}, default {default})")
    return f"{name}'s options: " + ", ".join(parts)


def coerce(policy: str, option: Any, value: Any) -> Any:
    """``value`` as ``option.type``: text (from ``--set``) is parsed, a Python value is
    checked (``bool`` is not taken for a number, a whole float is taken for an int).

    Raises:
        PolicyError: the value is not of the option's type or not among its choices.
    """
    kind = option.type
    where = f"{policy}: option {option.name}={value!r}"
    if value is None and option.default is None:
        return None  # "not set": the policy picks (e.g. a tier chosen from the machine)
    out: Any
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise PolicyError(f"{where}: expected true or false")
            out = text.lower() in _TRUE
        elif kind is int:
            try:
                out = int(text)
            except ValueError:
                if not option.name.endswith("_bytes"):
                    raise PolicyError(f"{where}: expected a whole number") from None
                try:  # sizes read as people write them: page_bytes=4MiB
                    out = parse_bytes(text)
                except ValueError:
                    raise PolicyError(f"{where}: expected a whole number of bytes (4096, 4MiB)") from None
        elif kind is float:
            try:
                out = float(text)
            except ValueError:
                raise PolicyError(f"{where}: expected a number") from None
            if math.isnan(out):
                raise PolicyError(f"{where}: expected a number")
        else:
            raise PolicyError(f"{where}: cannot read a {kind.__name__} from text")
    elif kind is bool:
        if not isinstance(value, bool):
            raise PolicyError(f"{where}: expected true or false")
        out = value
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PolicyError(f"{where}: expected a whole number")
        if isinstance(value, float) and not value.is_integer():
            raise PolicyError(f"{where}: expected a whole number")
        out = int(value)
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise PolicyError(f"{where}: expected a number")
        out = float(value)
    else:  # str
        if not isinstance(value, str):
            raise PolicyError(f"{where}: expected text")
        out = value
    if option.choices is not None and out not in option.choices:
        raise PolicyError(f"{where}: not one of {', '.join(map(str, option.choices))}")
    return out


def check(policy: str, declared: Iterable[Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` checked against ``declared`` and coerced to the declared types.

    Raises:
        PolicyError: an undeclared key (the message lists the policy's options) or a bad value.
    """
    by_name = {o.name: o for o in declared}
    out: dict[str, Any] = {}
    for key, value in values.items():
        option = by_name.get(key)
        if option is None:
            raise PolicyError(f"{policy} has no option {key!r}; {describe_options(policy, by_name.values())}")
        value = coerce(policy, option, value)
        if value is not None:  # None where the default is None: "not set", the policy picks
            out[key] = value
    return out


def split_settings(items: Iterable[str]) -> list[tuple[str | None, str, str]]:
    """``--set`` items as (policy or None, key, text): ``KEY=VALUE`` is for every policy
    of the command that declares ``KEY``; ``POLICY.KEY=VALUE`` for that policy only.

    Raises:
        PolicyError: an item that is not ``KEY=VALUE``.
    """
    out = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise PolicyError(f"--set {item!r}: expected KEY=VALUE (or POLICY.KEY=VALUE)")
        policy, dot, name = key.rpartition(".")
        if dot and not (policy and name):
            raise PolicyError(f"--set {item!r}: expected KEY=VALUE (or POLICY.KEY=VALUE)")
        out.append((policy or None, name, text))
    return out
