"""The prep kernel of the two-phase, TMA and tensor-core TMA decode forms (imports torch and
triton only): per (row, key head) all the O(L K) ring work once -- cursor and flags, q / k
normalisation, the ring-key dot products, gating, the replay weights -- into the scratch the
forms' main kernels read (decode_two_phase.py describes its layout)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cursor import TICKET_SHIFT_C
from .decode_shared import row_cursor
from .gdn_gates import gdn_beta, gdn_log_decay
from .launch import next_pow2


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
