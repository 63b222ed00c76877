"""Replay-vector decode form: two-phase, for large launches (imports torch and triton only).

The prep kernel, per (row, key head), does what the two-phase prep does and also folds the live
ring d entries of each value head into two vectors,

    r_q = sum_{j<n} w_j (k_j . q) d_j,    r_k = sum_{j<n} w_j (k_j . k) d_j,

so the main kernel has native decode's shape: one [BV, K] checkpoint tile, raw q / k from
mixed_qkv times two scalar factors, two row reductions, and [BV] vectors that load straight
into the reductions' layout. It holds nothing of the ring (and converts no layout) outside a
flush. Scratch written by prep, read by main (fp32):

    rep  [N, HV, 2, BVF]  r_q, r_k (BVF = V rounded up to a power of two)
    sc   [N, HV, 8]       exp(G_n), alpha, beta, k.q, q factor, k factor (q = raw q * factor)
    wts  [N, HV, LP]      w_j = exp(G_n - G_j), 0 at j >= n (read by flushing rows only)
    meta [N] int32        n | flush << 16 (cursor.py)

As in the two-phase form the cursor is read by prep and written by main only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cursor import DECODE_MASK_C, TICKET_SHIFT_C
from .decode_shared import block_v, row_cursor
from .gdn_gates import gdn_beta, gdn_log_decay
from .launch import cdiv, next_pow2


@triton.jit
def _replay_prep_kernel(
    qkv, a, b, A_log, dt_bias, idx, ring_d, ring_k, ring_g, cursor, force_flush, start_empty,
    rep, sc, wts, meta,
    scale,
    stride_qkv, stride_a, stride_b, stride_idx, stride_ff, stride_se,
    slot_stride_d, slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr, LP: tl.constexpr,
    HAS_FF: tl.constexpr, HAS_SE: tl.constexpr, L2NORM: tl.constexpr,
):
    # Program = (row, key head); loops over the key head's HV / H value heads.
    pid = tl.program_id(0)
    i_h = pid % H
    row = (pid // H).to(tl.int64)
    GROUP: tl.constexpr = HV // H

    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    o_l = tl.arange(0, LP)
    o_s = tl.arange(0, 8)
    m_k = o_k < K
    m_v = o_v < V

    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        return  # the main kernel writes the zero output

    p_x = qkv + row * stride_qkv
    q = tl.load(p_x + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(p_x + H * K + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    n, flush = row_cursor(cursor, slot, start_empty, force_flush, row, stride_se, stride_ff, L, HAS_SE, HAS_FF)
    live = o_l < n

    p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
    rk = tl.load(p_kr + o_l[:, None] * K + o_k[None, :], mask=live[:, None] & m_k[None, :], other=0.0)
    rk = rk.to(tl.float32)
    # The main kernel scales the raw q / k by the same factors, so both see identical vectors.
    if L2NORM:
        q_f = scale / tl.sqrt(tl.sum(q * q) + 1e-6)
        k_f = 1.0 / tl.sqrt(tl.sum(k * k) + 1e-6)
    else:
        q_f = scale
        k_f = 1.0
    q = q * q_f
    k = k * k_f
    kq = tl.where(live, tl.sum(rk * q[None, :], 1), 0.0)  # [LP]: k_j . q (entries >= n unread)
    kk = tl.where(live, tl.sum(rk * k[None, :], 1), 0.0)
    k_dot_q = tl.sum(k * q)

    if not flush:  # append this step's key (the main kernel adds d, the loop below G)
        tl.store(p_kr + n * K + o_k, k.to(ring_k.dtype.element_ty), mask=m_k)
    if i_h == 0:
        tl.store(meta + row, n | (flush.to(tl.int32) << TICKET_SHIFT_C))

    for i in range(GROUP):
        hv = i_h * GROUP + i
        a_t = tl.load(a + row * stride_a + hv).to(tl.float32)
        b_t = tl.load(b + row * stride_b + hv).to(tl.float32)
        A_t = tl.load(A_log + hv).to(tl.float32)
        dtb = tl.load(dt_bias + hv).to(tl.float32)
        g = gdn_log_decay(a_t, A_t, dtb)
        alpha = tl.exp(g)
        beta = gdn_beta(b_t)
        p_g = ring_g + slot * slot_stride_g + hv * L
        Gr = tl.load(p_g + o_l, mask=live, other=0.0)
        G_n = tl.sum(tl.where(o_l == n - 1, Gr, 0.0))  # 0 when the ring is empty
        w = tl.where(live, tl.exp(G_n - Gr), 0.0)
        p_dr = ring_d + slot * slot_stride_d + hv * (L * V)
        rd = tl.load(p_dr + o_l[:, None] * V + o_v[None, :], mask=live[:, None] & m_v[None, :], other=0.0)
        rd = rd.to(tl.float32)
        base = row * HV + hv
        p_rep = rep + base * (2 * BVF) + o_v
        tl.store(p_rep, tl.sum(rd * (w * kq)[:, None], 0))
        tl.store(p_rep + BVF, tl.sum(rd * (w * kk)[:, None], 0))
        tl.store(wts + base * LP + o_l, w)
        scal = tl.where(o_s == 0, tl.exp(G_n), tl.where(o_s == 1, alpha, tl.where(o_s == 2, beta,
               tl.where(o_s == 3, k_dot_q, tl.where(o_s == 4, q_f, k_f)))))
        tl.store(sc + base * 8 + o_s, scal)
        if not flush:
            tl.store(p_g + n, G_n + g)


@triton.jit
def _replay_main_kernel(
    qkv, out, state, idx, ring_d, ring_k, cursor, rep, sc, wts, meta,
    stride_qkv, stride_idx,
    slot_stride_state, slot_stride_d, slot_stride_k,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr, LP: tl.constexpr, NV: tl.constexpr,
    FB: tl.constexpr,
):
    # Program = (row, value head, block of BV value rows), value block fastest (as native).
    pid = tl.program_id(0)
    i_v = pid % NV
    i_hv = (pid // NV) % HV
    row = (pid // (NV * HV)).to(tl.int64)
    GROUP: tl.constexpr = HV // H
    i_h = i_hv // GROUP

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]

    p_out = out + (row * HV + i_hv) * V + o_v
    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        tl.store(p_out, tl.zeros([BV], dtype=tl.float32).to(out.dtype.element_ty), mask=m_v)
        return

    p_s = state + slot * slot_stride_state + i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    S = tl.load(p_s, mask=m_vk, other=0.0).to(tl.float32)
    p_x = qkv + row * stride_qkv
    q = tl.load(p_x + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(p_x + H * K + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    v = tl.load(p_x + 2 * H * K + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)

    info = tl.load(meta + row)
    n = info & DECODE_MASK_C
    flush = (info >> TICKET_SHIFT_C) != 0
    base = row * HV + i_hv
    p_sc = sc + base * 8
    eG = tl.load(p_sc)
    alpha = tl.load(p_sc + 1)
    beta = tl.load(p_sc + 2)
    k_dot_q = tl.load(p_sc + 3)
    q = q * tl.load(p_sc + 4)
    k = k * tl.load(p_sc + 5)
    p_rep = rep + base * (2 * BVF) + o_v
    r_q = tl.load(p_rep, mask=m_v, other=0.0)
    r_k = tl.load(p_rep + BVF, mask=m_v, other=0.0)

    Sq = eG * tl.sum(S * q[None, :], 1) + r_q
    Sk = eG * tl.sum(S * k[None, :], 1) + r_k
    d = beta * (v - alpha * Sk)
    o = alpha * Sq + d * k_dot_q
    tl.store(p_out, o.to(out.dtype.element_ty), mask=m_v)

    p_dr = ring_d + slot * slot_stride_d + i_hv * (L * V)
    if flush:
        # S_new = alpha (exp(G_n) S_c + sum_{j<n} w_j d_j k_j^T) + d k^T as rank-1 fp32 updates,
        # in sub-tiles of FB rows re-read from the checkpoint (a cache hit: just loaded, not yet
        # written): the whole [BV, K] tile live through the loop would double the registers of
        # every program, flushing or not. This step's d goes through this program's own slice
        # of the r_q scratch (read above, by nobody else) to reach the sub-tiles.
        tl.store(p_rep, d, mask=m_v)
        tl.debug_barrier()
        p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
        p_w = wts + base * LP
        for c in tl.static_range(BV // FB):
            o_f = i_v * BV + c * FB + tl.arange(0, FB)
            m_fk = (o_f < V)[:, None] & m_k[None, :]
            p_f = state + slot * slot_stride_state + i_hv * (V * K) + o_f[:, None] * K + o_k[None, :]
            S_f = tl.load(p_f, mask=m_fk, other=0.0).to(tl.float32) * eG
            for j in range(0, n):
                w_j = tl.load(p_w + j)
                d_j = tl.load(p_dr + j * V + o_f, mask=o_f < V, other=0.0).to(tl.float32)
                k_j = tl.load(p_kr + j * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                S_f += (w_j * d_j)[:, None] * k_j[None, :]
            d_f = tl.load(rep + base * (2 * BVF) + o_f, mask=o_f < V, other=0.0)
            S_f = alpha * S_f + d_f[:, None] * k[None, :]
            tl.store(p_f, S_f.to(state.dtype.element_ty), mask=m_fk)
    else:
        tl.store(p_dr + n * V + o_v, d.to(ring_d.dtype.element_ty), mask=m_v)
    if (i_hv == 0) & (i_v == 0):
        tl.store(cursor + slot, tl.where(flush, 0, n + 1))


def launch_replay(launch, args, geo) -> None:
    """Run the replay-vector prep and main kernels (see decode.ring_decode)."""
    N, H, HV, K, V, L, BK, LP = geo.N, geo.H, geo.HV, geo.K, geo.V, geo.L, geo.BK, geo.LP
    ss, sd, sk, sg = geo.strides
    BVF = max(16, next_pow2(V))
    BV = block_v(launch.block_v, V)
    NV = cdiv(V, BV)
    dev = args.state.device
    rep = torch.empty(N, HV, 2, BVF, dtype=torch.float32, device=dev)
    sc = torch.empty(N, HV, 8, dtype=torch.float32, device=dev)
    wts = torch.empty(N, HV, LP, dtype=torch.float32, device=dev)
    meta = torch.empty(N, dtype=torch.int32, device=dev)
    _replay_prep_kernel[(N * H,)](
        args.qkv, args.a, args.b, args.A_log, args.dt_bias, args.idx, args.ring_d, args.ring_k, args.ring_g,
        args.cursor, args.ff.ptr, args.se.ptr, rep, sc, wts, meta, args.scale,
        args.qkv.stride(0), args.a.stride(0), args.b.stride(0), args.idx.stride(0), args.ff.stride, args.se.stride,
        sd, sk, sg,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BVF=BVF, LP=LP,
        HAS_FF=args.ff.given, HAS_SE=args.se.given, L2NORM=args.l2norm,
        num_warps=1, num_stages=1,
    )
    _replay_main_kernel[(N * HV * NV,)](
        args.qkv, args.out, args.state, args.idx, args.ring_d, args.ring_k, args.cursor, rep, sc, wts, meta,
        args.qkv.stride(0), args.idx.stride(0), ss, sd, sk,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, BVF=BVF, LP=LP, NV=NV, FB=min(BV, 8),
        num_warps=launch.num_warps, num_stages=1,
    )
