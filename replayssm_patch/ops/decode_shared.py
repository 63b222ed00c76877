"""Pieces the decode forms share: the tensor-core flush, a prep kernel's cursor read, the
per-row flag arguments (imports torch and triton only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2


@triton.jit
def rank_update_tc(rd, w, rk, live):
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
def row_cursor(cursor, slot, start_empty, force_flush, row, stride_se, stride_ff,
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


class RowFlags:
    """An optional per-row flag tensor as the kernels take it: the tensor (bool viewed as
    uint8), its stride, and whether it was given (a kernel needs some pointer either way)."""

    def __init__(self, flags: torch.Tensor | None, n: int, name: str, device, fallback: torch.Tensor):
        if flags is not None:
            if flags.ndim != 1 or flags.shape[0] < n:
                raise ValueError(f"{name} must be 1-D with at least {n} entries (got {tuple(flags.shape)})")
            if flags.device != device:
                raise ValueError(f"{name} must be on {device} (got {flags.device})")
            if flags.dtype == torch.bool:
                flags = flags.view(torch.uint8)  # same bytes, a dtype every Triton build loads
        self.given = flags is not None
        self.ptr = flags if self.given else fallback
        self.stride = flags.stride(0) if self.given else 0


def block_v(launch_block_v: int, V: int) -> int:
    """A launch's value rows per program, at most V rounded up to a power of two (>= 16)."""
    return min(launch_block_v, max(16, next_pow2(V)))


def use_pdl(launch, state: torch.Tensor) -> bool:
    """Programmatic dependent launch where the launch asks for it and the GPU has it (Hopper
    and newer; the interpreter has no grid dependency control)."""
    return launch.pdl and state.is_cuda and torch.cuda.get_device_capability(state.device)[0] >= 9
