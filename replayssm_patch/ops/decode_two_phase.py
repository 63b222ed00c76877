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

import triton
import triton.language as tl

from .cursor import DECODE_MASK_C, TICKET_SHIFT_C
from .decode_prep import launch_prep
from .decode_shared import block_v, rank_update_tc, use_pdl
from .launch import cdiv


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
