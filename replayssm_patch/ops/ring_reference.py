"""Torch reference of ReplaySSM for GDN: checkpoint + replay ring + per-slot cursor.

Every slot keeps a checkpoint S_c (vLLM's `ssm_state`, written only on a flush) and, for the
`n` tokens decoded since, a ring of replay entries:

    ring_d [slots, HV, L, V]  d_j = beta_j * (v_j - alpha_j * S_{j-1} k_j)   (activation dtype)
    ring_k [slots, H,  L, K]  k_j, L2-normalised, one per key head          (activation dtype)
    ring_g [slots, HV, L]     G_j = g_1 + ... + g_j, the cumulative log-decay (float32)
    cursor [slots] int32      n, the number of committed entries

so that the current state is  S = exp(G_n) S_c + sum_{j<n} exp(G_n - G_j) d_j k_j^T.

Operations (all in place, rows with slot <= 0 are no-ops with zero output):
  * `ring_decode_reference`  one token per row: output, then append; flush (write S_c, n = 0)
                             when the ring becomes full or the row's `force_flush` is set.
  * `ring_verify_reference`  T tokens per row (speculative verify): T outputs; entries are
                             appended past the cursor as *pending*, the cursor does not move.
  * `ring_commit_reference`  n += accepted, making the accepted prefix of the pending entries
                             part of the replay history.
  * `ring_materialize_reference`  flush on demand: S_c = S, n = 0.
  * `ring_reset_reference`   n = 0 without touching S_c (after prefill wrote a fresh state).

A row flagged in `start_empty` treats its slot's ring as empty before use: the slot's state was
just put there by a path that does not carry the ring (align-mode block copy).

The reference rebuilds S explicitly each step (clarity over speed) and then applies exactly the
sequential step of `gdn_reference.gdn_step`; with an fp32 state and a ring of length 1 it is
therefore bit-identical to `recurrent_decode_reference`.
"""

from __future__ import annotations

import torch

from .gdn_reference import L2NORM_EPS, compute_dtype_for, gdn_step, head_counts, prepare_inputs, valid_rows


def check_ring(state, ring_d, ring_k, ring_g, cursor, H=None):
    """Validate ring tensor shapes against the state; returns the ring length L."""
    slots, HV, V, K = state.shape
    L = ring_g.shape[-1]
    expect = {
        "ring_d": (ring_d, (slots, HV, L, V)),
        "ring_g": (ring_g, (slots, HV, L)),
    }
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (got {tuple(t.shape)})")
    if ring_k.ndim != 4 or ring_k.shape[0] != slots or ring_k.shape[2:] != (L, K):
        raise ValueError(f"ring_k must have shape ({slots}, H, {L}, {K}) (got {tuple(ring_k.shape)})")
    if H is not None and ring_k.shape[1] != H:
        raise ValueError(f"ring_k has {ring_k.shape[1]} key heads, the input has H={H}")
    if tuple(cursor.shape) != (slots,):
        raise ValueError(f"cursor must have shape ({slots},) (got {tuple(cursor.shape)})")
    if ring_g.dtype != torch.float32 and ring_g.dtype != torch.float64:
        raise ValueError(f"ring_g must be float32 (got {ring_g.dtype})")
    return L


def _ring_views(ring_d, ring_k, ring_g, slots, group, dtype):
    """Gather the rings of `slots`, k expanded to value heads, in `dtype`."""
    d = ring_d[slots].to(dtype)  # [N, HV, L, V]
    k = ring_k[slots].to(dtype).repeat_interleave(group, dim=1)  # [N, HV, L, K]
    G = ring_g[slots].to(dtype)  # [N, HV, L]
    return d, k, G


