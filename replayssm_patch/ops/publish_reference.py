"""Torch reference of `ring_publish` (publish.py): the state a slot's ring stands for, or a
prefix of it, written into another slot's checkpoint; the layers as lists of tensors. The ring
layout and the replayed state: ring_state_reference; the cursor word: cursor.py.
"""

from __future__ import annotations

import torch

from .cursor import pack_cursor, unpack_cursor
from .gdn_reference import compute_dtype_for
from .ring_state_reference import check_ring, flush_rows, replayed_state


def ring_publish_reference(states, rings_d, rings_k, rings_g, cursors, groups, src, dst, take, accepted=None,
                           rows=None):
    """For row i and layer l (g = groups[l], s = src[g, i], d = dst[g, i], (n, pending) = the
    word of s), rows with s > 0:

    * with `accepted`: n1 = min(n + min(accepted[i], pending), L), the window cleared; else n1 = n
      and s's word is left as it is;
    * d > 0, d != s: d's checkpoint = s's checkpoint replayed over its first
      m = min(n + min(take[i], pending), L) entries; d's cursor = 0;
    * d == s (with `accepted` only): s's committed ring is flushed into its checkpoint (m = n1),
      s's cursor = 0.

    Every source state is read before any destination is written."""
    rows = src.shape[1] if rows is None else rows
    for l, (state, ring_d, ring_k, ring_g, cursor) in enumerate(zip(states, rings_d, rings_k, rings_g, cursors)):
        L = check_ring(state, ring_d, ring_k, ring_g, cursor)
        s, d = src[groups[l], :rows].long(), dst[groups[l], :rows].long()
        live = s > 0
        if accepted is None:
            live &= d != s
        s, d = s[live], d[live]
        if s.numel() == 0:
            continue
        n, pending = unpack_cursor(cursor[s])
        n, pending = n.long(), pending.long()
        n1 = n if accepted is None else \
            torch.clamp(n + torch.minimum(accepted[:rows][live].long().clamp(min=0), pending), max=L)
        m = torch.clamp(n + torch.minimum(take[:rows][live].long().clamp(min=0), pending), max=L)
        m = torch.where(d == s, n1, m)
        out = (d > 0).nonzero().flatten()
        if out.numel():
            S, _ = replayed_state(state, ring_d, ring_k, ring_g, s[out], m[out], compute_dtype_for(state))
            flush_rows(state, d[out], S)
        if accepted is not None:
            cursor[s] = pack_cursor(torch.where(d == s, torch.zeros_like(n1), n1), torch.zeros_like(n1))
        cursor[d[out]] = 0
