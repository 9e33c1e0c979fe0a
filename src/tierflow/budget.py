"""The one reading of a ``budget=`` argument, shared by the eager and compiled front-ends.

A budget is either a share of the step's own peak (``"50%"``, ``0.5``) or a number of
bytes (``2_000_000_000``, ``"2GiB"``, ``4e9``), or ``None`` for no budget. Both
front-ends (``tierflow.offload`` and ``tierflow.compiled.compile``) and the CLI read it
here, so one string means one thing everywhere.

The rules, and why:

* A string ending in ``%`` is a share. Any positive share is accepted, above 100%
  too: a budget above the peak is met by doing nothing, which is a correct answer, not
  an error.
* A float in ``(0, 1]`` is a share; a larger number is bytes. No one means half a byte,
  and ``budget=4e9`` (bytes written as a float) stays what it has always meant.
* An int, or a string with or without a unit (``"512MB"``, ``"2GiB"``, ``"4096"``), is
  bytes, and must be positive: a zero budget cannot hold the step's working set.

Every error is a :class:`InvalidBudgetError` (a :class:`~tierflow.errors.PolicyError` and a
``ValueError``) that quotes the value given.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PolicyError
from .units import parse_bytes


class InvalidBudgetError(PolicyError, ValueError):
    """A ``budget=`` value that is neither a positive share nor a positive size."""


@dataclass(frozen=True, slots=True)
class Budget:
    """A parsed budget: ``share`` of the step's peak, or ``bytes``; neither means none.

    Example::

        >>> Budget.parse("50%")
        Budget(share=0.5, bytes=None)
        >>> Budget.parse("2GiB").bytes
        2147483648
    """

    share: float | None = None
    bytes: int | None = None

    @staticmethod
    def parse(budget: str | int | float | None) -> Budget:
        """Read ``budget`` by the rules of this module.

        Raises:
            InvalidBudgetError: not a number or size, a share not above 0%, bytes not above 0.
        """
        if budget is None:
            return Budget()
        if isinstance(budget, bool):
            raise InvalidBudgetError(f"budget {budget!r}: expected a share such as '50%' or a size such as '2GiB'")
        if isinstance(budget, str):
            text = budget.strip()
            if text.endswith("%"):
                try:
                    share = float(text[:-1]) / 100.0
                except ValueError:
                    raise InvalidBudgetError(f"budget {budget!r}: not a percentage") from None
                return Budget._share(share, budget)
            try:
                size = parse_bytes(text)
            except ValueError as e:
                raise InvalidBudgetError(f"budget {budget!r}: not a share or a size ({e})") from None
            return Budget._bytes(size, budget)
        if isinstance(budget, float) and budget <= 1.0:
            return Budget._share(budget, budget)
        if not isinstance(budget, (int, float)) or budget != budget or budget in (float("inf"), float("-inf")):
            raise InvalidBudgetError(f"budget {budget!r}: expected a share such as '50%' or a size such as '2GiB'")
        return Budget._bytes(int(budget), budget)

    @staticmethod
    def _share(share: float, given: object) -> Budget:
        if not 0.0 < share < float("inf"):
            raise InvalidBudgetError(f"budget {given!r}: a share must be above 0%")
        return Budget(share=share)

    @staticmethod
    def _bytes(size: int, given: object) -> Budget:
        if size <= 0:
            raise InvalidBudgetError(f"budget {given!r}: a size must be above 0 bytes (a share is written '50%')")
        return Budget(bytes=int(size))

    def key(self) -> str:
        """A stable text for cache keys: the same budget gives the same key."""
        return f"share={self.share}" if self.share is not None else f"bytes={self.bytes}"
