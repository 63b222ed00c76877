"""Fused decode form: one kernel for small, latency-bound launches (imports torch and triton only).

Program = (row, value head, block of BV value rows), the value block fastest so the programs
of one row and key head run next to each other (q, k and ring-key loads hit L2). Everything
that needs only the slot -- the checkpoint tile, v, all L ring entries -- is loaded before
the cursor ticket, so those loads are in flight during the atomic's round trip.

The cursor race. Every program of a row needs the row's cursor n, and the new cursor may only
be written after all of them have read it. Triton has no grid-wide barrier, so the read itself
is the synchronisation: each program reads the cursor with ONE atomic add of a ticket (relaxed
order is enough: only this one memory location is involved, and the atomic is the read; the
cursor word's format and its tickets: cursor.py). The low 16 bits hold n (unchanged until the
end), the high bits count arrivals. The program that sees P - 1 earlier arrivals (P = programs
per row) is the last reader; it writes the new cursor (arrival count cleared) with an atomic
exchange. Between launches the cursor therefore holds the plain entry count n, as in the
reference: no second kernel, no scratch, no host sync, and CUDA-graph safe. Racing reads of
ring entries at position >= n (written by a sibling program in the same launch) are always
masked out before use. Requirements: the valid rows of one launch name distinct slots (vLLM
guarantees this), cursor values below 2**16 and P <= 32767.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cursor import DECODE_MASK_C, MAX_TICKETS, TICKET_C, TICKET_SHIFT_C
from .decode_shared import block_v, rank_update_tc
from .gdn_gates import gdn_beta, gdn_log_decay
from .launch import cdiv


@triton.jit
def _fused_decode_kernel(
    qkv, a, b, A_log, dt_bias, out, state, idx,
    ring_d, ring_k, ring_g, cursor, force_flush, start_empty,
    scale,
    stride_qkv, stride_a, stride_b, stride_idx, stride_ff, stride_se,
    slot_stride_state, slot_stride_d, slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr, NV: tl.constexpr,
    HAS_FF: tl.constexpr, HAS_SE: tl.constexpr, L2NORM: tl.constexpr, FLUSH_TC: tl.constexpr,
):
    pid = tl.program_id(0)
    i_v = pid % NV
    hv = (pid // NV) % HV
    i_n = pid // (NV * HV)
    GROUP: tl.constexpr = HV // H
    P: tl.constexpr = HV * NV  # programs per row: all of them take one cursor ticket
    i_h = hv // GROUP

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_l = tl.arange(0, LP)
    m_k = o_k < K
    m_v = o_v < V
    m_l = o_l < L
    m_vk = m_v[:, None] & m_k[None, :]
    row = i_n.to(tl.int64)

    p_out = out + (row * HV + hv) * V + o_v
    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        # NULL block (0) or padding (-1): zero output, touch nothing else.
        tl.store(p_out, tl.zeros([BV], dtype=tl.float32).to(out.dtype.element_ty), mask=m_v)
        return

    p_x = qkv + row * stride_qkv
    q = tl.load(p_x + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(p_x + H * K + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
    rk = tl.load(p_kr + o_l[:, None] * K + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0.0)
    p_s = state + slot * slot_stride_state + hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    S = tl.load(p_s, mask=m_vk, other=0.0)
    v = tl.load(p_x + 2 * H * K + hv * V + o_v, mask=m_v, other=0.0)
    p_dr = ring_d + slot * slot_stride_d + hv * (L * V)
    rd = tl.load(p_dr + o_l[:, None] * V + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0.0)
    p_g = ring_g + slot * slot_stride_g + hv * L
    Gr = tl.load(p_g + o_l, mask=m_l, other=0.0)

    ticket = tl.atomic_add(cursor + slot, TICKET_C, sem="relaxed")
    n = ticket & DECODE_MASK_C
    arrivals = ticket >> TICKET_SHIFT_C
    if HAS_SE:
        if tl.load(start_empty + row * stride_se) != 0:
            n = n * 0
    n = tl.minimum(n, L)  # n == L: a full ring (replayed, flushed); a corrupt cursor is clamped
    live = o_l < n

    rk_ring = rk  # in the ring's dtype, for a tensor-core flush
    rk = rk.to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    q = q * scale
    # Entries at >= n may hold anything (stale, poison, a sibling's write): select the
    # reduced values, never scale them by 0 (NaN * 0 = NaN).
    kq = tl.where(live, tl.sum(rk * q[None, :], 1), 0.0)  # [LP]: k_j . q
    kk = tl.where(live, tl.sum(rk * k[None, :], 1), 0.0)  # [LP]: k_j . k
    k_dot_q = tl.sum(k * q)

    flush = n + 1 >= L
    if HAS_FF:
        flush = flush | (tl.load(force_flush + row * stride_ff) != 0)

    S = S.to(tl.float32)
    v = v.to(tl.float32)
    a_t = tl.load(a + row * stride_a + hv).to(tl.float32)
    b_t = tl.load(b + row * stride_b + hv).to(tl.float32)
    A_t = tl.load(A_log + hv).to(tl.float32)
    dtb = tl.load(dt_bias + hv).to(tl.float32)
    g = gdn_log_decay(a_t, A_t, dtb)
    alpha = tl.exp(g)
    beta = gdn_beta(b_t)

    rd = tl.where(live[:, None], rd.to(tl.float32), 0.0)
    G_n = tl.sum(tl.where(o_l == n - 1, Gr, 0.0))  # 0 when the ring is empty
    w = tl.where(live, tl.exp(G_n - Gr), 0.0)
    eG = tl.exp(G_n)
    Sq = eG * tl.sum(S * q[None, :], 1) + tl.sum(rd * (w * kq)[:, None], 0)
    Sk = eG * tl.sum(S * k[None, :], 1) + tl.sum(rd * (w * kk)[:, None], 0)

    d = beta * (v - alpha * Sk)
    o = alpha * Sq + d * k_dot_q
    tl.store(p_out, o.to(out.dtype.element_ty), mask=m_v)

    if flush:
        # S_prev = exp(G_n) S_c + sum_{j<n} w_j d_j k_j^T on the tile we hold.
        S = S * eG
        if FLUSH_TC:
            S = S + rank_update_tc(rd, w, rk_ring, live)  # the ring entries are in registers
        else:
            # Rank-1 fp32 updates (never tf32); entry j+1 is loaded (L1/L2 hits: read just
            # above) while entry j is applied. Entry 0 always exists; the prefetch index is
            # clamped, its last value unused.
            d_c = tl.load(p_dr + o_v, mask=m_v, other=0.0).to(tl.float32)
            k_c = tl.load(p_kr + o_k, mask=m_k, other=0.0).to(tl.float32)
            g_c = tl.load(p_g)
            for j in range(0, n):
                jn = tl.minimum(j + 1, L - 1)
                d_x = tl.load(p_dr + jn * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                k_x = tl.load(p_kr + jn * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                g_x = tl.load(p_g + jn)
                S += (tl.exp(G_n - g_c) * d_c)[:, None] * k_c[None, :]
                d_c = d_x
                k_c = k_x
                g_c = g_x
        S = alpha * S + d[:, None] * k[None, :]
        tl.store(p_s, S.to(state.dtype.element_ty), mask=m_vk)
    else:
        tl.store(p_dr + n * V + o_v, d.to(ring_d.dtype.element_ty), mask=m_v)
        if i_v == 0:
            tl.store(p_g + n, G_n + g)
    if not flush:
        if i_v == 0:
            if hv % GROUP == 0:  # one program per key head appends the key
                tl.store(p_kr + n * K + o_k, k.to(ring_k.dtype.element_ty), mask=m_k)
    if arrivals == P - 1:
        # Last of the row's P programs to take a ticket: everyone has read n.
        new_n = tl.where(flush, 0, n + 1)
        tl.atomic_xchg(cursor + slot, new_n, sem="relaxed")


def launch_fused(launch, args, geo) -> None:
    """Run the fused kernel: `args` holds the checked tensors and flags, `geo` the shapes
    (see decode.ring_decode)."""
    BV = block_v(launch.block_v, geo.V)
    NV = cdiv(geo.V, BV)
    if geo.HV * NV >= MAX_TICKETS:
        raise ValueError(f"too many programs per row ({geo.HV * NV}) for the cursor ticket")
    ss, sd, sk, sg = geo.strides
    _fused_decode_kernel[(geo.N * geo.HV * NV,)](
        args.qkv, args.a, args.b, args.A_log, args.dt_bias, args.out, args.state, args.idx,
        args.ring_d, args.ring_k, args.ring_g, args.cursor, args.ff.ptr, args.se.ptr,
        args.scale,
        args.qkv.stride(0), args.a.stride(0), args.b.stride(0), args.idx.stride(0), args.ff.stride, args.se.stride,
        ss, sd, sk, sg,
        H=geo.H, HV=geo.HV, K=geo.K, V=geo.V, L=geo.L, BK=geo.BK, BV=BV, LP=geo.LP, NV=NV,
        HAS_FF=args.ff.given, HAS_SE=args.se.given, L2NORM=args.l2norm, FLUSH_TC=launch.flush_tc,
        num_warps=launch.num_warps, num_stages=1,
    )
