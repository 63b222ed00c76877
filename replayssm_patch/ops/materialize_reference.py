"""Torch references of `ring_materialize` and `ring_reset` (materialize.py): flush rings into
their checkpoints on demand (S_c = S, n = 0); empty them (n = 0, S_c untouched, after a prefill
wrote a fresh state). The ring layout and the replayed state: ring_state_reference.
"""

from __future__ import annotations

import torch

from .gdn_reference import compute_dtype_for
from .ring_state_reference import check_ring, flush_rows, replayed_state


def ring_materialize_reference(state, ring_d, ring_k, ring_g, cursor, slots, start_empty=None):
    """Flush the given slots (<= 0 ignored): S_c = replayed state, cursor = 0. A slot whose
    `start_empty` flag (one per entry of `slots`) is set drops its ring instead: S_c untouched."""
    check_ring(state, ring_d, ring_k, ring_g, cursor)
    valid = slots > 0
    empty = None if start_empty is None else start_empty[: slots.shape[0]][valid].bool()
    slots = slots[valid].long()
    if slots.numel() == 0:
        return
    n = cursor[slots].long()
    if empty is not None:
        n = torch.where(empty, torch.zeros_like(n), n)
    busy = (n > 0).nonzero().flatten()  # an empty ring leaves the checkpoint bit-identical
    if busy.numel():
        S, _ = replayed_state(state, ring_d, ring_k, ring_g, slots[busy], n[busy], compute_dtype_for(state))
        flush_rows(state, slots[busy], S)
    cursor[slots] = 0



def ring_reset_reference(cursor, slots):
    """Mark the given slots' rings empty (slots <= 0 ignored); the checkpoint is untouched."""
    slots = slots[slots > 0].long()
    cursor[slots] = 0
