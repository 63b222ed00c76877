"""The ring's steps on CPU: plain decode taken by vLLM's own CPU decode kernel, and the
speculative verify in matrix-vector form.

Plain decode (`ring_decode`). The ring changes where a state lives (a checkpoint plus replay entries), not the step that
advances it. So on CPU each row's current state is put together first, exactly: the checkpoint
itself when the row's ring is empty, else the replay of its entries into a scratch copy. Then
vLLM's kernel (`fused_sigmoid_gating_delta_rule_update_cpu`) takes the step from that state, with
its own operation order and rounding, and gives the output. A row whose ring flushes keeps the
kernel's new state as its checkpoint; any other row appends its replay entry (d, k, G).

With an empty ring (every row at ring length 1, and the first token after every flush) the
output and the new state are therefore bit-identical to native decode; what remains between the
two arms is the replay's own rounding, which a teacher-forced comparison measures
(`replayssm_patch.testing.teacher_forced`).

Speculative verify (`ring_verify`). vLLM's CPU MTP kernel reads each row's state and writes one
state per window token (1+T per row and layer). Here each checkpoint is read once, for its
products with the window's keys and queries, and written only when its ring flushes; every
other term is a product with the ring's and the window's entries (see the function).
"""

from __future__ import annotations

import torch

from ..ops.commit_reference import ring_commit_pending_reference
from ..ops.cursor import pack_cursor, unpack_cursor
from ..ops.gdn_reference import L2NORM_EPS, compute_dtype_for, head_counts, pack_qkv, prepare_inputs
from ..ops.materialize_reference import ring_materialize_reference
from ..ops.ring_state_reference import check_ring, replayed_state
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


def ring_verify(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens,
                ring_d, ring_k, ring_g, cursor, num_accepted, max_tokens, use_qk_l2norm=True,
                l2norm_eps=L2NORM_EPS, counts=None):
    """One speculative step on CPU, with the call and semantics of the CUDA `ring_verify`
    (`ring_reference.ring_spec_verify_reference`): commit each slot's previous window by
    `num_accepted`, flush the rings a new window does not fit, then each row's outputs and its
    window's entries, pending in the packed `cursor` word. `l2norm_eps`: how the replaced
    kernel normalises q / k (vLLM's CPU MTP kernel: numerics.CPU_SPEC_NUMERICS). `counts` (a
    Counter, or None): gets the step's committed entries, pending windows and flushes. Returns
    `out` viewed [tokens, HV, V].

    With S_n the state before the window and Gamma_t the cumulative log-decay after window token
    t (Gamma_{-1} = G_n), the state before token t applied to x is

        S_{t-1} x = exp(Gamma_{t-1} - G_n) S_n x + sum_{u<t} exp(Gamma_{t-1} - Gamma_u) d_u (k_u . x)
        S_n x     = exp(G_n) S_c x + sum_{j<n} exp(G_n - G_j) d_j (k_j . x)

    so one product of the checkpoint S_c with the window's 2W keys and queries serves every token:
    d_t = beta_t (v_t - alpha_t S_{t-1} k_t), o_t = alpha_t S_{t-1} q_t + d_t (k_t . q_t).
    """
    H, HV, K, V = head_counts(mixed_qkv, state)
    L = check_ring(state, ring_d, ring_k, ring_g, cursor, H)
    if not 1 <= max_tokens <= L:
        raise ValueError(f"max_tokens must be in [1, L={L}] (got {max_tokens})")
    rows = state_indices.shape[0]
    out3 = out.view(mixed_qkv.shape[0], HV, V)
    n, pending = unpack_cursor(cursor)
    before, windows = n.clone(), pending > 0
    ring_commit_pending_reference(n, pending, state_indices, num_accepted, L)
    if counts is not None:
        valid = state_indices[state_indices > 0].long()
        counts["verify_committed"] += int((n - before)[valid].sum())
        counts["verify_windows"] += int(windows[valid].sum())
    cu = cu_seqlens[: rows + 1].tolist()
    groups: dict[int, list[int]] = {}  # window width -> rows with a slot
    for i, slot in enumerate(state_indices.tolist()):
        width = cu[i + 1] - cu[i]
        if width > max_tokens:
            raise ValueError(f"row {i} verifies {width} tokens, more than max_tokens={max_tokens}")
        if slot <= 0:
            out3[cu[i]:cu[i + 1]] = 0
        elif width:
            groups.setdefault(width, []).append(i)
    busy = [i for group in groups.values() for i in group]
    if busy:
        slots = state_indices[busy].long()
        widths = torch.tensor([cu[i + 1] - cu[i] for i in busy])
        full = slots[n[slots].long() + widths > L]
        if counts is not None:
            counts["verify_flushes"] += full.numel()
        if full.numel():  # these windows do not fit behind the committed entries: flush them first
            ring_materialize_reference(state, ring_d, ring_k, ring_g, n, full)
    for width, group in groups.items():
        _verify_rows(mixed_qkv, a, b, A_log, dt_bias, scale, state, out3, state_indices, cu, ring_d, ring_k,
                     ring_g, n, pending, group, width, H, HV, K, V, use_qk_l2norm, l2norm_eps)
    cursor.copy_(pack_cursor(n, pending))
    return out3


