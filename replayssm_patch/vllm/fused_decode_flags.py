"""Patch point: vLLM's fused GDN MTP decode off on MTP ring layers. That path reads and writes
1+T state slots per request itself; with the ring's one slot every verify must reach
_forward_core (and the ring's wrappers)."""

from __future__ import annotations

from . import FUSED_DECODE_FLAGS


def disable(layer) -> None:
    for flag in FUSED_DECODE_FLAGS:
        if hasattr(layer, flag):
            setattr(layer, flag, False)
