"""Simulate a plan on a hardware model: predicted step time, stalls, traffic, memory."""

from .pooled import POOL_CHOICES, simulate_pooled
from .result import PoolAccount, SimResult, TransferRecord
from .simulator import simulate

__all__ = ["POOL_CHOICES", "PoolAccount", "SimResult", "TransferRecord", "simulate", "simulate_pooled"]
