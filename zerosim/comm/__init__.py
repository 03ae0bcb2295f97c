"""Communicators: the seam between the ZeRO engine and the ranks it runs on."""

from .base import COLLECTIVES, DEFAULT_TIMEOUT_S, Communicator, TrafficCounter, ring_bytes

__all__ = ["COLLECTIVES", "DEFAULT_TIMEOUT_S", "Communicator", "TrafficCounter", "ring_bytes"]
