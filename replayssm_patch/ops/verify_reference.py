"""Torch references of `ring_verify` (verify.py): one speculative step per row.

  * `ring_spec_verify_reference`  what `ring_verify` does: the delayed commit of the slot's
                                  previous window (commit_reference), then the row's tokens,
                                  whose entries become the slot's new pending window
  * `ring_verify_reference`       the tokens alone: outputs as if every earlier token of the
                                  row were accepted, entries written past the cursor

The ring layout and the replayed state: ring_state_reference.
"""

from __future__ import annotations

import torch

from .commit_reference import ring_commit_pending_reference
from .gdn_reference import L2NORM_EPS, compute_dtype_for, gdn_step, head_counts, prepare_inputs
from .materialize_reference import ring_materialize_reference
from .ring_state_reference import check_ring, replayed_state


def ring_spec_verify_reference(
    mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens,
    ring_d, ring_k, ring_g, cursor, pending, num_accepted=None, use_qk_l2norm=True,
    l2norm_eps=L2NORM_EPS,
):
    """One speculative step for each row: delayed commit of the slot's previous window (from
    `num_accepted`), then `ring_verify_reference` of the row's tokens, whose entries become the
    slot's new pending window (pending[slot] = T_i).

    Row i owns tokens cu_seqlens[i]:cu_seqlens[i+1]. Rows with slot <= 0 get zero outputs and
    touch nothing; tokens outside every row are left as they are. If the window does not fit
    after the commit (n + T_i > L) the committed entries are flushed first (checkpoint
    written, n = 0). Returns `out` viewed [tokens, HV, V].
    """
    HV, V = state.shape[1], state.shape[2]
    L = ring_g.shape[-1]
    ntok = mixed_qkv.shape[0]
    out3 = out.view(ntok, HV, V)
    ring_commit_pending_reference(cursor, pending, state_indices, num_accepted, L)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        lo, hi = cu[i], cu[i + 1]
        if slot <= 0:
            out3[lo:hi] = 0
            continue
        if hi == lo:
            continue
        ring_verify_reference(
            mixed_qkv[lo:hi], a[lo:hi], b[lo:hi], A_log, dt_bias, scale, state, out3[lo:hi],
            state_indices[i:i + 1], torch.tensor([0, hi - lo]), ring_d, ring_k, ring_g, cursor,
            use_qk_l2norm, l2norm_eps,
        )
        pending[slot] = hi - lo
    return out3

def ring_verify_reference(
    mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens,
    ring_d, ring_k, ring_g, cursor, use_qk_l2norm=True, l2norm_eps=L2NORM_EPS,
):
    """Speculative verify: row i owns tokens cu_seqlens[i]:cu_seqlens[i+1] (T_i tokens).

    Each token's output is computed as if the row's previous tokens were accepted. The
    replay entries go to ring positions n..n+T_i-1 as pending; the cursor stays at n until
    `ring_commit_reference`. If the pending window would not fit (n + T_i > L), the committed
    entries are flushed into the checkpoint first. Returns `out` viewed [tokens, HV, V].
    """
    H, HV, K, V = head_counts(mixed_qkv, state)
    L = check_ring(state, ring_d, ring_k, ring_g, cursor, H)
    cdt = compute_dtype_for(state)
    ntok = mixed_qkv.shape[0]
    out3 = out.view(ntok, HV, V)
    out3.zero_()
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        lo, hi = cu[i], cu[i + 1]
        T = hi - lo
        if slot <= 0 or T == 0:
            continue
        if T > L:
            raise ValueError(f"row {i} verifies {T} tokens, more than the ring length {L}")
        s = torch.tensor([slot], device=state.device)
        if int(cursor[slot]) + T > L:
            ring_materialize_reference(state, ring_d, ring_k, ring_g, cursor, s)
        n = int(cursor[slot])
        q, k, v, g, beta, k_heads = prepare_inputs(
            mixed_qkv[lo:hi], a[lo:hi], b[lo:hi], A_log, dt_bias, scale, H, HV, K, V, cdt,
            use_qk_l2norm, l2norm_eps=l2norm_eps,
        )
        h, G_n = replayed_state(state, ring_d, ring_k, ring_g, s, torch.tensor([n], device=state.device), cdt)
        G_run = G_n[0]
        for t in range(T):
            h, o, d = gdn_step(h, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
            out3[lo + t] = o[0].to(out.dtype)
            G_run = G_run + g[t]
            ring_d[slot, :, n + t] = d[0].to(ring_d.dtype)
            ring_k[slot, :, n + t] = k_heads[t].to(ring_k.dtype)
            ring_g[slot, :, n + t] = G_run.to(ring_g.dtype)
    return out3
