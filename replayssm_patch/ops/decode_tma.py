"""TMA decode form for Hopper (imports torch and triton only; the main kernel is written in
Gluon, triton.experimental.gluon, against Triton 3.6's API).

The two-phase form's prep kernel (decode_two_phase) does the per-row ring work; the main kernel
here is persistent: each program walks the (row, value head, block of BV value rows) tiles
pid, pid + G, pid + 2 G, ... and keeps STAGES checkpoint tiles in flight as bulk tensor copies
(TMA) into a shared-memory ring, one mbarrier per buffer. A tile's buffer is refilled with the
tile STAGES steps ahead as soon as its contents are in registers, so DRAM sees STAGES tiles per
program in flight however long the replay arithmetic of the current tile takes -- the
Triton forms keep one tile per program in flight and are latency-bound at large batch.

Per tile, exactly the two-phase main kernel's arithmetic (same scratch from prep): two mat-vecs
on the checkpoint tile, the live ring d entries' low-rank part, the output, then the append
(not full) or the flush (full), whose rank-n part is one fp32 FMA product
[BV, LP] x [LP, K] (the rank-1 loop's terms, in the same order).

Needs CUDA capability 9.x and Triton 3.6 (launch.tma_capable) and a checkpoint the copies can address
(launch.tma_fits): K a power of two, V a multiple of BV, a 16-byte aligned base and slot stride;
the checkpoint is addressed as a 3-D [slots, HV*V, K] tensor, so any page stride works.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .cursor import DECODE_MASK_C, TICKET_SHIFT_C
from .decode_shared import use_pdl
from .decode_prep import launch_prep
from .launch import num_sms, programs_per_sm


@gluon.jit
def _load_tile(desc, bufs, bars, idx, stride_idx, tile, num_tiles, s,
               HV: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr):
    """Start the copy of `tile`'s checkpoint rows into buffer s (nothing past the last tile).
    A padding row (slot <= 0) copies slot 0's rows: every buffer's barrier completes once per
    use, which keeps the phase arithmetic uniform."""
    live = tile < num_tiles
    row = tile // (HV * NV)
    i_hv = (tile // NV) % HV
    i_v = tile % NV
    slot = gl.load(idx + row.to(gl.int64) * stride_idx, mask=live, other=0)
    slot = gl.maximum(slot, 0)
    mbarrier.expect(bars.index(s), desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(desc, [slot, i_hv * V + i_v * BV, 0], bars.index(s), bufs.index(s), pred=live)


@gluon.jit
def _tma_main_kernel(
    desc, qkv, out, state, idx, ring_d, ring_k, cursor, qk, coef, meta,
    stride_qkv, stride_idx, slot_stride_state, slot_stride_d, slot_stride_k, num_tiles,
    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, L: gl.constexpr,
    BV: gl.constexpr, LP: gl.constexpr, NV: gl.constexpr, STAGES: gl.constexpr,
    VEC: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr,
):
    GROUP: gl.constexpr = HV // H
    # Tile layout: 16-byte vectors along K, 8 lanes along K and 4 along the value rows, so a
    # row's reduction is in-thread plus 3 shuffles and a quarter warp reads 128 contiguous bytes.
    tile_l: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [num_warps, 1], [1, 0])
    # The ring part [BV, LP] (d entries transposed): the tile's rows, one entry per lane, so a
    # row sum lands in the tile's row layout with a trivial conversion (no data movement).
    ring_l: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [num_warps, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, tile_l)  # [BV] vectors
    cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)  # [K] vectors
    a_l: gl.constexpr = gl.DotOperandLayout(0, tile_l, 0)
    b_l: gl.constexpr = gl.DotOperandLayout(1, tile_l, 0)

    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, 1, BV, K], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()
    for b in gl.static_range(STAGES):
        _load_tile(desc, bufs, bars, idx, stride_idx, pid + b * grid, num_tiles, b, HV, V, BV, NV)
    if USE_PDL:  # the first tiles are on their way; now wait for the prep kernel's scratch
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    o_b = gl.arange(0, BV, layout=rows_l)
    o_k = gl.arange(0, K, layout=cols_l)
    o_lc = gl.arange(0, LP, layout=rows_l)  # ring entries as tile rows (the flush's keys)
    o_lr = gl.arange(0, LP, layout=gl.SliceLayout(0, ring_l))  # ... as ring-part columns
    o_rb = gl.arange(0, BV, layout=gl.SliceLayout(1, ring_l))

    count = gl.cdiv(num_tiles - pid, grid)
    for i in range(count):
        tile = pid + i * grid
        buf = i % STAGES
        phase = (i // STAGES) & 1
        row = (tile // (HV * NV)).to(gl.int64)
        i_hv = (tile // NV) % HV
        i_v = tile % NV
        i_h = i_hv // GROUP
        v0 = i_v * BV
        slot = gl.load(idx + row * stride_idx).to(gl.int64)
        # Issue this tile's small loads before waiting for its checkpoint rows.
        info = gl.load(meta + row)
        n = info & DECODE_MASK_C
        flush = (info >> TICKET_SHIFT_C) != 0
        p_qk = qk + (row * H + i_h) * (2 * K)
        q = gl.load(p_qk + o_k)
        k = gl.load(p_qk + K + o_k)
        c_row = coef + (row * HV + i_hv) * (4 * LP)
        cq = gl.load(c_row + LP + o_lr)
        ck = gl.load(c_row + 2 * LP + o_lr)
        eG = gl.load(c_row + 3 * LP)
        alpha = gl.load(c_row + 3 * LP + 1)
        beta = gl.load(c_row + 3 * LP + 2)
        k_dot_q = gl.load(c_row + 3 * LP + 3)
        v = gl.load(qkv + row * stride_qkv + 2 * H * K + i_hv * V + v0 + o_b).to(gl.float32)
        p_dr = ring_d + slot * slot_stride_d + i_hv * (L * V) + v0
        live = (o_lr < n)[None, :] & (slot > 0)
        rd = gl.load(p_dr + o_lr[None, :] * V + o_rb[:, None], mask=live, other=0.0).to(gl.float32)

        mbarrier.wait(bars.index(buf), phase)
        S = bufs.index(buf).reshape([BV, K]).load(tile_l).to(gl.float32)
        gl.thread_barrier()  # every warp has its rows: the buffer may be refilled
        _load_tile(desc, bufs, bars, idx, stride_idx, tile + STAGES * grid, num_tiles, buf,
                   HV, V, BV, NV)

        p_out = out + (row * HV + i_hv) * V + v0 + o_b
        if slot <= 0:
            gl.store(p_out, gl.zeros([BV], gl.float32, rows_l).to(out.dtype.element_ty))
        else:
            ring_q = gl.convert_layout(gl.sum(rd * cq[None, :], 1), rows_l, assert_trivial=True)
            ring_k_ = gl.convert_layout(gl.sum(rd * ck[None, :], 1), rows_l, assert_trivial=True)
            Sq = eG * gl.sum(S * q[None, :], 1) + ring_q
            Sk = eG * gl.sum(S * k[None, :], 1) + ring_k_
            d = beta * (v - alpha * Sk)
            o = alpha * Sq + d * k_dot_q
            gl.store(p_out, o.to(out.dtype.element_ty))
            if flush:
                # S_new = alpha (exp(G_n) S_c + sum_{j<n} w_j d_j k_j^T) + d k^T on the tile held;
                # ring entries j >= n are zero in both factors (poison never enters the sum).
                wd = rd * gl.load(c_row + o_lr)[None, :]
                p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
                rk = gl.load(p_kr + o_lc[:, None] * K + o_k[None, :], mask=(o_lc < n)[:, None], other=0.0)
                acc = gl.dot_fma(gl.convert_layout(wd, a_l), gl.convert_layout(rk.to(gl.float32), b_l), S * eG)
                S_new = alpha * acc + d[:, None] * k[None, :]
                p_s = state + slot * slot_stride_state + (i_hv * V + v0 + o_b)[:, None] * K + o_k[None, :]
                gl.store(p_s, S_new.to(state.dtype.element_ty))
            else:
                gl.store(p_dr + n * V + o_b, d.to(ring_d.dtype.element_ty))
            if (i_hv == 0) & (i_v == 0):
                gl.store(cursor + slot, gl.where(flush, 0, n + 1))

    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))


@functools.lru_cache(maxsize=64)
def _smem_layout(dtype: torch.dtype):
    bits = torch.finfo(dtype).bits
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=3)


def launch_tma(launch, args, geo) -> None:
    """Run the prep kernel and the persistent TMA main kernel (see decode.ring_decode)."""
    N, H, HV, K, V, L, LP = geo.N, geo.H, geo.HV, geo.K, geo.V, geo.L, geo.LP
    ss, sd, sk, _ = geo.strides
    BV = launch.block_v
    state = args.state  # decode.ring_decode checked that the form runs here and fits it
    pdl = use_pdl(launch, state)
    qk, coef, meta = launch_prep(args, geo, pdl)
    desc = TensorDescriptor(state, [state.shape[0], HV * V, K], [ss, K, 1], [1, BV, K], _smem_layout(state.dtype))
    NV = V // BV
    num_tiles = N * HV * NV
    kernel_args = (desc, args.qkv, args.out, state, args.idx, args.ring_d, args.ring_k, args.cursor, qk, coef, meta,
                   args.qkv.stride(0), args.idx.stride(0), ss, sd, sk, num_tiles)
    e = state.element_size()
    constexprs = dict(H=H, HV=HV, K=K, V=V, L=L, BV=BV, LP=LP, NV=NV, STAGES=launch.stages, VEC=16 // e,
                      USE_PDL=pdl, num_warps=launch.num_warps, maxnreg=launch.max_regs or None)
    grid = min(num_tiles, num_sms(state.device) * programs_per_sm(_tma_main_kernel, kernel_args, constexprs,
                                                                  state.device))
    _tma_main_kernel[(grid,)](*kernel_args, **constexprs, **({"launch_pdl": True} if pdl else {}))
