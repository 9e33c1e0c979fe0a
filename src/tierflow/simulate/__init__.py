"""Simulate a plan on a hardware model: predicted step time, stalls, traffic, memory."""

from .result import SimResult, TransferRecord
from .simulator import simulate

__all__ = ["SimResult", "TransferRecord", "simulate"]
