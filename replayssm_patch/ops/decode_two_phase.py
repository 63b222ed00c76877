"""Two-phase decode form (imports torch and triton only).

A prep kernel per (row, key head) does all the O(L K) ring work once -- cursor and flags, q / k
normalisation, the ring-key dot products k_j . q and k_j . k, gating, the replay weights -- and
writes them to a small scratch; the main kernel per (row, value head, block of BV value rows)
then only streams its checkpoint tile and the live ring d entries: fewer instructions per state
byte than native's own decode. Scratch written by prep, read by main (fp32 unless noted):

    qk    [N, H, 2, BK]   q (L2-normalised, scaled) and k (L2-normalised)
    coef  [N, HV, 4, LP]  row 0: w_j = exp(G_n - G_j), row 1: w_j (k_j . q), row 2: w_j (k_j . k)
                          (0 at j >= n); row 3: exp(G_n), alpha, beta, k . q at columns 0..3
    meta  [N] int32       n | flush << 16 (cursor.py)
    parts [N*H, 8, BK]    (decode_tma_tc only, 16-bit) q and k split into three numbers each, 2 zero rows

The cursor is read only by prep and written only by main (one program per row), so the two
phases need no atomics: the kernel boundary orders every read before the write. With `pdl`
the main kernel loads its checkpoint tile while the prep kernel still runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cursor import DECODE_MASK_C, TICKET_SHIFT_C
from .decode_shared import block_v, rank_update_tc, row_cursor, use_pdl
from .gdn_gates import gdn_beta, gdn_log_decay
from .launch import cdiv, next_pow2


@triton.jit
def _store_split3(x, p):
    """x (fp32 [BK]) as three numbers of p's dtype whose sum is x to that dtype's precision
    (each the rounding of what the earlier ones leave), at rows p, p + BK, p + 2 BK."""
    BK: tl.constexpr = x.shape[0]
    x0 = x.to(p.dtype.element_ty)
    r = x - x0.to(tl.float32)
    x1 = r.to(p.dtype.element_ty)
    tl.store(p, x0)
    tl.store(p + BK, x1)
    tl.store(p + 2 * BK, (r - x1.to(tl.float32)).to(p.dtype.element_ty))


@triton.jit
def _ring_prep_kernel(
    qkv, a, b, A_log, dt_bias, idx, ring_k, ring_g, cursor, force_flush, start_empty,
    qk, coef, meta, parts,
    scale,
    stride_qkv, stride_a, stride_b, stride_idx, stride_ff, stride_se,
    slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, LP: tl.constexpr, GP: tl.constexpr,
    HAS_FF: tl.constexpr, HAS_SE: tl.constexpr, L2NORM: tl.constexpr, USE_PDL: tl.constexpr,
    PARTS: tl.constexpr,
):
    pid = tl.program_id(0)
    i_h = pid % H
    row = (pid // H).to(tl.int64)
    GROUP: tl.constexpr = HV // H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the main kernel may start loading its tiles

    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, LP)
    o_g = tl.arange(0, GP)
    m_k = o_k < K
    m_g = o_g < GROUP
    hv = i_h * GROUP + o_g

    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        return  # the main kernel writes the zero output

    p_x = qkv + row * stride_qkv
    q = tl.load(p_x + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(p_x + H * K + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    a_t = tl.load(a + row * stride_a + hv, mask=m_g, other=0.0).to(tl.float32)
    b_t = tl.load(b + row * stride_b + hv, mask=m_g, other=0.0).to(tl.float32)
    A_t = tl.load(A_log + hv, mask=m_g, other=0.0).to(tl.float32)
    dtb = tl.load(dt_bias + hv, mask=m_g, other=0.0).to(tl.float32)

    n, flush = row_cursor(cursor, slot, start_empty, force_flush, row, stride_se, stride_ff, L, HAS_SE, HAS_FF)
    live = o_l < n

    p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
    rk = tl.load(p_kr + o_l[:, None] * K + o_k[None, :], mask=live[:, None] & m_k[None, :], other=0.0)
    rk = rk.to(tl.float32)
    p_g = ring_g + slot * slot_stride_g + hv[:, None] * L + o_l[None, :]
    Gr = tl.load(p_g, mask=m_g[:, None] & live[None, :], other=0.0)  # [GP, LP]

    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    q = q * scale
    p_qk = qk + (row * H + i_h) * (2 * BK) + o_k
    tl.store(p_qk, q)
    tl.store(p_qk + BK, k)
    if PARTS:  # q and k as three numbers each of the parts' dtype (decode_tma_tc), then 2 zero rows
        p_p = parts + (row * H + i_h) * (8 * BK) + o_k
        _store_split3(q, p_p)
        _store_split3(k, p_p + 3 * BK)
        tl.store(p_p + 6 * BK, tl.zeros_like(q).to(parts.dtype.element_ty))
        tl.store(p_p + 7 * BK, tl.zeros_like(q).to(parts.dtype.element_ty))

    kq = tl.where(live, tl.sum(rk * q[None, :], 1), 0.0)  # [LP]: k_j . q (entries >= n unread)
    kk = tl.where(live, tl.sum(rk * k[None, :], 1), 0.0)
    k_dot_q = tl.sum(k * q)

    g = gdn_log_decay(a_t, A_t, dtb)
    alpha = tl.exp(g)
    beta = gdn_beta(b_t)
    G_n = tl.sum(tl.where(o_l[None, :] == n - 1, Gr, 0.0), 1)  # [GP]; 0 when the ring is empty
    w = tl.where(live[None, :], tl.exp(G_n[:, None] - Gr), 0.0)  # [GP, LP]
    scal = tl.where(o_l[None, :] == 0, tl.exp(G_n)[:, None],
                    tl.where(o_l[None, :] == 1, alpha[:, None],
                             tl.where(o_l[None, :] == 2, beta[:, None], k_dot_q)))
    p_c = coef + (row * HV + hv[:, None]) * (4 * LP) + o_l[None, :]
    m_c = m_g[:, None] & (o_l[None, :] < LP)
    tl.store(p_c, w, mask=m_c)
    tl.store(p_c + LP, w * kq[None, :], mask=m_c)
    tl.store(p_c + 2 * LP, w * kk[None, :], mask=m_c)
    tl.store(p_c + 3 * LP, scal, mask=m_c)

    if not flush:  # append this step's key and cumulative gate at entry n (the main kernel adds d)
        tl.store(ring_g + slot * slot_stride_g + hv * L + n, G_n + g, mask=m_g)
        tl.store(p_kr + n * K + o_k, k.to(ring_k.dtype.element_ty), mask=m_k)
    if i_h == 0:
        tl.store(meta + row, n | (flush.to(tl.int32) << TICKET_SHIFT_C))



@triton.jit
def _ring_main_kernel(
    qkv, out, state, idx, ring_d, ring_k, cursor, qk, coef, meta,
    stride_qkv, stride_idx,
    slot_stride_state, slot_stride_d, slot_stride_k,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr, NV: tl.constexpr,
    USE_PDL: tl.constexpr, FLUSH_TC: tl.constexpr,
):
    # Program = (row, value head, block of BV value rows), value block fastest. Keep the
    # statement order: with the same arithmetic reordered (masks and offsets computed once, up
    # front) Triton 3.6 scheduled the loads differently and the kernel ran 2-9% slower on an
    # H200 (benchmarks/results/kernel_split_2026-12-01/).
    pid = tl.program_id(0)
    i_v = pid % NV
    i_hv = (pid // NV) % HV
    row = (pid // (NV * HV)).to(tl.int64)
    GROUP: tl.constexpr = HV // H
    i_h = i_hv // GROUP

    o_k = tl.arange(0, BK)
    o_b = tl.arange(0, BV)
    o_l = tl.arange(0, LP)
    m_k = o_k < K
    v0 = i_v * BV

    p_out = out + (row * HV + i_hv) * V
    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        o_v = v0 + o_b
        tl.store(p_out + o_v, tl.zeros([BV], dtype=tl.float32).to(out.dtype.element_ty), mask=o_v < V)
        return

    # The tile does not depend on the prep kernel (with PDL it loads while prep runs).
    p_s0 = state + slot * slot_stride_state + i_hv * (V * K)
    p_x = qkv + row * stride_qkv + 2 * H * K + i_hv * V
    o_v = v0 + o_b
    S = tl.load(p_s0 + o_v[:, None] * K + o_k[None, :], mask=(o_v < V)[:, None] & m_k[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    info = tl.load(meta + row)
    n = info & DECODE_MASK_C
    flush = (info >> TICKET_SHIFT_C) != 0
    live = o_l < n
    p_qk = qk + (row * H + i_h) * (2 * BK) + o_k
    q = tl.load(p_qk)
    k = tl.load(p_qk + BK)
    c_row = coef + (row * HV + i_hv) * (4 * LP)
    cq = tl.load(c_row + LP + o_l)
    ck = tl.load(c_row + 2 * LP + o_l)
    eG = tl.load(c_row + 3 * LP)
    alpha = tl.load(c_row + 3 * LP + 1)
    beta = tl.load(c_row + 3 * LP + 2)
    k_dot_q = tl.load(c_row + 3 * LP + 3)
    p_dr = ring_d + slot * slot_stride_d + i_hv * (L * V)
    p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)

    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    p_s = p_s0 + o_v[:, None] * K + o_k[None, :]
    S = S.to(tl.float32)
    v = tl.load(p_x + o_v, mask=m_v, other=0.0).to(tl.float32)
    rd = tl.load(p_dr + o_l[:, None] * V + o_v[None, :], mask=live[:, None] & m_v[None, :], other=0.0)
    rd = rd.to(tl.float32)

    Sq = eG * tl.sum(S * q[None, :], 1) + tl.sum(rd * cq[:, None], 0)
    Sk = eG * tl.sum(S * k[None, :], 1) + tl.sum(rd * ck[:, None], 0)
    d = beta * (v - alpha * Sk)
    o = alpha * Sq + d * k_dot_q
    tl.store(p_out + o_v, o.to(out.dtype.element_ty), mask=m_v)

    if flush:
        # S_new = alpha (exp(G_n) S_c + sum_{j<n} w_j d_j k_j^T) + d k^T on the tile held.
        S = S * eG
        if FLUSH_TC:
            rd_all = tl.load(p_dr + o_l[:, None] * V + o_v[None, :], mask=live[:, None] & m_v[None, :],
                             other=0.0).to(tl.float32)
            rk_all = tl.load(p_kr + o_l[:, None] * K + o_k[None, :], mask=live[:, None] & m_k[None, :],
                             other=0.0)
            S = S + rank_update_tc(rd_all, tl.load(c_row + o_l), rk_all, live)
        else:
            for j in range(0, n):  # rank-1 fp32 updates (never tf32)
                w_j = tl.load(c_row + j)
                d_j = tl.load(p_dr + j * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                k_j = tl.load(p_kr + j * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                S += (w_j * d_j)[:, None] * k_j[None, :]
        S = alpha * S + d[:, None] * k[None, :]
        tl.store(p_s, S.to(state.dtype.element_ty), mask=m_vk)
    else:
        tl.store(p_dr + n * V + o_v, d.to(ring_d.dtype.element_ty), mask=m_v)
    if (i_hv == 0) & (i_v == 0):
        tl.store(cursor + slot, tl.where(flush, 0, n + 1))


def launch_prep(args, geo, pdl: bool, parts: torch.Tensor | None = None):
    """Run the prep kernel; return its scratch (qk, coef, meta) for a main kernel. `parts`
    ([N * H, 8, BK], a 16-bit dtype): also write q / k split into that dtype (decode_tma_tc)."""
    N, H, HV, K, L, BK, LP = geo.N, geo.H, geo.HV, geo.K, geo.L, geo.BK, geo.LP
    _, _, sk, sg = geo.strides
    dev = args.state.device
    qk = torch.empty(N, H, 2, BK, dtype=torch.float32, device=dev)
    coef = torch.empty(N, HV, 4, LP, dtype=torch.float32, device=dev)
    meta = torch.empty(N, dtype=torch.int32, device=dev)
    _ring_prep_kernel[(N * H,)](
        args.qkv, args.a, args.b, args.A_log, args.dt_bias, args.idx, args.ring_k, args.ring_g, args.cursor,
        args.ff.ptr, args.se.ptr, qk, coef, meta, qk if parts is None else parts, args.scale,
        args.qkv.stride(0), args.a.stride(0), args.b.stride(0), args.idx.stride(0), args.ff.stride, args.se.stride,
        sk, sg,
        H=H, HV=HV, K=K, L=L, BK=BK, LP=LP, GP=next_pow2(HV // H),
        HAS_FF=args.ff.given, HAS_SE=args.se.given, L2NORM=args.l2norm, USE_PDL=pdl, PARTS=parts is not None,
        num_warps=2 if BK * LP <= 2048 else 4, num_stages=1,
    )
    return qk, coef, meta


def launch_two_phase(launch, args, geo) -> None:
    """Run the prep and main kernels (see decode.ring_decode for `args` and `geo`)."""
    N, H, HV, K, V, L, BK, LP = geo.N, geo.H, geo.HV, geo.K, geo.V, geo.L, geo.BK, geo.LP
    ss, sd, sk, _ = geo.strides
    BV = block_v(launch.block_v, V)
    NV = cdiv(V, BV)
    pdl = use_pdl(launch, args.state)
    qk, coef, meta = launch_prep(args, geo, pdl)
    extra = {"launch_pdl": True} if pdl else {}
    _ring_main_kernel[(N * HV * NV,)](
        args.qkv, args.out, args.state, args.idx, args.ring_d, args.ring_k, args.cursor, qk, coef, meta,
        args.qkv.stride(0), args.idx.stride(0), ss, sd, sk,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, LP=LP, NV=NV, USE_PDL=pdl, FLUSH_TC=launch.flush_tc,
        num_warps=launch.num_warps, num_stages=1, **extra,
    )