def _verify_rows(mixed_qkv, a, b, A_log, dt_bias, scale, state, out3, state_indices, cu, ring_d, ring_k, ring_g,
                 n, pending, group, W, H, HV, K, V, use_qk_l2norm, l2norm_eps):
    """`ring_verify` for the rows `group`, whose windows all have W tokens and fit their rings."""
    cdt = compute_dtype_for(state)
    R = len(group)
    tok = (torch.tensor([cu[i] for i in group])[:, None] + torch.arange(W)).flatten()
    q, k, v, g, beta, k_heads = prepare_inputs(
        mixed_qkv[tok], a[tok], b[tok], A_log, dt_bias, scale, H, HV, K, V, cdt, use_qk_l2norm,
        l2norm_eps=l2norm_eps)
    q, k, v = (x.view(R, W, HV, -1).transpose(1, 2) for x in (q, k, v))  # [R, HV, W, dim]
    g, beta = (x.view(R, W, HV).transpose(1, 2) for x in (g, beta))  # [R, HV, W]
    slots = state_indices[group].long()
    nn = n[slots].long()

    # S_c x for the window's keys and queries: one product per row with its checkpoint, read
    # where it lies ([HV, K, V] as vLLM's CPU kernels store it; no gather of whole states).
    X = torch.cat([k, q], dim=2)  # [R, HV, 2W, K]
    SX = torch.stack([X[r] @ state[s].transpose(-1, -2).to(cdt) for r, s in enumerate(slots.tolist())])
    # ... then S_n x = exp(G_n) S_c x + sum_j exp(G_n - G_j) d_j (k_j . x) over the committed
    # entries (poison past a row's cursor is masked, not multiplied by 0).
    G_n = torch.zeros(R, HV, dtype=cdt)
    SnX = SX
    n_max = int(nn.max())
    if n_max:
        G = ring_g[slots, :, :n_max].to(cdt)
        last = G.gather(2, (nn - 1).clamp(min=0)[:, None, None].expand(-1, HV, 1))[..., 0]
        G_n = torch.where(nn[:, None] > 0, last, G_n)
        live = (torch.arange(n_max) < nn[:, None])[:, None, :]  # [R, 1, n_max]
        w = torch.where(live, torch.exp(G_n[..., None] - G), 0.0)  # [R, HV, n_max]
        # k_j . x per key head (its value heads' x side by side), then per value head
        k_c = ring_k[slots, :, :n_max].to(cdt).masked_fill_(~live[..., None], 0.0)  # [R, H, n_max, K]
        kX = (X.view(R, H, -1, K) @ k_c.transpose(-1, -2)).view(R, HV, 2 * W, n_max)
        d_c = ring_d[slots, :, :n_max].to(cdt).masked_fill_(~live[..., None], 0.0)  # [R, HV, n_max, V]
        SnX = torch.exp(G_n)[..., None, None] * SX + (kX * w[:, :, None]) @ d_c

    # The window: Gam[t] = Gamma_{t-1} (Gam[0] = G_n), E[t, u] = exp(Gamma_{t-1} - Gamma_u) for u < t.
    Gam = torch.cumsum(torch.cat([G_n[..., None], g], dim=-1), dim=-1)  # [R, HV, W + 1], in token order
    e0 = torch.exp(Gam[..., :W] - G_n[..., None])[..., None]  # [R, HV, W, 1]
    lower = torch.ones(W, W, dtype=torch.bool).tril(-1)
    E = torch.exp((Gam[..., :W, None] - Gam[..., None, 1:]).masked_fill(~lower, float("-inf")))
    kx = X[:, :, :W] @ X.transpose(-1, -2)  # [R, HV, W, 2W]: k_t . k_u (first W), k_t . q_u
    alpha = torch.exp(g)[..., None]
    # d_t = beta_t (v_t - alpha_t S_{t-1} k_t): with S_{t-1} k_t's sum over d_u, u < t, a unit
    # lower-triangular system in the window's d entries.
    ab = (beta * alpha[..., 0])[..., None]
    system = torch.eye(W, dtype=cdt) + ab * E * kx[..., :W].transpose(-1, -2)
    d = torch.linalg.solve_triangular(system, beta[..., None] * (v - alpha * e0 * SnX[:, :, :W]), upper=False,
                                      unitriangular=True)  # [R, HV, W, V]
    # o_t = alpha_t S_{t-1} q_t + d_t (k_t . q_t)
    mix = alpha * E * kx[..., W:].transpose(-1, -2) + torch.diag_embed(kx[..., W:].diagonal(dim1=-2, dim2=-1))
    o = alpha * e0 * SnX[:, :, W:] + mix @ d
    out3[tok] = o.transpose(1, 2).reshape(R * W, HV, V).to(out3.dtype)
    pos = nn[:, None] + torch.arange(W)  # [R, W]
    ring_d[slots[:, None], :, pos] = d.transpose(1, 2).to(ring_d.dtype)
    ring_k[slots[:, None], :, pos] = k_heads.view(R, W, H, K).to(ring_k.dtype)
    ring_g[slots[:, None], :, pos] = Gam[..., 1:].transpose(1, 2).to(ring_g.dtype)
    pending[slots] = W
