"""Testing and measuring helpers: the tolerance rule shared by the tests and the main job (tolerance.py), and the
one-process simulated ring (simulate.py)."""

from .simulate import simulate_ring_attn, simulate_ring_backward, simulate_ring_forward
from .tolerance import (
    ERROR_RATIO,
    FLOOR_ULPS,
    RESULTS,
    check_close,
    check_results,
    magnitude,
    max_abs_error,
    reference,
    tolerance,
)

__all__ = [
    "ERROR_RATIO",
    "FLOOR_ULPS",
    "RESULTS",
    "check_close",
    "check_results",
    "magnitude",
    "max_abs_error",
    "reference",
    "simulate_ring_attn",
    "simulate_ring_backward",
    "simulate_ring_forward",
    "tolerance",
]
