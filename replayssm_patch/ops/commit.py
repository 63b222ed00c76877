"""The delayed commit of speculative decoding: `ring_commit`, its kernel, and the device
functions that compute a slot's committed count, which the verify kernels (verify.py) and the
ucache bookkeeping (ucache.py) share (imports torch and triton only).

Semantics: `commit_reference.ring_commit_pending_reference` on the packed cursor word
(cursor.py): where a window is pending, n = min(n + min(num_accepted, pending), L); the
window is cleared. Afterwards the slot holds the plain entry count that `ring_decode` and
`ring_materialize` read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cursor import COUNT_MASK, COUNT_MASK_C, PENDING_MASK_C, PENDING_SHIFT_C
from .launch import cdiv
from .ring_checks import check_device, rows_tensor


@triton.jit
def committed_count(word, acc, row, stride_acc, L: tl.constexpr, HAS_ACC: tl.constexpr):
    """Committed entries of a slot whose cursor word is `word`, after the delayed commit of
    min(num_accepted, pending) entries (acc[row]: num_accepted; tickets in `word` ignored)."""
    n = word & COUNT_MASK_C
    if HAS_ACC:
        pend = (word >> PENDING_SHIFT_C) & PENDING_MASK_C
        acc_i = tl.maximum(tl.load(acc + row * stride_acc).to(tl.int32), 0)
        n = n + tl.where(pend > 0, tl.minimum(acc_i, pend), 0)
    return tl.minimum(n, L)


@triton.jit
def commit_rows(cursor, idx, acc, offs, rows, stride_idx, stride_acc, L: tl.constexpr, HAS_ACC: tl.constexpr):
    """The delayed commit of rows `offs` (mask `rows`): stores and returns each real row's
    committed count; returns (slot, real, n)."""
    s = tl.load(idx + offs.to(tl.int64) * stride_idx, mask=rows, other=0).to(tl.int64)
    real = rows & (s > 0)
    word = tl.load(cursor + s, mask=real, other=0)
    n = word & COUNT_MASK_C
    if HAS_ACC:
        pend = (word >> PENDING_SHIFT_C) & PENDING_MASK_C
        a_i = tl.maximum(tl.load(acc + offs.to(tl.int64) * stride_acc, mask=real, other=0).to(tl.int32), 0)
        n = n + tl.where(pend > 0, tl.minimum(a_i, pend), 0)
    n = tl.minimum(n, L)
    tl.store(cursor + s, n, mask=real)
    return s, real, n


# like materialize.py's kernels: one variant whatever the row count and the slices' alignment
@triton.jit(do_not_specialize=["n_rows", "stride_idx", "stride_acc"], do_not_specialize_on_alignment=["idx", "acc"])
def _ring_commit_kernel(cursor, idx, acc, n_rows, stride_idx, stride_acc,
                        L: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    commit_rows(cursor, idx, acc, offs, offs < n_rows, stride_idx, stride_acc, L, HAS_ACC)


def check_commit_args(cursor, state_indices, num_accepted, L, name="state_indices"):
    """The checks of a delayed commit's arguments; returns (num_accepted, its stride) as
    `ring_checks.rows_tensor` does."""
    if cursor.ndim != 1 or cursor.dtype != torch.int32 or cursor.stride(0) != 1:
        raise ValueError("cursor must be a contiguous 1-D int32 tensor")
    if state_indices.ndim != 1:
        raise ValueError(f"{name} must be 1-D (got {tuple(state_indices.shape)})")
    if not isinstance(L, int) or not 1 <= L <= COUNT_MASK:
        raise ValueError(f"L must be an int in [1, {COUNT_MASK}] (got {L!r})")
    check_device(cursor.device, **{name: state_indices})
    return rows_tensor(num_accepted, state_indices.shape[0], "num_accepted", cursor.device)


def ring_commit(cursor: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor | None,
                L: int) -> None:
    """Commit each slot's pending verify window (semantics of `ring_commit_pending_reference` on
    the packed cursor word). Graph safe, no host sync.

    Args:
        cursor (torch.Tensor):
            packed cursor words `n | pending << 8`, contiguous int32 of shape `[slots]`;
            updated in place.
        state_indices (torch.Tensor):
            the slot of each row, 1-D int32 or int64; rows with slot <= 0 are ignored.
        num_accepted (torch.Tensor | None):
            tokens accepted per row (vLLM's `num_accepted_tokens`), 1-D int32 or int64 with an
            entry per row; None drops every window.
        L (int):
            the ring length, in [1, 255]: n never exceeds it.

    Returns:
        None. Afterwards each real row's slot holds min(n + min(num_accepted, pending), L) with
        no window pending: the plain entry count that ring_decode / ring_materialize expect.
    """
    acc, s_acc = check_commit_args(cursor, state_indices, num_accepted, L)
    n = state_indices.shape[0]
    if n == 0:
        return
    BLOCK = 128
    _ring_commit_kernel[(cdiv(n, BLOCK),)](
        cursor, state_indices, acc if acc is not None else state_indices, n,
        state_indices.stride(0), s_acc, L=L, HAS_ACC=acc is not None, BLOCK=BLOCK, num_warps=4,
    )
