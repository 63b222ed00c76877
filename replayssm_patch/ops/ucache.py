"""Integration kernels (not ring ops): the ring bookkeeping around FlashInfer's ReplaySSM
"ucache" verify kernel. They encode what that external kernel leaves to its caller; their one
caller is replayssm_patch/ring/flashinfer.py (`mtp_kernel="flashinfer"`), around each launch.

FlashInfer's `gated_delta_rule_mtp_ucache_flush` writes the same ring content as our verify
kernel (see `verify_reference`) but leaves the cursor to the caller and takes at most
`live_rows` committed entries per row. These two launches do what it leaves, one row per
lane or program, so the step costs the external kernel plus four launches:

  ucache_prepare  (before it) the delayed commit of each row's previous window (as
                  `ring_commit`: commit.commit_rows), then what the kernel takes per row: its
                  slot (int32, 0 for padding rows), its committed count `hist`, a zero ring
                  base, and the slots whose rings hold more than `live_rows` entries, which the
                  caller folds into their checkpoints first (`ring_materialize`; their `hist`
                  is 0);
  ucache_finish   (after it) a row whose window did not fit after its `hist` entries was folded
                  by the kernel and its window written at `hist`..: move those `window` entries
                  (d, k, G) to the ring's start; then mark every real row's window pending in
                  its cursor word (n | window << 8, n = 0 for the folded rows).

No host sync; CUDA-graph safe. Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .commit import check_commit_args, commit_rows
from .cursor import PENDING_SHIFT

_BLOCK = 128


@triton.jit
def _ucache_prepare_kernel(cursor, idx, acc, slot_out, hist_out, base_out, fold_out, n_rows,
                           stride_idx, stride_acc, L: tl.constexpr, LIVE: tl.constexpr,
                           HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = offs < n_rows
    s, real, n = commit_rows(cursor, idx, acc, offs, rows, stride_idx, stride_acc, L, HAS_ACC)
    fold = real & (n > LIVE)
    zero = tl.zeros_like(n)
    tl.store(slot_out + offs, tl.where(real, s, 0).to(tl.int32), mask=rows)
    tl.store(hist_out + offs, tl.where(real & ~fold, n, zero), mask=rows)
    tl.store(base_out + offs, zero, mask=rows)
    tl.store(fold_out + offs, tl.where(fold, s, 0).to(tl.int32), mask=rows)


@triton.jit
def _ucache_finish_kernel(ring_d, ring_k, ring_g, cursor, slots, hist,
                          sd0, sd1, sd2, sd3, sk0, sk1, sk2, sk3, sg0, sg1, sg2,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          W: tl.constexpr, LIVE: tl.constexpr, PENDING_SHIFT: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(slots + i).to(tl.int64)
    h = tl.load(hist + i)
    if s > 0:
        folded = h >= LIVE - W + 1
        if folded:  # source h.. and destination 0..W-1 never overlap: h >= LIVE - W + 1 >= W
            w = tl.arange(0, W)
            src = (h + w).to(tl.int64)
            dst = w.to(tl.int64)
            v = tl.arange(0, V)
            for j in range(HV):
                base = ring_d + s * sd0 + j * sd1
                rows = tl.load(base + src[:, None] * sd2 + v[None, :] * sd3)
                tl.store(base + dst[:, None] * sd2 + v[None, :] * sd3, rows)
                g = tl.load(ring_g + s * sg0 + j * sg1 + src * sg2)
                tl.store(ring_g + s * sg0 + j * sg1 + dst * sg2, g)
            kk = tl.arange(0, K)
            for j in range(H):
                base = ring_k + s * sk0 + j * sk1
                rows = tl.load(base + src[:, None] * sk2 + kk[None, :] * sk3)
                tl.store(base + dst[:, None] * sk2 + kk[None, :] * sk3, rows)
        tl.store(cursor + s, tl.where(folded, 0, h) | (W << PENDING_SHIFT))


def ucache_prepare(cursor: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor | None, L: int,
                   live_rows: int):
    """Before FlashInfer's ucache kernel: commit each row's previous window and compute what
    that kernel takes per row. No host sync.

    Args:
        cursor (torch.Tensor):
            packed cursor words (cursor.py), contiguous int32 `[slots]`; committed in place.
        slots (torch.Tensor):
            the slot of each row, 1-D; rows with slot <= 0 are padding.
        num_accepted (torch.Tensor | None):
            tokens accepted per row in the previous step; None drops the windows.
        L (int):
            the ring length, in [1, 255].
        live_rows (int):
            the most committed entries the kernel takes per row, in [1, L].

    Returns:
        (slot, hist, base, fold), int32 `[rows]` each, contiguous and 16-byte aligned: the
        row's slot (0 for padding), its committed count (0 for a folded row), zeros (the ring
        base), and the slots whose rings hold more than `live_rows` entries (0 elsewhere),
        which the caller folds into their checkpoints (`ring_materialize`) before the kernel.
    """
    acc, s_acc = check_commit_args(cursor, slots, num_accepted, L, "slots")
    if not isinstance(live_rows, int) or not 1 <= live_rows <= L:
        raise ValueError(f"live_rows must be an int in [1, L={L}] (got {live_rows!r})")
    rows = slots.shape[0]
    # Each output starts 16-byte aligned: FlashInfer takes them through DLPack with that
    # alignment assumed (an unpadded [4, rows] buffer failed its GPU test at rows = 7).
    padded = -(-rows // 4) * 4
    slot_out, hist, base, fold = torch.empty((4, padded), dtype=torch.int32, device=cursor.device)[:, :rows]
    if rows:
        _ucache_prepare_kernel[(triton.cdiv(rows, _BLOCK),)](
            cursor, slots, acc if acc is not None else slots, slot_out, hist, base, fold, rows,
            slots.stride(0), s_acc, L=L, LIVE=live_rows, HAS_ACC=acc is not None, BLOCK=_BLOCK, num_warps=4,
        )
    return slot_out, hist, base, fold


def ucache_finish(ring_d: torch.Tensor, ring_k: torch.Tensor, ring_g: torch.Tensor, cursor: torch.Tensor,
                  slots: torch.Tensor, hist: torch.Tensor, window: int, live_rows: int) -> None:
    """After FlashInfer's ucache kernel: move the windows it wrote behind entries it folded to
    the ring's start, and mark every real row's window pending. No host sync.

    Args:
        ring_d (torch.Tensor), ring_k (torch.Tensor), ring_g (torch.Tensor):
            the rings, `[slots, HV, L, V]`, `[slots, H, L, K]`, `[slots, HV, L]`; K and V
            powers of two.
        cursor (torch.Tensor):
            packed cursor words (cursor.py), int32 `[slots]`.
        slots (torch.Tensor), hist (torch.Tensor):
            `ucache_prepare`'s slot and hist outputs (int32, contiguous).
        window (int):
            the tokens per row, a power of two <= live_rows.
        live_rows (int):
            as given to `ucache_prepare`, <= L.

    Returns:
        None. Each real row's cursor word is `n | window << 8`, n its committed count (0 where
        the kernel folded the ring).
    """
    _, HV, L, V = ring_d.shape
    H, K = ring_k.shape[1], ring_k.shape[3]
    if ring_k.shape[2] != L or ring_g.shape[1:] != (HV, L):
        raise ValueError(f"ring shapes disagree: d {tuple(ring_d.shape)}, k {tuple(ring_k.shape)}, "
                         f"g {tuple(ring_g.shape)}")
    if K & (K - 1) or V & (V - 1):
        raise ValueError(f"head dims must be powers of two (got K={K}, V={V})")
    if window < 1 or window & (window - 1) or not window <= live_rows <= L:
        raise ValueError(f"window must be a power of two <= live_rows <= L={L} (got {window}, {live_rows})")
    for name, t in (("slots", slots), ("hist", hist)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 (ucache_prepare's output)")
    if slots.shape[0]:
        _ucache_finish_kernel[(slots.shape[0],)](
            ring_d, ring_k, ring_g, cursor, slots, hist, *ring_d.stride(), *ring_k.stride(), *ring_g.stride(),
            H=H, HV=HV, K=K, V=V, W=window, LIVE=live_rows,
            # cursor.PENDING_SHIFT as an argument, not the PENDING_SHIFT_C global: under
            # TRITON_INTERPRET=1 the constexpr W is a plain int, and Python has no int << constexpr
            PENDING_SHIFT=PENDING_SHIFT, num_warps=4,
        )
