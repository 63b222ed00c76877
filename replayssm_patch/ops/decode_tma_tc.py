"""TMA decode form with tensor-core mat-vecs, for 16-bit checkpoints on Hopper (imports torch
and triton only; the main kernel is Gluon, written against Triton 3.6's API).

The TMA form (decode_tma) spends most of its instructions on the two mat-vecs S_c q and S_c k:
every 16-bit element is unpacked to fp32 and multiplied twice on the FMA pipe, about twice the
instructions per byte of an fp32 state. Here one tensor-core product does both:

    [BV, K] checkpoint tile (as stored)  x  [K, 8] = q_0 q_1 q_2 k_0 k_1 k_2 0 0

where q = q_0 + q_1 + q_2 is q split into three numbers of the state's dtype (each the rounding
of what the earlier ones leave), likewise k. The tile's elements are exact in that dtype, every
product is exact in fp32 and the split keeps 24 mantissa bits of q (bf16) or all that fp16's
range allows, so the mat-vecs agree with fp32 FMAs to fp32 accumulation order. The prep kernel
writes the split (`parts`, [N * H, 8, K]); each program copies a tile's parts beside its
checkpoint rows by TMA, and reads the tile only as tensor-core operands: no unpacking, and a
few shuffles per tile instead of three per row. Only a flushing tile (one step in L) loads its rows into registers, for the rank-n
update -- on tensor cores too with a 16-bit ring (the two-phase tensor-core flush's split of
w_j d_j, decode_shared.rank_update_tc), as rank-1 fp32 updates with an fp32 ring.

Same persistent pipeline as decode_tma: STAGES tiles in flight per program, one mbarrier per
buffer and per operand (the checkpoint rows are copied before a PDL wait on the prep kernel,
the parts after it). Needs launch.tma_capable, launch.tma_fits, a 16-bit state, K >= 32 (the
MMA operands' 8-key runs per thread need two MMA steps of 16 keys), and blocks of at least 16
value rows per warp.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .cursor import DECODE_MASK_C, TICKET_SHIFT_C
from .decode_shared import use_pdl
from .decode_prep import launch_prep
from .launch import num_sms, programs_per_sm

PARTS = 8  # columns of the mat-vec operand: 3 parts of q, 3 of k, 2 zero (the MMA's N is 8)


@gluon.jit
def _tile_coords(tile, HV: gl.constexpr, NV: gl.constexpr):
    return tile // (HV * NV), (tile // NV) % HV, tile % NV


@gluon.jit
def _load_rows(desc, bufs, bars, idx, stride_idx, tile, num_tiles, s,
               HV: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr):
    """Start the copy of `tile`'s checkpoint rows into buffer s (a padding row copies slot 0's)."""
    live = tile < num_tiles
    row, i_hv, i_v = _tile_coords(tile, HV, NV)
    slot = gl.maximum(gl.load(idx + row.to(gl.int64) * stride_idx, mask=live, other=0), 0)
    mbarrier.expect(bars.index(s), desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(desc, [slot, i_hv * V + i_v * BV, 0], bars.index(s), bufs.index(s), pred=live)


@gluon.jit
def _load_parts(desc, bufs, bars, tile, num_tiles, s, H: gl.constexpr, HV: gl.constexpr, NV: gl.constexpr):
    """Start the copy of `tile`'s q / k parts (written by the prep kernel) into buffer s."""
    live = tile < num_tiles
    row, i_hv, _ = _tile_coords(tile, HV, NV)
    mbarrier.expect(bars.index(s), desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(desc, [row * H + i_hv // (HV // H), 0, 0], bars.index(s), bufs.index(s),
                                    pred=live)


@gluon.jit
def _tma_tc_main_kernel(
    desc_s, desc_p, qkv, out, state, idx, ring_d, ring_k, cursor, qk, coef, meta,
    stride_qkv, stride_idx, slot_stride_state, slot_stride_d, slot_stride_k, num_tiles,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, L: gl.constexpr,
    BV: gl.constexpr, LP: gl.constexpr, NV: gl.constexpr, STAGES: gl.constexpr, KC: gl.constexpr,
    RING_TC: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr,
):
    GROUP: gl.constexpr = HV // H
    NP: gl.constexpr = 8
    # One MMA layout for every product: 16 value rows per warp, so the [BV] vectors (rows of the
    # mat-vec result, of the flush tile, of the ring part) all share its row layout.
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma_l, 8)  # 8 consecutive keys per thread: 16-byte reads
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma_l, 8)
    # The flush's product has as few as 16 ring entries along its reduction (one MMA step),
    # which the 8-wide operands above do not cover (wrong results on an H200); 2-wide ones do.
    fa_l: gl.constexpr = gl.DotOperandLayout(0, mma_l, 2)
    fb_l: gl.constexpr = gl.DotOperandLayout(1, mma_l, 2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma_l)

    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    bufs = gl.allocate_shared_memory(desc_s.dtype, [STAGES, 1, BV, K], desc_s.layout)
    pbufs = gl.allocate_shared_memory(desc_p.dtype, [STAGES, 1, NP, K], desc_p.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pbars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
        mbarrier.init(pbars.index(b), count=1)
    fence_async_shared()
    for b in gl.static_range(STAGES):
        _load_rows(desc_s, bufs, bars, idx, stride_idx, pid + b * grid, num_tiles, b, HV, V, BV, NV)
    if USE_PDL:  # the first tiles' rows are on their way; the parts come from the prep kernel
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    for b in gl.static_range(STAGES):
        _load_parts(desc_p, pbufs, pbars, pid + b * grid, num_tiles, b, H, HV, NV)

    o_b = gl.arange(0, BV, layout=rows_l)
    o_c = gl.arange(0, NP, layout=cols_l)
    o_l = gl.arange(0, LP, layout=cols_l)  # ring entries as columns of the ring part
    o_kc = gl.arange(0, KC, layout=cols_l)
    o_lk = gl.arange(0, LP, layout=gl.SliceLayout(1, fb_l))  # ring entries as rows of the flush's keys
    o_kk = gl.arange(0, KC, layout=gl.SliceLayout(0, fb_l))

    count = gl.cdiv(num_tiles - pid, grid)
    for i in range(count):
        tile = pid + i * grid
        buf = i % STAGES
        phase = (i // STAGES) & 1
        row, i_hv, i_v = _tile_coords(tile, HV, NV)
        row = row.to(gl.int64)
        i_h = i_hv // GROUP
        v0 = i_v * BV
        slot = gl.load(idx + row * stride_idx).to(gl.int64)
        info = gl.load(meta + row)  # prep writes nothing for a padding row (slot <= 0)
        n = gl.where(slot > 0, info & DECODE_MASK_C, 0)
        flush = ((info >> TICKET_SHIFT_C) != 0) & (slot > 0)
        c_row = coef + (row * HV + i_hv) * (4 * LP)
        cq = gl.load(c_row + LP + o_l)
        ck = gl.load(c_row + 2 * LP + o_l)
        eG = gl.load(c_row + 3 * LP)
        alpha = gl.load(c_row + 3 * LP + 1)
        beta = gl.load(c_row + 3 * LP + 2)
        k_dot_q = gl.load(c_row + 3 * LP + 3)
        v = gl.load(qkv + row * stride_qkv + 2 * H * K + i_hv * V + v0 + o_b).to(gl.float32)
        p_dr = ring_d + slot * slot_stride_d + i_hv * (L * V) + v0
        live = (o_l < n)[None, :] & (slot > 0)
        rd = gl.load(p_dr + o_l[None, :] * V + o_b[:, None], mask=live, other=0.0).to(gl.float32)

        mbarrier.wait(bars.index(buf), phase)
        mbarrier.wait(pbars.index(buf), phase)
        tile_s = bufs.index(buf).reshape([BV, K])
        S_op = tile_s.load(a_l)
        P_op = pbufs.index(buf).reshape([NP, K]).permute((1, 0)).load(b_l)
        if not flush:  # the buffers may be refilled (a flush still reads the rows below)
            gl.thread_barrier()
            _load_rows(desc_s, bufs, bars, idx, stride_idx, tile + STAGES * grid, num_tiles, buf, HV, V, BV, NV)
            _load_parts(desc_p, pbufs, pbars, tile + STAGES * grid, num_tiles, buf, H, HV, NV)
        SP = mma_v2(S_op, P_op, gl.zeros([BV, NP], gl.float32, mma_l))

        p_out = out + (row * HV + i_hv) * V + v0 + o_b
        Sq = eG * gl.sum(gl.where(o_c[None, :] < 3, SP, 0.0), 1) + gl.sum(rd * cq[None, :], 1)
        Sk = eG * gl.sum(gl.where((o_c[None, :] >= 3) & (o_c[None, :] < 6), SP, 0.0), 1) + gl.sum(rd * ck[None, :], 1)
        d = beta * (v - alpha * Sk)
        o = alpha * Sq + d * k_dot_q
        gl.store(p_out, gl.where(slot > 0, o, 0.0).to(out.dtype.element_ty))
        if flush:
            # S_new = alpha (exp(G_n) S_c + sum_{j<n} w_j d_j k_j^T) + d k^T, KC key columns at a
            # time; ring entries j >= n are zero in both factors (poison never enters the sum).
            p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
            p_k = qk + (row * H + i_h) * (2 * K) + K
            if RING_TC:
                wd = rd * gl.load(c_row + o_l)[None, :]
                hi = wd.to(ring_k.dtype.element_ty)
                lo = (wd - hi.to(gl.float32)).to(ring_k.dtype.element_ty)
                hi = gl.convert_layout(hi, fa_l)
                lo = gl.convert_layout(lo, fa_l)
            for c in gl.static_range(K // KC):
                S_c = tile_s.slice(c * KC, KC, 1).load(mma_l).to(gl.float32) * eG
                if RING_TC:
                    rk = gl.load(p_kr + o_lk[:, None] * K + c * KC + o_kk[None, :], mask=(o_lk < n)[:, None],
                                 other=0.0)
                    S_c = mma_v2(hi, rk, mma_v2(lo, rk, S_c))
                else:
                    for j in range(0, n):  # rank-1 fp32 updates
                        w_d = gl.load(c_row + j) * gl.load(p_dr + j * V + o_b).to(gl.float32)
                        S_c += w_d[:, None] * gl.load(p_kr + j * K + c * KC + o_kc)[None, :].to(gl.float32)
                k_c = gl.load(p_k + c * KC + o_kc)
                S_new = alpha * S_c + d[:, None] * k_c[None, :]
                p_s = state + slot * slot_stride_state + (i_hv * V + v0 + o_b)[:, None] * K + c * KC + o_kc[None, :]
                gl.store(p_s, S_new.to(state.dtype.element_ty), mask=slot > 0)
            gl.thread_barrier()
            _load_rows(desc_s, bufs, bars, idx, stride_idx, tile + STAGES * grid, num_tiles, buf, HV, V, BV, NV)
            _load_parts(desc_p, pbufs, pbars, tile + STAGES * grid, num_tiles, buf, H, HV, NV)
        elif slot > 0:
            gl.store(p_dr + n * V + o_b, d.to(ring_d.dtype.element_ty))
        if (i_hv == 0) & (i_v == 0) & (slot > 0):
            gl.store(cursor + slot, gl.where(flush, 0, n + 1))

    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))
        mbarrier.invalidate(pbars.index(b))


@functools.lru_cache(maxsize=64)
def _smem_layout(dtype: torch.dtype, block: tuple):
    """The swizzled layout MMA operands are read from without bank conflicts (TMA writes it)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, str(dtype)[6:]))


def launch_tma_tc(launch, args, geo) -> None:
    """Run the prep kernel (with the q / k parts) and the persistent main kernel (see
    decode.ring_decode)."""
    N, H, HV, K, V, L, LP = geo.N, geo.H, geo.HV, geo.K, geo.V, geo.L, geo.LP
    ss, sd, sk, _ = geo.strides
    BV = launch.block_v
    state = args.state
    pdl = use_pdl(launch, state)
    parts = torch.empty(N * H, PARTS, K, dtype=state.dtype, device=state.device)
    qk, coef, meta = launch_prep(args, geo, pdl, parts=parts)
    s_block = (1, BV, K)
    desc_s = TensorDescriptor(state, [state.shape[0], HV * V, K], [ss, K, 1], list(s_block),
                              _smem_layout(state.dtype, s_block))
    desc_p = TensorDescriptor(parts, [N * H, PARTS, K], [PARTS * K, K, 1], [1, PARTS, K],
                              _smem_layout(state.dtype, (1, PARTS, K)))
    NV = V // BV
    num_tiles = N * HV * NV
    kernel_args = (desc_s, desc_p, args.qkv, args.out, state, args.idx, args.ring_d, args.ring_k, args.cursor,
                   qk, coef, meta, args.qkv.stride(0), args.idx.stride(0), ss, sd, sk, num_tiles)
    constexprs = dict(H=H, HV=HV, K=K, V=V, L=L, BV=BV, LP=LP, NV=NV, STAGES=launch.stages, KC=min(K, 32),
                      RING_TC=args.ring_k.dtype in (torch.float16, torch.bfloat16), USE_PDL=pdl, num_warps=launch.num_warps,
                      maxnreg=launch.max_regs or None)
    grid = min(num_tiles, num_sms(state.device) * programs_per_sm(_tma_tc_main_kernel, kernel_args, constexprs,
                                                                  state.device))
    _tma_tc_main_kernel[(grid,)](*kernel_args, **constexprs, **({"launch_pdl": True} if pdl else {}))
