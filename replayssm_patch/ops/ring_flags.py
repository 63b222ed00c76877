"""Integration kernel (not a ring op): a step's per-row ring flags from vLLM's attention
metadata, in one launch. It encodes vLLM's metadata semantics (prefix-cache blocks in align
mode); its one caller is `fill_flags` (replayssm_patch/ring/flags.py, called by the metadata
builder every step on the host, where each torch op would be a launch of its own), whose CPU
branch is the torch twin (tests/test_ring_flags_interpret.py checks they agree). Imports only torch and
triton.

From vLLM's `query_start_loc` and `seq_lens` (tokens computed after the step), with
computed[i] = seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i]) the tokens before it:

  prefix-cache align mode (block_size given):
    force_flush[i] = seq_lens[i] % block_size == 0   the step completes a block
    start_empty[i] = computed[i] % block_size == 0   the row starts a block
  otherwise:
    force_flush[i] = 0
    start_empty[i] = computed[i] == 0                 the row has no prior state

Writes rows 0..rows-1 of the int8 flag buffers, nothing past them. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ring_checks import check_device

_BLOCK = 256


@triton.jit
def _ring_flags_kernel(qsl, seq, force, empty, rows, block_size, stride_qsl, stride_seq,
                       ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < rows
    s = tl.load(seq + offs * stride_seq, mask=m, other=0).to(tl.int64)
    q = (tl.load(qsl + (offs + 1) * stride_qsl, mask=m, other=0).to(tl.int64)
         - tl.load(qsl + offs * stride_qsl, mask=m, other=0).to(tl.int64))
    computed = s - q
    if ALIGN:
        f = (s % block_size) == 0
        e = (computed % block_size) == 0
    else:
        f = tl.zeros([BLOCK], dtype=tl.int1)
        e = computed == 0
    tl.store(force + offs, f.to(tl.int8), mask=m)
    tl.store(empty + offs, e.to(tl.int8), mask=m)


def ring_flags(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, force_flush: torch.Tensor,
               start_empty: torch.Tensor, rows: int, block_size: int | None) -> None:
    """Write this step's ring flags (the formulas: module docstring). No host sync.

    Args:
        query_start_loc (torch.Tensor):
            vLLM's `query_start_loc`, 1-D int32 or int64 with at least rows + 1 entries.
        seq_lens (torch.Tensor):
            vLLM's `seq_lens` (tokens computed after the step), 1-D int32 or int64.
        force_flush (torch.Tensor), start_empty (torch.Tensor):
            contiguous int8 flag buffers with at least `rows` entries.
        rows (int):
            the rows of this step: entries 0..rows-1 are written, nothing past them.
        block_size (int | None):
            the prefix-cache block size in align mode, None otherwise.

    Returns:
        None.
    """
    for name, t, need in (("query_start_loc", query_start_loc, rows + 1), ("seq_lens", seq_lens, rows)):
        if t.ndim != 1 or t.shape[0] < need or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be 1-D int32 or int64 with at least {need} entries "
                             f"(got {t.dtype} {tuple(t.shape)})")
    for name, t in (("force_flush", force_flush), ("start_empty", start_empty)):
        if t.ndim != 1 or t.shape[0] < rows or t.dtype != torch.int8 or t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous 1-D int8 with at least {rows} entries "
                             f"(got {t.dtype} {tuple(t.shape)})")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int or None (got {block_size!r})")
    check_device(force_flush.device, query_start_loc=query_start_loc, seq_lens=seq_lens, start_empty=start_empty)
    if rows:
        _ring_flags_kernel[(triton.cdiv(rows, _BLOCK),)](
            query_start_loc, seq_lens, force_flush, start_empty, rows, block_size or 1,
            query_start_loc.stride(0), seq_lens.stride(0), ALIGN=block_size is not None, BLOCK=_BLOCK, num_warps=4,
        )
