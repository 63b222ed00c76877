"""The ring and the state it stands for, in torch: what every ring op's reference builds on.

Every slot keeps a checkpoint S_c (vLLM's `ssm_state`, written only on a flush) and, for the
`n` tokens decoded since, a ring of replay entries:

    ring_d [slots, HV, L, V]  d_j = beta_j * (v_j - alpha_j * S_{j-1} k_j)   (activation dtype)
    ring_k [slots, H,  L, K]  k_j, L2-normalised, one per key head          (activation dtype)
    ring_g [slots, HV, L]     G_j = g_1 + ... + g_j, the cumulative log-decay (float32)
    cursor [slots] int32      n, the number of committed entries (with MTP also the pending
                              window: the word's format is in cursor.py)

so that the current state is  S = exp(G_n) S_c + sum_{j<n} exp(G_n - G_j) d_j k_j^T.

The ops and their references (all in place; rows with slot <= 0 are no-ops with zero output):

    ring_decode (decode.py)          decode_reference.ring_decode_reference
    ring_materialize, ring_reset     materialize_reference.ring_materialize_reference,
      (materialize.py)                 ring_reset_reference
    ring_verify (verify.py)          verify_reference.ring_spec_verify_reference
    ring_commit (commit.py)          commit_reference.ring_commit_pending_reference
    ring_publish (publish.py)        publish_reference.ring_publish_reference

A row flagged in `start_empty` treats its slot's ring as empty before use: the slot's state was
just put there by a path that does not carry the ring (align-mode block copy).

The references rebuild S explicitly (`replayed_state`; clarity over speed) and then apply
exactly the sequential step of `gdn_reference.gdn_step`; with an fp32 state and a ring of
length 1 decode is therefore bit-identical to `recurrent_decode_reference`.
"""

from __future__ import annotations

import torch


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


def flush_rows(state, slots, S):
    """Write the replayed states S of `slots` as their checkpoints, in the state dtype."""
    state[slots] = S.to(state.dtype)
