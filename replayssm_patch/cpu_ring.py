"""The ring's decode step on CPU, taken by vLLM's own CPU decode kernel.

The ring changes where a state lives (a checkpoint plus replay entries), not the step that
advances it. So on CPU each row's current state is put together first, exactly: the checkpoint
itself when the row's ring is empty, else the replay of its entries into a scratch copy. Then
vLLM's kernel (`fused_sigmoid_gating_delta_rule_update_cpu`) takes the step from that state, with
its own operation order and rounding, and gives the output. A row whose ring flushes keeps the
kernel's new state as its checkpoint; any other row appends its replay entry (d, k, G).

With an empty ring (every row at ring length 1, and the first token after every flush) the
output and the new state are therefore bit-identical to native decode; what remains between the
two arms is the replay's own rounding, which a teacher-forced comparison measures
(`replayssm_patch.testing.teacher_forced`).
"""

from __future__ import annotations

import torch

from ._vendored.gdn_reference import pack_qkv, prepare_inputs
from ._vendored.ring_reference import check_ring, replayed_state
from .numerics import CPU_DECODE_NUMERICS


def _row_cursors(ring, slots, rows, start_empty, L):
    n = ring.cursor[slots].long()
    if start_empty is not None:
        n = torch.where(start_empty[rows].bool(), torch.zeros_like(n), n)
    if bool(((n < 0) | (n > L)).any()):
        raise RuntimeError(f"ring cursor out of range [0, {L}] for slots {slots.tolist()}")
    return n


def ring_decode(native, params: dict, ring, force_flush, start_empty) -> torch.Tensor:
    """One decode token per row through the ring; `params`: the named arguments of a call to
    vLLM's CPU decode kernel `native` (q/k/v as (1, N, heads, dim), the state source in the
    kernel's [slot, HV, K, V] view). Returns what `native` returns ([N, 1, HV, V])."""
    src, idx, q, k, v = (params[n] for n in ("initial_state_source", "initial_state_indices", "q", "k", "v"))
    N, H, K = q.shape[1:]
    HV, V = v.shape[-2:]
    state_vk = src.transpose(-1, -2)  # the ring's [slot, HV, V, K] view of the same bytes
    L = check_ring(state_vk, ring.d, ring.k, ring.g, ring.cursor, H)
    out = torch.zeros(N, 1, HV, V, dtype=q.dtype)
    rows = (idx[:N] > 0).nonzero().flatten()
    if rows.numel() == 0:
        return out
    slots = idx[:N][rows].long()
    n = _row_cursors(ring, slots, rows, start_empty, L)

    # The current state of every row, in the kernel's layout: exact where the ring is empty.
    scratch = src[slots].clone()
    S_prev, G_n = replayed_state(state_vk, ring.d, ring.k, ring.g, slots, n, torch.float32)
    busy = (n > 0).nonzero().flatten()
    if busy.numel():
        scratch[busy] = S_prev[busy].transpose(-1, -2).to(src.dtype)
    R = rows.numel()
    step = native(**{**params, "q": q[:, rows], "k": k[:, rows], "v": v[:, rows],
                     "a": params["a"][rows], "b": params["b"][rows],
                     "initial_state_source": scratch,
                     "initial_state_indices": torch.arange(R, dtype=idx.dtype),
                     "cu_seqlens": torch.arange(R + 1, dtype=params["cu_seqlens"].dtype)})
    out[rows] = step

    flush = n + 1 >= L
    if force_flush is not None:
        flush = flush | force_flush[rows].bool()
    f = flush.nonzero().flatten()
    if f.numel():  # the kernel's own new state becomes the checkpoint
        src[slots[f]] = scratch[f]
        ring.cursor[slots[f]] = 0
    keep = (~flush).nonzero().flatten()
    if keep.numel():
        _append(params, ring, rows[keep], slots[keep], n[keep], S_prev[keep], G_n[keep], H, HV, K, V)
    return out


def _append(params, ring, rows, slots, pos, S_prev, G_n, H, HV, K, V):
    """Append d = beta (v - alpha S_prev k), the normalised k and G + g at position `pos`,
    rounding the gates and the norm as the CPU decode kernel does."""
    mixed = pack_qkv(params["q"][0, rows], params["k"][0, rows], params["v"][0, rows])
    b = params["b"][rows]
    _, kk, vv, g, beta, k_heads = prepare_inputs(
        mixed, params["a"][rows], b, params["A_log"], params["dt_bias"], K ** -0.5, H, HV, K, V,
        torch.float32, use_qk_l2norm=True, l2norm_eps=CPU_DECODE_NUMERICS.l2norm_eps,
        beta_rounding=b.dtype if CPU_DECODE_NUMERICS.beta_in_input_dtype else None)
    decayed = S_prev * torch.exp(g)[..., None, None]
    d = beta[..., None] * (vv - (decayed * kk[..., None, :]).sum(-1))
    ring.d[slots, :, pos] = d.to(ring.d.dtype)
    ring.k[slots, :, pos] = k_heads.to(ring.k.dtype)
    ring.g[slots, :, pos] = (G_n + g).to(ring.g.dtype)
    ring.cursor[slots] = (pos + 1).to(ring.cursor.dtype)
