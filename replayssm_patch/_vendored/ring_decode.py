"""Triton kernels of ReplaySSM decode for Gated DeltaNet (one token per row).

Semantics: exactly those of `ring_reference.ring_decode_reference`, `ring_materialize_reference`
and `ring_reset_reference` (read that module's docstring for the ring layout). This module
imports only torch and triton.

How a decode step works here (per row, per value head, per block of BV value channels):

    one read of the checkpoint tile S_c[BV, K] gives  S_c q  and  S_c k  (two mat-vecs),
    the ring adds the low-rank part:  S x = exp(G_n) (S_c x) + sum_{j<n} w_j d_j (k_j . x),
    w_j = exp(G_n - G_j), for x in {q, k}: O(n (K + BV)) work, no state tile is rebuilt.
    d = beta (v - alpha S k),   o = alpha S q + d (k . q)      (alpha = exp(g))
    not full:  append (d, k, G_n + g) at entry n, cursor = n + 1
    flush:     S_new = alpha (exp(G_n) S_c + sum_j w_j d_j k_j^T) + d k^T on the tile already
               held (rank-1 fp32 updates, the next entry loaded while one is applied), written
               in the state dtype; cursor = 0. Small launches with a 16-bit ring and tiles of
               >= 16 rows do the rank-n part as one tensor-core product instead
               (`_rank_update_tc`: a flushing row is their critical path). (On whole-V tiles
               a tl.dot here spilled kilobytes of registers and was 6-9x slower.)

Three launch forms (`pick_decode_config` chooses by batch size and dtypes):

* fused (small batches, latency-bound): one kernel, grid 1-D over (row, block of value heads,
  block of BV value rows), the value block fastest so the programs of one row and key head run
  next to each other (q, k and ring-key loads hit L2). A head block is one value head, or
  (group_heads) all HV/H value heads of one key head, looped over inside the program. The
  first head's tiles are loaded before the cursor ticket, so their round trip overlaps it.
* two-phase (from ~512 row x value-head pairs): a prep kernel per (row, key head) does the
  per-row work once -- cursor and flags, q/k normalisation, the ring-key dot products k_j.q and
  k_j.k, gating, the replay weights -- and writes them to a small scratch; the main kernel per
  (row, value head, BV rows) then only streams its checkpoint tile and live ring d entries.
  The prep kernel reads the cursor, the main kernel writes it (one program per row), so no
  atomics are needed: the kernel boundary orders every read before the write.
* replay-vector two-phase (from ~8192 pairs with a 16-bit state or ring): the prep kernel also
  folds the live ring d entries into two vectors per value head, so the main kernel has
  native's shape and converts no layout (see the section above `_replay_prep_kernel`).

Where the time goes (H200, Triton 3.6; Nsight Compute at batch 512, 32 value heads; details
in benchmarks/results/kernel_decode_sweeps_2026-12-01/README.md): native decode runs at 83-84%
of DRAM bandwidth (168-207 registers, 17-19% occupancy). With an fp16 state the two-phase main
kernel (8-row tiles) reaches 54% and the replay-vector main kernel (32-row tiles) 66%: both
are latency-bound, waiting on their loads with few warps resident (0.46 instructions issued
per scheduler per cycle). Native's stores do not make a warp wait, so it keeps the DRAM busy
with half our warps; a read-mostly kernel needs about twice the loads in flight, which neither
smaller tiles, a shared-memory pipelined loop nor tensor-core dots gave under Triton 3.6. With
an fp32 state the main kernels reach 77-82% and we win clearly (bytes dominate). At batch
<= 8 with a 16-bit state the fused kernel is latency-bound on the replay work itself: with the
checkpoint update knocked out it only ties native (job 7 of that README), and the flush of
the rows whose ring is full comes on top (on tensor cores in these launches with a 16-bit
ring: 1-10% faster than the rank-1 loop).

The cursor race (fused form). Every program of a row needs the row's cursor n, and the new cursor may only
be written after all of them have read it. Triton has no grid-wide barrier, so the read itself
is the synchronisation: each program reads the cursor with ONE atomic add of 1 << 16 (relaxed
order is enough: only this one memory location is involved, and the atomic is the read).
The low 16 bits hold n (unchanged until the end), the high bits count arrivals. The program
that sees P - 1 earlier arrivals (P = programs per row) is the last reader; it writes the new
cursor (arrival count cleared) with an atomic exchange. Between launches the cursor therefore
holds the plain entry count n, as in the reference. This needs no second kernel, no scratch
buffer and no host sync, and it is CUDA-graph safe. Racing reads of ring entries at position
>= n (written by a sibling program in the same launch) are always masked out before use.
Requirements: the valid rows of one launch name distinct slots (vLLM guarantees this), and
cursor values stay below 2**16 (L <= 65535) with P <= 32767 programs per row.

Cursor range: 0 <= n <= L. n == L is a full ring (a speculative verify window committed up to
the end): it is replayed and the step flushes. A larger value (corrupt state) is clamped to L
instead of reading out of bounds.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gdn_gates import gdn_beta, gdn_log_decay
from .ring_checks import check_device, check_packed_inputs, ring_geometry

__all__ = ["ring_decode", "ring_materialize", "ring_reset", "pick_decode_config"]

_TICKET_SHIFT = 16  # cursor = arrivals << 16 | n while a launch is in flight


@triton.jit
def _rank_update_tc(rd, w, rk, live):
    """sum_{j<n} w_j d_j k_j^T for one [BV, K] tile as a [BV, LP] x [LP, K] tensor-core product.

    The ring keys are exact in their 16-bit dtype; each fp32 product w_j d_j is split into its
    16-bit rounding and the remainder's (two products into one fp32 accumulator), so every term
    keeps about 16 mantissa bits (bf16; fp16 a few more, less near its underflow) where the
    rank-1 fp32 loop keeps 24 -- far below a 16-bit state's own rounding. rd: fp32 [LP, BV], 0
    at j >= n; w: [LP], 0 at j >= n; rk: [LP, K] in the ring dtype, anything at j >= n (poison
    included: those rows are zeroed here, since 0 * NaN would not vanish in the product).
    """
    wd = rd * w[:, None]
    hi = wd.to(rk.dtype)
    lo = (wd - hi.to(tl.float32)).to(rk.dtype)
    kz = tl.where(live[:, None], rk, tl.zeros_like(rk))
    acc = tl.dot(tl.trans(lo), kz, out_dtype=tl.float32)
    return tl.dot(tl.trans(hi), kz, acc, out_dtype=tl.float32)


@triton.jit
def _ring_decode_kernel(
    qkv, a, b, A_log, dt_bias, out, state, idx,
    ring_d, ring_k, ring_g, cursor, force_flush, start_empty,
    scale,
    stride_qkv, stride_a, stride_b, stride_idx, stride_ff, stride_se,
    slot_stride_state, slot_stride_d, slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr, NV: tl.constexpr, HPP: tl.constexpr,
    HAS_FF: tl.constexpr, HAS_SE: tl.constexpr, L2NORM: tl.constexpr,
    PREFETCH_RING: tl.constexpr, FLUSH_TC: tl.constexpr,
):
    # Program = (row, block of HPP value heads that share one key head, block of BV values).
    pid = tl.program_id(0)
    NHB: tl.constexpr = HV // HPP
    i_v = pid % NV
    i_hb = (pid // NV) % NHB
    i_n = pid // (NV * NHB)
    GROUP: tl.constexpr = HV // H
    P: tl.constexpr = NHB * NV  # programs per row: all of them take one cursor ticket
    hv0 = i_hb * HPP
    i_h = hv0 // GROUP

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_l = tl.arange(0, LP)
    m_k = o_k < K
    m_v = o_v < V
    m_l = o_l < L
    m_vk = m_v[:, None] & m_k[None, :]
    row = i_n.to(tl.int64)

    p_out = out + (row * HV + hv0) * V + o_v
    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        # NULL block (0) or padding (-1): zero output, touch nothing else.
        for i in tl.static_range(HPP):
            tl.store(p_out + i * V, tl.zeros([BV], dtype=tl.float32).to(out.dtype.element_ty), mask=m_v)
        return

    # Per row and key head: q, k and the ring's keys, shared by the HPP value heads below.
    p_x = qkv + row * stride_qkv
    q = tl.load(p_x + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(p_x + H * K + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
    p_k = p_kr + o_l[:, None] * K + o_k[None, :]
    if PREFETCH_RING:
        # Latency-bound launches: read all L entries without waiting for the cursor ticket.
        rk = tl.load(p_k, mask=m_l[:, None] & m_k[None, :], other=0.0)
    # The first value head's tiles need only the slot: issue their loads before the cursor
    # ticket, so they are in flight during the atomic's round trip instead of after it.
    p_s0 = state + slot * slot_stride_state + hv0 * (V * K) + o_v[:, None] * K + o_k[None, :]
    S0 = tl.load(p_s0, mask=m_vk, other=0.0)
    v0 = tl.load(p_x + 2 * H * K + hv0 * V + o_v, mask=m_v, other=0.0)
    if PREFETCH_RING:
        p_dr0 = ring_d + slot * slot_stride_d + hv0 * (L * V)
        rd0 = tl.load(p_dr0 + o_l[:, None] * V + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0.0)
        Gr0 = tl.load(ring_g + slot * slot_stride_g + hv0 * L + o_l, mask=m_l, other=0.0)

    ticket = tl.atomic_add(cursor + slot, 1 << 16, sem="relaxed")
    n = ticket & 0xFFFF
    arrivals = ticket >> 16
    if HAS_SE:
        if tl.load(start_empty + row * stride_se) != 0:
            n = n * 0
    n = tl.minimum(n, L)
    live = o_l < n
    m_ring = m_l if PREFETCH_RING else live  # bandwidth-bound launches read the n live entries

    if not PREFETCH_RING:
        rk = tl.load(p_k, mask=live[:, None] & m_k[None, :], other=0.0)
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

    for i in tl.static_range(HPP):
        hv = hv0 + i
        p_s = state + slot * slot_stride_state + hv * (V * K) + o_v[:, None] * K + o_k[None, :]
        p_g = ring_g + slot * slot_stride_g + hv * L
        p_dr = ring_d + slot * slot_stride_d + hv * (L * V)
        if i == 0:
            S = S0.to(tl.float32)
            v = v0.to(tl.float32)
        else:
            S = tl.load(p_s, mask=m_vk, other=0.0).to(tl.float32)
            v = tl.load(p_x + 2 * H * K + hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if PREFETCH_RING and i == 0:
            rd = rd0
            Gr = Gr0
        else:
            rd = tl.load(p_dr + o_l[:, None] * V + o_v[None, :], mask=m_ring[:, None] & m_v[None, :], other=0.0)
            Gr = tl.load(p_g + o_l, mask=m_ring, other=0.0)
        a_t = tl.load(a + row * stride_a + hv).to(tl.float32)
        b_t = tl.load(b + row * stride_b + hv).to(tl.float32)
        A_t = tl.load(A_log + hv).to(tl.float32)
        dtb = tl.load(dt_bias + hv).to(tl.float32)

        g = gdn_log_decay(a_t, A_t, dtb)
        alpha = tl.exp(g)
        beta = gdn_beta(b_t)

        if PREFETCH_RING:
            rd = tl.where(live[:, None], rd.to(tl.float32), 0.0)
        else:  # masked load: entries >= n already read as 0
            rd = rd.to(tl.float32)
        G_n = tl.sum(tl.where(o_l == n - 1, Gr, 0.0))  # 0 when the ring is empty
        w = tl.where(live, tl.exp(G_n - Gr), 0.0)
        eG = tl.exp(G_n)
        Sq = eG * tl.sum(S * q[None, :], 1) + tl.sum(rd * (w * kq)[:, None], 0)
        Sk = eG * tl.sum(S * k[None, :], 1) + tl.sum(rd * (w * kk)[:, None], 0)

        d = beta * (v - alpha * Sk)
        o = alpha * Sq + d * k_dot_q
        tl.store(p_out + i * V, o.to(out.dtype.element_ty), mask=m_v)

        if flush:
            # S_prev = exp(G_n) S_c + sum_{j<n} w_j d_j k_j^T on the tile we hold.
            S = S * eG
            if FLUSH_TC:
                # The ring entries are already in registers (rd: 0 at j >= n).
                S = S + _rank_update_tc(rd, w, rk_ring, live)
            else:
                # Rank-1 fp32 updates (never tf32); entry j+1 is loaded (L1/L2 hits: read
                # just above) while entry j is applied. Entry 0 always exists; the prefetch
                # index is clamped, its last value unused.
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
            if hv0 % GROUP == 0:  # one program per key head appends the key
                tl.store(p_kr + n * K + o_k, k.to(ring_k.dtype.element_ty), mask=m_k)
    if arrivals == P - 1:
        # Last of the row's P programs to take a ticket: everyone has read n.
        new_n = tl.where(flush, 0, n + 1)
        tl.atomic_xchg(cursor + slot, new_n, sem="relaxed")


# --------------------------------------------------------------------------------------------
# Two-phase decode: a per-(row, key head) prep kernel does all the O(L K) ring work once, then
# the main kernel's per-(row, value head, value block) programs only read the checkpoint tile
# and the live ring d entries -- fewer instructions per state byte than native's own decode.
# --------------------------------------------------------------------------------------------
# Scratch written by the prep kernel, read by the main kernel (fp32 unless noted):
#   qk    [N, H, 2, BK]   q (L2-normalised, scaled) and k (L2-normalised)
#   coef  [N, HV, 4, LP]  row 0: w_j = exp(G_n - G_j), row 1: w_j (k_j . q), row 2: w_j (k_j . k)
#                         (0 at j >= n); row 3: exp(G_n), alpha, beta, k . q at columns 0..3
#   meta  [N] int32       n | flush << 16
# The cursor is read only by prep and written only by main (one program per row), so the
# two phases need no atomics: the kernel boundary orders every read before the write.


@triton.jit
def _row_cursor(cursor, slot, start_empty, force_flush, row, stride_se, stride_ff,
                L: tl.constexpr, HAS_SE: tl.constexpr, HAS_FF: tl.constexpr):
    """A prep kernel's view of its row's ring: (entries n to replay, whether this step flushes).
    A row flagged start_empty ignores the cursor; a corrupt cursor > L is clamped to L."""
    n = tl.load(cursor + slot)
    if HAS_SE:
        if tl.load(start_empty + row * stride_se) != 0:
            n = n * 0
    n = tl.minimum(n, L)
    flush = n + 1 >= L
    if HAS_FF:
        flush = flush | (tl.load(force_flush + row * stride_ff) != 0)
    return n, flush


@triton.jit
def _ring_prep_kernel(
    qkv, a, b, A_log, dt_bias, idx, ring_k, ring_g, cursor, force_flush, start_empty,
    qk, coef, meta,
    scale,
    stride_qkv, stride_a, stride_b, stride_idx, stride_ff, stride_se,
    slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, LP: tl.constexpr, GP: tl.constexpr,
    HAS_FF: tl.constexpr, HAS_SE: tl.constexpr, L2NORM: tl.constexpr, USE_PDL: tl.constexpr,
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

    n, flush = _row_cursor(cursor, slot, start_empty, force_flush, row, stride_se, stride_ff, L, HAS_SE, HAS_FF)
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
        tl.store(meta + row, n | (flush.to(tl.int32) << 16))


@triton.jit
def _ring_main_kernel(
    qkv, out, state, idx, ring_d, ring_k, cursor, qk, coef, meta,
    stride_qkv, stride_idx,
    slot_stride_state, slot_stride_d, slot_stride_k,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr, NSPLIT: tl.constexpr, CH: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, FLUSH_TC: tl.constexpr,
):
    # Program = (row, value head, one of NSPLIT runs of CH consecutive BV-row chunks of V). The
    # per-program work (slot, q, k, coefficients) is paid once per CH chunks; with PREFETCH the
    # next chunk's state tile is in flight while the current one is reduced.
    pid = tl.program_id(0)
    i_s = pid % NSPLIT
    i_hv = (pid // NSPLIT) % HV
    row = (pid // (NSPLIT * HV)).to(tl.int64)
    GROUP: tl.constexpr = HV // H
    i_h = i_hv // GROUP

    o_k = tl.arange(0, BK)
    o_b = tl.arange(0, BV)
    o_l = tl.arange(0, LP)
    m_k = o_k < K
    v0 = i_s * (CH * BV)

    p_out = out + (row * HV + i_hv) * V
    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        for c in range(CH):
            o_v = v0 + c * BV + o_b
            tl.store(p_out + o_v, tl.zeros([BV], dtype=tl.float32).to(out.dtype.element_ty), mask=o_v < V)
        return

    p_s0 = state + slot * slot_stride_state + i_hv * (V * K)
    p_x = qkv + row * stride_qkv + 2 * H * K + i_hv * V
    # The first tile does not depend on the prep kernel (with PDL it loads while prep runs).
    o_v = v0 + o_b
    S_next = tl.load(p_s0 + o_v[:, None] * K + o_k[None, :], mask=(o_v < V)[:, None] & m_k[None, :],
                     other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    info = tl.load(meta + row)
    n = info & 0xFFFF
    flush = (info >> 16) != 0
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

    for c in range(CH):
        o_v = v0 + c * BV + o_b
        m_v = o_v < V
        m_vk = m_v[:, None] & m_k[None, :]
        p_s = p_s0 + o_v[:, None] * K + o_k[None, :]
        S = S_next.to(tl.float32)
        if PREFETCH:
            if c + 1 < CH:
                o_n = o_v + BV
                S_next = tl.load(p_s + BV * K, mask=(o_n < V)[:, None] & m_k[None, :], other=0.0)
        v = tl.load(p_x + o_v, mask=m_v, other=0.0).to(tl.float32)
        rd = tl.load(p_dr + o_l[:, None] * V + o_v[None, :], mask=live[:, None] & m_v[None, :], other=0.0)
        rd = rd.to(tl.float32)

        Sq = eG * tl.sum(S * q[None, :], 1) + tl.sum(rd * cq[:, None], 0)
        Sk = eG * tl.sum(S * k[None, :], 1) + tl.sum(rd * ck[:, None], 0)
        d = beta * (v - alpha * Sk)
        o = alpha * Sq + d * k_dot_q
        tl.store(p_out + o_v, o.to(out.dtype.element_ty), mask=m_v)

        if flush:
            # Same updates as the fused kernel's flush (the ring entries are read here).
            S = S * eG
            if FLUSH_TC:
                rd_all = tl.load(p_dr + o_l[:, None] * V + o_v[None, :], mask=live[:, None] & m_v[None, :],
                                 other=0.0).to(tl.float32)
                rk_all = tl.load(p_kr + o_l[:, None] * K + o_k[None, :], mask=live[:, None] & m_k[None, :],
                                 other=0.0)
                S = S + _rank_update_tc(rd_all, tl.load(c_row + o_l), rk_all, live)
            else:
                for j in range(0, n):
                    w_j = tl.load(c_row + j)
                    d_j = tl.load(p_dr + j * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                    k_j = tl.load(p_kr + j * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                    S += (w_j * d_j)[:, None] * k_j[None, :]
            S = alpha * S + d[:, None] * k[None, :]
            tl.store(p_s, S.to(state.dtype.element_ty), mask=m_vk)
        else:
            tl.store(p_dr + n * V + o_v, d.to(ring_d.dtype.element_ty), mask=m_v)
        if not PREFETCH:
            if c + 1 < CH:
                o_n = o_v + BV
                S_next = tl.load(p_s + BV * K, mask=(o_n < V)[:, None] & m_k[None, :], other=0.0)
    if (i_hv == 0) & (i_s == 0):
        tl.store(cursor + slot, tl.where(flush, 0, n + 1))


# --------------------------------------------------------------------------------------------
# Replay-vector two-phase decode (modes 3 and 4 = with PDL). The prep kernel also folds the live
# ring d entries of each value head into two vectors,
#     r_q = sum_{j<n} w_j (k_j . q) d_j,    r_k = sum_{j<n} w_j (k_j . k) d_j,
# so the main kernel has native's shape: one [BV, K] checkpoint tile, raw q / k from mixed_qkv
# times two scalar factors, two row reductions, and [BV] vectors that load straight into the
# reductions' layout. It holds nothing of the ring (and converts no layout) outside a flush.
# Scratch written by prep, read by main (fp32):
#   rep  [N, HV, 2, BVF]  r_q, r_k (BVF = V rounded up to a power of two)
#   sc   [N, HV, 8]       exp(G_n), alpha, beta, k.q, q factor, k factor (q = raw q * factor)
#   wts  [N, HV, LP]      w_j = exp(G_n - G_j), 0 at j >= n (read by flushing rows only)
#   meta [N] int32        n | flush << 16
# --------------------------------------------------------------------------------------------


@triton.jit
def _replay_prep_kernel(
    qkv, a, b, A_log, dt_bias, idx, ring_d, ring_k, ring_g, cursor, force_flush, start_empty,
    rep, sc, wts, meta,
    scale,
    stride_qkv, stride_a, stride_b, stride_idx, stride_ff, stride_se,
    slot_stride_d, slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr, LP: tl.constexpr,
    HAS_FF: tl.constexpr, HAS_SE: tl.constexpr, L2NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program = (row, key head); loops over the key head's HV / H value heads.
    pid = tl.program_id(0)
    i_h = pid % H
    row = (pid // H).to(tl.int64)
    GROUP: tl.constexpr = HV // H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the main kernel may start loading its tiles

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
    n, flush = _row_cursor(cursor, slot, start_empty, force_flush, row, stride_se, stride_ff, L, HAS_SE, HAS_FF)
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
        tl.store(meta + row, n | (flush.to(tl.int32) << 16))

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
    FB: tl.constexpr, USE_PDL: tl.constexpr,
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

    # Everything up to the wait depends only on the slot and the inputs (with PDL it loads
    # while the prep kernel runs).
    p_s = state + slot * slot_stride_state + i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    S = tl.load(p_s, mask=m_vk, other=0.0).to(tl.float32)
    p_x = qkv + row * stride_qkv
    q = tl.load(p_x + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(p_x + H * K + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    v = tl.load(p_x + 2 * H * K + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    info = tl.load(meta + row)
    n = info & 0xFFFF
    flush = (info >> 16) != 0
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


@triton.jit
def _ring_materialize_kernel(
    state, ring_d, ring_k, ring_g, cursor, slots, stride_slots, start_empty,
    slot_stride_state, slot_stride_d, slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr, NV: tl.constexpr, HAS_EMPTY: tl.constexpr,
):
    pid = tl.program_id(0)
    i_v = pid % NV
    i_hv = (pid // NV) % HV
    i_n = pid // (NV * HV)
    GROUP: tl.constexpr = HV // H
    P: tl.constexpr = HV * NV
    i_h = i_hv // GROUP

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]

    slot = tl.load(slots + i_n.to(tl.int64) * stride_slots).to(tl.int64)
    if slot <= 0:
        return
    p_s = state + slot * slot_stride_state + i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    p_g = ring_g + slot * slot_stride_g + i_hv * L

    ticket = tl.atomic_add(cursor + slot, 1 << 16, sem="relaxed")
    n = tl.minimum(ticket & 0xFFFF, L)
    arrivals = ticket >> 16
    if HAS_EMPTY:  # the row's ring is stale (its state came without it): drop, don't replay
        n = tl.where(tl.load(start_empty + i_n) != 0, 0, n)
    if n > 0:
        S = tl.load(p_s, mask=m_vk, other=0.0).to(tl.float32)
        G_n = tl.load(p_g + n - 1)
        S = S * tl.exp(G_n)
        p_dr = ring_d + slot * slot_stride_d + i_hv * (L * V)
        p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
        for j in range(0, n):  # rank-1 fp32 updates, as in the decode kernel's flush
            d_j = tl.load(p_dr + j * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            k_j = tl.load(p_kr + j * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            S += (tl.exp(G_n - tl.load(p_g + j)) * d_j)[:, None] * k_j[None, :]
        tl.store(p_s, S.to(state.dtype.element_ty), mask=m_vk)
    # An empty ring leaves the checkpoint untouched (bit-identical).
    if arrivals == P - 1:
        tl.atomic_xchg(cursor + slot, 0, sem="relaxed")


@triton.jit
def _ring_reset_kernel(cursor, slots, n_slots, stride_slots, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(slots + offs.to(tl.int64) * stride_slots, mask=offs < n_slots, other=0).to(tl.int64)
    tl.store(cursor + s, tl.zeros([BLOCK], dtype=tl.int32), mask=(offs < n_slots) & (s > 0))


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # the interpreter on CPU: any plausible value


def _flush_tc_supported(ring_dtype: torch.dtype, L: int, device: torch.device) -> bool:
    """Whether `_rank_update_tc` can run: 16-bit ring entries (the keys enter the product
    exactly), >= 16 padded ring entries (tl.dot's smallest K); bf16 only on a GPU (Triton's
    interpreter computes bf16 dots wrongly, fp16 ones right)."""
    return (ring_dtype in (torch.float16, torch.bfloat16) and triton.next_power_of_2(L) >= 16
            and (device.type == "cuda" or ring_dtype == torch.float16))


def _flush_tc(config: tuple, at: int, BV: int, ring_d: torch.Tensor, L: int) -> bool:
    """config[at] asks for the tensor-core flush; refuse it where it cannot run."""
    if not (len(config) > at and config[at]):
        return False
    if BV < 16 or not _flush_tc_supported(ring_d.dtype, L, ring_d.device):
        raise ValueError(
            f"config {config}: the tensor-core flush needs BV >= 16 (got {BV}), L > 8 (got {L}) and a "
            f"float16 ring, or a bfloat16 one on CUDA (got {ring_d.dtype} on {ring_d.device})")
    return True


def _row_flags(flags: torch.Tensor | None, n: int, name: str, device) -> tuple[torch.Tensor | None, int]:
    if flags is None:
        return None, 0
    if flags.ndim != 1 or flags.shape[0] < n:
        raise ValueError(f"{name} must be 1-D with at least {n} entries (got {tuple(flags.shape)})")
    if flags.device != device:
        raise ValueError(f"{name} must be on {device} (got {flags.device})")
    if flags.dtype == torch.bool:
        flags = flags.view(torch.uint8)  # same bytes, a dtype every Triton build loads
    return flags, flags.stride(0)


# Launch configurations: (BV, num_warps, prefetch_ring, group_heads[, mode[, nsplit]]).
#   BV            value rows per program (V split into cdiv(V, BV) blocks)
#   num_warps     warps per program
#   prefetch_ring fused kernel: read all L ring entries without waiting for the cursor ticket
#                 instead of only the n live ones (saves a dependent memory round trip);
#                 two-phase main kernel: prefetch the next chunk's state tile
#   group_heads   fused kernel: one program loops over the HV/H value heads of a key head
#   mode          0 = fused single kernel; 1 = two-phase (prep kernel per row and key head does
#                 the O(L K) ring work once, the main kernel streams the state); 2 = two-phase
#                 with programmatic dependent launch (Hopper+); 3 = replay-vector two-phase (the
#                 prep also folds the live ring d entries into r_q / r_k, the main kernel is
#                 native's shape); 4 = mode 3 with programmatic dependent launch
#   nsplit        modes 1 / 2: programs per (row, value head), each looping over its share of the
#                 V / BV chunks (default: one chunk per program); modes 3 / 4: warps per prep
#                 program (default 1)
#   flush_tc      fused (sixth element: (BV, w, pre, group, 0, flush_tc)), modes 1 / 2 (seventh): the
#                 flush's rank-n update as one tensor-core product (`_rank_update_tc`); needs a
#                 16-bit ring, BV >= 16 and L > 8 (bf16: on a GPU; the interpreter gets its dots wrong)
#
# Table from the H200 sweeps of 2026-12-01 (benchmarks/results/kernel_decode_sweeps_2026-12-01/;
# Triton 3.6, K=V=128, L=16, bf16 activations; pairs = rows x value heads, thresholds scaled by
# SMs/132). Small launches are latency-bound: one fused kernel, small tiles (its first tiles are
# loaded before the cursor ticket). From 512 pairs the two-phase launch with 8-row tiles. From
# 8192 pairs with a 16-bit state or a 16-bit ring, the replay-vector form: its main kernel runs
# at 62-82% of DRAM bandwidth where mode 1's runs at 54-77% (Nsight Compute, batch 512), which
# pays for its slower prep kernel (34-46 us at batch 512, mode 1's 19-23 us) only at large
# batch. With fp32 ring entries its prep reads twice the bytes and mode 1 stays. Below 1024
# pairs a flushing row's rank-n update is on the critical path of a latency-bound launch: with
# a 16-bit ring it runs on tensor cores (job 7 of the sweeps: 1-10% faster there, no gain above).
#
#   state    ring    pairs          config
#   any      16-bit  <= 64          (16, 1, prefetch, -, 0, tc)      fused, tensor-core flush
#   fp32     16-bit  <= 128         (16, 1, prefetch, -, 0, tc)      fused, tensor-core flush
#   16-bit   16-bit  129-511        (32, 1, -, -, two-phase + PDL, -, tc)
#   any      16-bit  512-1023       (16, 1, -, -, two-phase + PDL, -, tc)
#   any      any     <= 32          (8, 1, prefetch)                 fused
#   fp32     any     <= 64          (16, 1, prefetch)                fused
#   any      any     < 512          (32, 1, prefetch)                fused
#   16-bit   any     >= 8192        (16, 1, -, -, replay)
#   fp32     16-bit  >= 8192        (8, 1, -, -, replay)
#   any      any     >= 512         (8, 1, -, -, two-phase)
# (The tensor-core rows apply where `_flush_tc_supported`; elsewhere the rows below them.)
def pick_decode_config(N: int, HV: int, K: int, V: int, state_dtype: torch.dtype, device,
                       H: int | None = None, ring_dtype: torch.dtype | None = None,
                       L: int | None = None) -> tuple:
    """Launch configuration for a decode launch of N rows (see the table above)."""
    device = torch.device(device)
    bv_max = max(16, triton.next_power_of_2(V))
    scale = _num_sms(device) / 132.0
    pairs = N * HV / scale
    fp32_state = state_dtype == torch.float32
    tc = ring_dtype is not None and L is not None and _flush_tc_supported(ring_dtype, L, device)
    if pairs >= 512:
        if pairs >= 8192 and not fp32_state:
            return (16, 1, False, False, 3, 1)
        if pairs >= 8192 and ring_dtype != torch.float32:
            return (8, 1, False, False, 3, 1)
        if tc and pairs < 1024:
            return (16, 1, False, False, 2, 0, True)
        return (8, 1, False, False, 1)
    if tc and (pairs <= 64 or (fp32_state and pairs <= 128)):
        return (16, 1, True, False, 0, True)
    if tc and not fp32_state and pairs > 128:
        return (32, 1, False, False, 2, 0, True)
    if pairs <= 32:
        bv = 8
    elif pairs <= 64 and fp32_state:
        bv = 16
    else:
        bv = 32
    return (min(bv, bv_max), 1, True, False)


def ring_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    out: torch.Tensor,
    state_indices: torch.Tensor,
    ring_d: torch.Tensor,
    ring_k: torch.Tensor,
    ring_g: torch.Tensor,
    cursor: torch.Tensor,
    force_flush: torch.Tensor | None = None,
    start_empty: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    *,
    config: tuple | None = None,
) -> torch.Tensor:
    """One decode token per row through the replay ring (semantics of `ring_decode_reference`).

    Writes `out` ([N, HV, V] or [N, 1, HV, V], contiguous) and updates state / rings / cursor in
    place on the GPU: no host sync, safe to capture in a CUDA graph (the two-phase form allocates
    a small scratch per call, which under capture comes from the graph's memory pool).
    `config` = (BV, num_warps, prefetch_ring[, group_heads[, mode[, ...]]]) overrides the launch
    heuristic (`pick_decode_config`, whose table above lists the elements; for benchmarks and
    tests).
    Returns `out` viewed as [N, HV, V].
    """
    H, HV, K, V, L, (ss, sd, sk, sg) = ring_geometry(state, ring_d, ring_k, ring_g, cursor, 0xFFFF)
    N = check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, H, HV, K, V)
    if state_indices.ndim != 1 or state_indices.shape[0] != N:
        raise ValueError(f"state_indices must be 1-D of length {N}")
    if not out.is_contiguous() or out.numel() != N * HV * V:
        raise ValueError(f"out must be contiguous with N*HV*V = {N * HV * V} elements")
    dev = state.device
    check_device(dev, mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out,
                 state_indices=state_indices)
    ff, s_ff = _row_flags(force_flush, N, "force_flush", dev)
    se, s_se = _row_flags(start_empty, N, "start_empty", dev)
    out3 = out.view(N, HV, V)
    if N == 0:
        return out3

    BK = triton.next_power_of_2(K)
    LP = max(16, triton.next_power_of_2(L))
    if config is None:
        config = pick_decode_config(N, HV, K, V, state.dtype, dev, H, ring_d.dtype, L)
    if len(config) > 4 and config[4] in (3, 4):
        _replay_two_phase_decode(mixed_qkv, a, b, A_log, dt_bias, scale, state, out3, state_indices,
                                 ring_d, ring_k, ring_g, cursor, ff, s_ff, se, s_se, use_qk_l2norm,
                                 H, HV, K, V, L, BK, LP, (ss, sd, sk, sg), config)
        return out3
    if len(config) > 4 and config[4]:
        _two_phase_decode(mixed_qkv, a, b, A_log, dt_bias, scale, state, out3, state_indices,
                          ring_d, ring_k, ring_g, cursor, ff, s_ff, se, s_se, use_qk_l2norm,
                          H, HV, K, V, L, BK, LP, (ss, sd, sk, sg), config)
        return out3
    BV, num_warps, prefetch = config[:3]
    HPP = HV // H if (len(config) > 3 and config[3]) else 1
    BV = min(BV, max(16, triton.next_power_of_2(V)))
    NV = triton.cdiv(V, BV)
    if (HV // HPP) * NV >= 1 << (31 - _TICKET_SHIFT):
        raise ValueError(f"too many programs per row ({(HV // HPP) * NV}) for the cursor ticket")

    grid = (N * (HV // HPP) * NV,)
    _ring_decode_kernel[grid](
        mixed_qkv, a, b, A_log, dt_bias, out, state, state_indices,
        ring_d, ring_k, ring_g, cursor,
        ff if ff is not None else state_indices, se if se is not None else state_indices,
        float(scale),
        mixed_qkv.stride(0), a.stride(0), b.stride(0), state_indices.stride(0), s_ff, s_se,
        ss, sd, sk, sg,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, LP=LP, NV=NV, HPP=HPP,
        HAS_FF=ff is not None, HAS_SE=se is not None, L2NORM=bool(use_qk_l2norm),
        PREFETCH_RING=bool(prefetch), FLUSH_TC=_flush_tc(config, 5, BV, ring_d, L),
        num_warps=num_warps, num_stages=1,
    )
    return out3


def _two_phase_decode(mixed_qkv, a, b, A_log, dt_bias, scale, state, out3, idx,
                      ring_d, ring_k, ring_g, cursor, ff, s_ff, se, s_se, l2norm,
                      H, HV, K, V, L, BK, LP, strides, config):
    """Launch the prep and main kernels.

    config = (BV, num_warps, prefetch_next_chunk, -, mode[, nsplit[, flush_tc]]): mode 1 =
    two-phase, 2 = with programmatic dependent launch; nsplit = programs per (row, value head),
    each looping over cdiv(V / BV, nsplit) chunks of BV value rows (default, 0: one chunk per
    program); flush_tc: the flush on tensor cores.
    """
    ss, sd, sk, sg = strides
    N = mixed_qkv.shape[0]
    BV = min(config[0], max(16, triton.next_power_of_2(V)))
    NV = triton.cdiv(V, BV)
    nsplit = min(config[5], NV) if len(config) > 5 and config[5] else NV  # programs per (row, head)
    CH = triton.cdiv(NV, nsplit)
    nsplit = triton.cdiv(NV, CH)
    # Programmatic dependent launch lets the main kernel load its state tiles while the prep
    # kernel runs (Hopper and newer; the interpreter has no grid dependency control).
    pdl = config[4] == 2 and state.is_cuda and torch.cuda.get_device_capability(state.device)[0] >= 9
    dev = state.device
    qk = torch.empty(N, H, 2, BK, dtype=torch.float32, device=dev)
    coef = torch.empty(N, HV, 4, LP, dtype=torch.float32, device=dev)
    meta = torch.empty(N, dtype=torch.int32, device=dev)
    GP = triton.next_power_of_2(HV // H)
    _ring_prep_kernel[(N * H,)](
        mixed_qkv, a, b, A_log, dt_bias, idx, ring_k, ring_g, cursor,
        ff if ff is not None else idx, se if se is not None else idx,
        qk, coef, meta, float(scale),
        mixed_qkv.stride(0), a.stride(0), b.stride(0), idx.stride(0), s_ff, s_se, sk, sg,
        H=H, HV=HV, K=K, L=L, BK=BK, LP=LP, GP=GP,
        HAS_FF=ff is not None, HAS_SE=se is not None, L2NORM=bool(l2norm), USE_PDL=pdl,
        num_warps=2 if BK * LP <= 2048 else 4, num_stages=1,
    )
    extra = {"launch_pdl": True} if pdl else {}
    _ring_main_kernel[(N * HV * nsplit,)](
        mixed_qkv, out3, state, idx, ring_d, ring_k, cursor, qk, coef, meta,
        mixed_qkv.stride(0), idx.stride(0), ss, sd, sk,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, LP=LP, NSPLIT=nsplit, CH=CH,
        PREFETCH=bool(config[2]), USE_PDL=pdl, FLUSH_TC=_flush_tc(config, 6, BV, ring_d, L),
        num_warps=config[1], num_stages=1, **extra,
    )


def _replay_two_phase_decode(mixed_qkv, a, b, A_log, dt_bias, scale, state, out3, idx,
                             ring_d, ring_k, ring_g, cursor, ff, s_ff, se, s_se, l2norm,
                             H, HV, K, V, L, BK, LP, strides, config):
    """Launch the replay-vector prep and main kernels: config = (BV, num_warps, -, -, mode[,
    prep_warps]), mode 3, or 4 with programmatic dependent launch (Hopper and newer);
    prep_warps: warps per prep program (default 1)."""
    ss, sd, sk, sg = strides
    N = mixed_qkv.shape[0]
    BVF = max(16, triton.next_power_of_2(V))
    BV = min(config[0], BVF)
    NV = triton.cdiv(V, BV)
    pdl = config[4] == 4 and state.is_cuda and torch.cuda.get_device_capability(state.device)[0] >= 9
    dev = state.device
    rep = torch.empty(N, HV, 2, BVF, dtype=torch.float32, device=dev)
    sc = torch.empty(N, HV, 8, dtype=torch.float32, device=dev)
    wts = torch.empty(N, HV, LP, dtype=torch.float32, device=dev)
    meta = torch.empty(N, dtype=torch.int32, device=dev)
    _replay_prep_kernel[(N * H,)](
        mixed_qkv, a, b, A_log, dt_bias, idx, ring_d, ring_k, ring_g, cursor,
        ff if ff is not None else idx, se if se is not None else idx,
        rep, sc, wts, meta, float(scale),
        mixed_qkv.stride(0), a.stride(0), b.stride(0), idx.stride(0), s_ff, s_se, sd, sk, sg,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BVF=BVF, LP=LP,
        HAS_FF=ff is not None, HAS_SE=se is not None, L2NORM=bool(l2norm), USE_PDL=pdl,
        num_warps=config[5] if len(config) > 5 and config[5] else 1, num_stages=1,
    )
    extra = {"launch_pdl": True} if pdl else {}
    _replay_main_kernel[(N * HV * NV,)](
        mixed_qkv, out3, state, idx, ring_d, ring_k, cursor, rep, sc, wts, meta,
        mixed_qkv.stride(0), idx.stride(0), ss, sd, sk,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, BVF=BVF, LP=LP, NV=NV, FB=min(BV, 8), USE_PDL=pdl,
        num_warps=config[1], num_stages=1, **extra,
    )


def ring_materialize(
    state: torch.Tensor,
    ring_d: torch.Tensor,
    ring_k: torch.Tensor,
    ring_g: torch.Tensor,
    cursor: torch.Tensor,
    slots: torch.Tensor,
    start_empty: torch.Tensor | None = None,
) -> None:
    """Flush `slots` (entries <= 0 ignored): checkpoint = replayed state, cursor = 0.

    A slot whose ring is empty keeps its checkpoint bit-identical, and so does one whose
    `start_empty` flag (per entry of `slots`) is set: its ring is dropped, not replayed. Graph
    safe, no host sync. The valid entries of `slots` must be distinct.
    """
    H, HV, K, V, L, (ss, sd, sk, sg) = ring_geometry(state, ring_d, ring_k, ring_g, cursor, 0xFFFF)
    if slots.ndim != 1 or slots.device != state.device:
        raise ValueError("slots must be a 1-D tensor on the state's device")
    if start_empty is not None and (start_empty.shape[0] < slots.shape[0] or start_empty.stride(0) != 1
                                    or start_empty.device != state.device):
        raise ValueError("start_empty must be a contiguous 1-D tensor with an entry per slot, on the state's device")
    if slots.numel() == 0:
        return
    BK = triton.next_power_of_2(K)
    BV = min(32, max(16, triton.next_power_of_2(V)))
    NV = triton.cdiv(V, BV)
    LP = max(16, triton.next_power_of_2(L))
    if HV * NV >= 1 << (31 - _TICKET_SHIFT):
        raise ValueError(f"too many programs per slot ({HV * NV}) for the cursor ticket")
    grid = (slots.shape[0] * HV * NV,)
    _ring_materialize_kernel[grid](
        state, ring_d, ring_k, ring_g, cursor, slots, slots.stride(0),
        slots if start_empty is None else start_empty,
        ss, sd, sk, sg,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, LP=LP, NV=NV, HAS_EMPTY=start_empty is not None,
        num_warps=max(1, BV * BK // 4096), num_stages=1,
    )


def ring_reset(cursor: torch.Tensor, slots: torch.Tensor) -> None:
    """Mark `slots` empty (entries <= 0 ignored); checkpoints untouched. Graph safe."""
    if cursor.ndim != 1 or cursor.dtype != torch.int32 or cursor.stride(0) != 1:
        raise ValueError("cursor must be a contiguous 1-D int32 tensor")
    if slots.ndim != 1 or slots.device != cursor.device:
        raise ValueError("slots must be a 1-D tensor on the cursor's device")
    n = slots.shape[0]
    if n == 0:
        return
    BLOCK = 128
    _ring_reset_kernel[(triton.cdiv(n, BLOCK),)](cursor, slots, n, slots.stride(0), BLOCK=BLOCK, num_warps=4)
