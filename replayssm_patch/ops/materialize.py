"""Ring maintenance: `ring_materialize` (flush rings into their checkpoints) and `ring_reset`
(empty them); imports torch and triton only. Semantics: `ring_materialize_reference` and
`ring_reset_reference` in materialize_reference.

Materialise takes the cursor word with arrival tickets (cursor.py), as the fused decode kernel
does: every program of a slot reads n with one atomic add, the last one clears it.

Neither kernel specialises on the slot count or the slot list's alignment: vLLM hands them
slices of its state indices, and each new variant would compile in the middle of a step
(the ring ops' `compile_ahead` in replayssm_patch/ring/runtime.py compiles the one variant of
each before the engine serves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cursor import DECODE_MASK, DECODE_MASK_C, MAX_TICKETS, TICKET_C, TICKET_SHIFT_C
from .launch import cdiv, next_pow2
from .ring_checks import ring_geometry


@triton.jit(do_not_specialize=["stride_slots"], do_not_specialize_on_alignment=["slots", "start_empty"])
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

    ticket = tl.atomic_add(cursor + slot, TICKET_C, sem="relaxed")
    n = tl.minimum(ticket & DECODE_MASK_C, L)
    arrivals = ticket >> TICKET_SHIFT_C
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


@triton.jit(do_not_specialize=["n_slots", "stride_slots"], do_not_specialize_on_alignment=["slots"])
def _ring_reset_kernel(cursor, slots, n_slots, stride_slots, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(slots + offs.to(tl.int64) * stride_slots, mask=offs < n_slots, other=0).to(tl.int64)
    tl.store(cursor + s, tl.zeros([BLOCK], dtype=tl.int32), mask=(offs < n_slots) & (s > 0))


def ring_materialize(
    state: torch.Tensor,
    ring_d: torch.Tensor,
    ring_k: torch.Tensor,
    ring_g: torch.Tensor,
    cursor: torch.Tensor,
    slots: torch.Tensor,
    start_empty: torch.Tensor | None = None,
) -> None:
    """Flush the rings of `slots` into their checkpoints (semantics of
    `ring_materialize_reference`). Graph safe, no host sync.

    Args:
        state (torch.Tensor):
            the checkpoints, `[slots, HV, V, K]` (fp32, bf16 or fp16); updated in place.
        ring_d (torch.Tensor), ring_k (torch.Tensor), ring_g (torch.Tensor):
            the rings, `[slots, HV, L, V]`, `[slots, H, L, K]`, `[slots, HV, L]` (float32).
        cursor (torch.Tensor):
            the entry counts, contiguous int32 `[slots]` (no window pending: cursor.py);
            set to 0 for every flushed slot.
        slots (torch.Tensor):
            1-D slot list, on the state's device; entries <= 0 are ignored, the others must be
            distinct.
        start_empty (torch.Tensor | None):
            per entry of `slots`, contiguous: a set flag drops that slot's ring instead of
            replaying it (its state came without the ring).

    Returns:
        None. Each slot's checkpoint is its replayed state; one whose ring is empty or dropped
        keeps its checkpoint bit-identical.
    """
    H, HV, K, V, L, (ss, sd, sk, sg) = ring_geometry(state, ring_d, ring_k, ring_g, cursor, DECODE_MASK)
    if slots.ndim != 1 or slots.device != state.device:
        raise ValueError("slots must be a 1-D tensor on the state's device")
    if start_empty is not None and (start_empty.shape[0] < slots.shape[0] or start_empty.stride(0) != 1
                                    or start_empty.device != state.device):
        raise ValueError("start_empty must be a contiguous 1-D tensor with an entry per slot, on the state's device")
    if slots.numel() == 0:
        return
    BK = next_pow2(K)
    BV = min(32, max(16, next_pow2(V)))
    NV = cdiv(V, BV)
    LP = max(16, next_pow2(L))
    if HV * NV >= MAX_TICKETS:
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
    """Empty the rings of `slots` (semantics of `ring_reset_reference`), e.g. after a prefill
    wrote fresh states. Graph safe, no host sync.

    Args:
        cursor (torch.Tensor):
            the entry counts, contiguous int32 `[slots]`; set to 0 for each given slot.
        slots (torch.Tensor):
            1-D slot list, on the cursor's device; entries <= 0 are ignored.

    Returns:
        None. The checkpoints are untouched.
    """
    if cursor.ndim != 1 or cursor.dtype != torch.int32 or cursor.stride(0) != 1:
        raise ValueError("cursor must be a contiguous 1-D int32 tensor")
    if slots.ndim != 1 or slots.device != cursor.device:
        raise ValueError("slots must be a 1-D tensor on the cursor's device")
    n = slots.shape[0]
    if n == 0:
        return
    BLOCK = 128
    _ring_reset_kernel[(cdiv(n, BLOCK),)](cursor, slots, n, slots.stride(0), BLOCK=BLOCK, num_warps=4)
