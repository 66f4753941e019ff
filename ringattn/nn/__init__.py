"""Thin modules over the functional API."""

from .attention import RingAttention

__all__ = ["RingAttention"]
