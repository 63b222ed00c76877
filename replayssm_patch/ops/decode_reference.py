"""Torch reference of `ring_decode` (decode.py): one decode token per row through the ring.

Per row: the output from the replayed state, then the step's entry appended at n; the row
flushes (checkpoint written, n = 0) when the ring becomes full or its `force_flush` is set.
The ring layout and the replayed state: ring_state_reference.
"""

from __future__ import annotations

import torch

from .gdn_reference import L2NORM_EPS, compute_dtype_for, gdn_step, head_counts, prepare_inputs, valid_rows
from .ring_state_reference import check_ring, flush_rows, replayed_state


def ring_decode_reference(
    mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices,
    ring_d, ring_k, ring_g, cursor,
    force_flush=None, start_empty=None, use_qk_l2norm=True, beta_rounding=None, l2norm_eps=L2NORM_EPS,
):
    """One decode token per row through the ring. Returns `out` viewed [N, HV, V].

    `beta_rounding`, `l2norm_eps`: how the replaced native kernel computes the gate beta and
    normalises q / k (`gdn_reference.gdn_gating`, `gdn_reference.l2norm`).
    """
    H, HV, K, V = head_counts(mixed_qkv, state)
    L = check_ring(state, ring_d, ring_k, ring_g, cursor, H)
    N = mixed_qkv.shape[0]
    cdt = compute_dtype_for(state)
    out3 = out.view(N, HV, V)
    out3.zero_()
    rows = valid_rows(state_indices).nonzero().flatten()
    if rows.numel() == 0:
        return out3
    slots = state_indices[rows].long()
    n = cursor[slots].long()
    if start_empty is not None:
        n = torch.where(start_empty[rows].bool(), torch.zeros_like(n), n)
    # n == L is a full ring (a verify window committed up to the end): replay it and flush.
    if bool(((n < 0) | (n > L)).any()):
        raise RuntimeError(f"ring cursor out of range [0, {L}] for slots {slots.tolist()}")
    q, k, v, g, beta, k_heads = prepare_inputs(
        mixed_qkv[rows], a[rows], b[rows], A_log, dt_bias, scale, H, HV, K, V, cdt, use_qk_l2norm,
        beta_rounding, l2norm_eps,
    )
    S_prev, G_n = replayed_state(state, ring_d, ring_k, ring_g, slots, n, cdt)
    S_new, o, d = gdn_step(S_prev, q, k, v, g, beta)
    out3[rows] = o.to(out.dtype)

    flush = n + 1 >= L
    if force_flush is not None:
        flush = flush | force_flush[rows].bool()
    f = flush.nonzero().flatten()
    if f.numel():
        flush_rows(state, slots[f], S_new[f])
        cursor[slots[f]] = 0
    keep = (~flush).nonzero().flatten()
    if keep.numel():
        s, pos = slots[keep], n[keep]
        ring_d[s, :, pos] = d[keep].to(ring_d.dtype)
        ring_k[s, :, pos] = k_heads[keep].to(ring_k.dtype)
        ring_g[s, :, pos] = (G_n[keep] + g[keep]).to(ring_g.dtype)
        cursor[s] = (pos + 1).to(cursor.dtype)
    return out3