def replayed_state(state, ring_d, ring_k, ring_g, slots, n, dtype):
    """S = exp(G_n) S_c + sum_{j<n} exp(G_n - G_j) d_j k_j^T for each row (n: [N] entries)."""
    group = ring_d.shape[1] // ring_k.shape[1]
    S_c = state[slots].to(dtype)
    d, k, G = _ring_views(ring_d, ring_k, ring_g, slots, group, dtype)
    L = G.shape[-1]
    live = torch.arange(L, device=n.device)[None, :] < n[:, None]  # [N, L]
    live = live[:, None, :]  # [N, 1, L]
    last = (n - 1).clamp(min=0)
    G_n = torch.gather(G, 2, last[:, None, None].expand(-1, G.shape[1], 1)).squeeze(-1)
    G_n = torch.where(n[:, None] > 0, G_n, torch.zeros_like(G_n))  # [N, HV]
    # Entries past the cursor may hold anything (stale or poison): mask, don't multiply by 0.
    w = torch.where(live, torch.exp(G_n[..., None] - G), torch.zeros_like(G))
    d = torch.where(live[..., None], d, torch.zeros_like(d))
    k = torch.where(live[..., None], k, torch.zeros_like(k))
    S = torch.exp(G_n)[..., None, None] * S_c + torch.einsum("nhl,nhlv,nhlk->nhvk", w, d, k)
    return S, G_n


def _flush_rows(state, slots, S):
    state[slots] = S.to(state.dtype)


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
        _flush_rows(state, slots[f], S_new[f])
        cursor[slots[f]] = 0
    keep = (~flush).nonzero().flatten()
    if keep.numel():
        s, pos = slots[keep], n[keep]
        ring_d[s, :, pos] = d[keep].to(ring_d.dtype)
        ring_k[s, :, pos] = k_heads[keep].to(ring_k.dtype)
        ring_g[s, :, pos] = (G_n[keep] + g[keep]).to(ring_g.dtype)
        cursor[s] = (pos + 1).to(cursor.dtype)
    return out3


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
        _flush_rows(state, slots[busy], S)
    cursor[slots] = 0


def ring_reset_reference(cursor, slots):
    """Mark the given slots' rings empty (slots <= 0 ignored); the checkpoint is untouched."""
    slots = slots[slots > 0].long()
    cursor[slots] = 0


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


def ring_commit_reference(cursor, state_indices, num_accepted):
    """Commit the first num_accepted[i] pending entries of row i (slots <= 0 ignored)."""
    rows = valid_rows(state_indices).nonzero().flatten()
    slots = state_indices[rows].long()
    cursor[slots] = (cursor[slots] + num_accepted[rows].to(cursor.dtype)).to(cursor.dtype)


# --------------------------------------------------------------------------------------------
# Speculative decoding with a delayed commit (one state slot per request)
# --------------------------------------------------------------------------------------------
#
# A verify step appends its T_i + 1 tokens' entries past the cursor as *pending* and records
# the window length per slot (`pending`, 0 = no window). The next step learns how many of them
# were accepted only from vLLM's `num_accepted_tokens` (a GPU tensor, >= 1, the bonus token
# included), so the commit is delayed: it runs at the start of the next step, before anything
# reads the slot. A slot without a window (fresh prefill, or already committed) commits
# nothing, whatever num_accepted says (vLLM passes 1 for a row after its prefill).


# The speculative kernels keep (cursor, pending) in one int32 per slot: n | pending << 8, both
# below 256. These two helpers are that packing's one definition (torch only, so the CPU build
# uses them without triton).
CURSOR_PENDING_SHIFT = 8
CURSOR_FIELD_MASK = 0xFF


def pack_cursor(n: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """The packed cursor word from the (cursor, pending) pair (int32)."""
    return (n.to(torch.int32) | (pending.to(torch.int32) << CURSOR_PENDING_SHIFT)).to(torch.int32)


def unpack_cursor(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, pending) from packed cursor words (new tensors)."""
    return word & CURSOR_FIELD_MASK, (word >> CURSOR_PENDING_SHIFT) & CURSOR_FIELD_MASK


def ring_commit_pending_reference(cursor, pending, state_indices, num_accepted, L=None):
    """Delayed commit: n += min(num_accepted, pending) where a window is pending; pending = 0.

    Rows with slot <= 0 are ignored. `num_accepted` may be None (nothing accepted: the window
    is dropped). The cursor never exceeds L (ring_g's length, when given).
    """
    rows = valid_rows(state_indices).nonzero().flatten()
    if rows.numel() == 0:
        return
    slots = state_indices[rows].long()
    p = pending[slots].long()
    acc = torch.zeros_like(p) if num_accepted is None else num_accepted[rows].long().clamp(min=0)
    n = cursor[slots].long() + torch.where(p > 0, torch.minimum(acc, p), torch.zeros_like(p))
    if L is not None:
        n = n.clamp(max=L)
    cursor[slots] = n.to(cursor.dtype)
    pending[slots] = 0


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
