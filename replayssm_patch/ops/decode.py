"""ReplaySSM decode for Gated DeltaNet, one token per row: the entry point (torch and triton only).

Semantics: exactly those of `decode_reference.ring_decode_reference` (the ring layout:
ring_state_reference; the cursor word: cursor). Per row, per value head, per block of BV value
channels:

    one read of the checkpoint tile S_c[BV, K] gives  S_c q  and  S_c k  (two mat-vecs),
    the ring adds the low-rank part:  S x = exp(G_n) (S_c x) + sum_{j<n} w_j d_j (k_j . x),
    w_j = exp(G_n - G_j), for x in {q, k}: O(n (K + BV)) work, no state tile is rebuilt.
    d = beta (v - alpha S k),   o = alpha S q + d (k . q)      (alpha = exp(g))
    not full:  append (d, k, G_n + g) at entry n, cursor = n + 1
    flush:     S_new = alpha (exp(G_n) S_c + sum_j w_j d_j k_j^T) + d k^T on the tile already
               held (rank-1 fp32 updates, or one tensor-core product with a 16-bit ring),
               written in the state dtype; cursor = 0.

Cursor range: 0 <= n <= L. n == L is a full ring (a speculative verify window committed up to
the end): it is replayed and the step flushes. A larger value (corrupt state) is clamped to L
instead of reading out of bounds. A row flagged `start_empty` replays nothing (its state came
without its ring); one flagged `force_flush` flushes whatever its fill.

The four launch forms live in decode_fused, decode_two_phase, decode_replay and decode_tma
(Hopper, Gluon on Triton 3.6; imported only where it runs); `launch` picks one per call (its
table, or an `override_launch` block). Each form keeps the cursor race-free without a host
sync: the fused kernel by an arrival ticket on the cursor itself, the two-phase forms (tma
included) by reading it in one kernel and writing it in the next.
"""

from __future__ import annotations

import dataclasses

import torch

from .cursor import DECODE_MASK
from .decode_fused import launch_fused
from .decode_replay import launch_replay
from .decode_shared import RowFlags, block_v
from .decode_two_phase import launch_two_phase
from .launch import (GLUON_TRITON_RELEASES, DecodeLaunch, decode_launch, flush_tc_supported, next_pow2,
                     tma_capable, tma_fits)
from .ring_checks import check_device, check_packed_inputs, ring_geometry


def _launch_tma(launch, args, geo) -> None:
    if launch.matvec_tc:
        from .decode_tma_tc import launch_tma_tc  # Gluon: imported only where a tma launch runs

        launch_tma_tc(launch, args, geo)
    else:
        from .decode_tma import launch_tma

        launch_tma(launch, args, geo)


_FORMS = {"fused": launch_fused, "two_phase": launch_two_phase, "replay": launch_replay, "tma": _launch_tma}


# Plain slotted records (built per call: a frozen dataclass costs several times more host time)
@dataclasses.dataclass(slots=True)
class Geometry:
    N: int
    H: int
    HV: int
    K: int
    V: int
    L: int
    BK: int  # K rounded up to a power of two
    LP: int  # L rounded up to a power of two, >= 16
    strides: tuple  # slot strides of state, ring_d, ring_k, ring_g


@dataclasses.dataclass(slots=True)
class Args:
    qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    scale: float
    state: torch.Tensor
    out: torch.Tensor
    idx: torch.Tensor
    ring_d: torch.Tensor
    ring_k: torch.Tensor
    ring_g: torch.Tensor
    cursor: torch.Tensor
    ff: RowFlags
    se: RowFlags
    l2norm: bool


def _check_flush_tc(launch: DecodeLaunch, V: int, ring_d: torch.Tensor, L: int) -> None:
    """An overridden launch may ask for the tensor-core flush where it cannot run: refuse it."""
    if not launch.flush_tc:
        return
    BV = block_v(launch.block_v, V)
    if BV < 16 or not flush_tc_supported(ring_d.dtype, L, ring_d.device):
        raise ValueError(
            f"launch {launch.name}: the tensor-core flush needs blocks of >= 16 value rows (got {BV}), "
            f"L > 8 (got {L}) and a float16 ring, or a bfloat16 one on CUDA (got {ring_d.dtype} on "
            f"{ring_d.device})")


def _check_tma(launch: DecodeLaunch, state: torch.Tensor, K: int, V: int, slot_stride: int) -> None:
    """An overridden launch may name the TMA form where it cannot run: refuse it (before
    Gluon is imported, which other Triton builds may lack)."""
    if not tma_capable(state.device):
        raise ValueError(f"launch {launch.name}: the TMA form needs a Hopper GPU (CUDA capability 9.x) "
                         f"and Triton {' or '.join(r + 'x' for r in GLUON_TRITON_RELEASES)} (its Gluon API; "
                         f"state on {state.device})")
    if not tma_fits(state, K, V, launch.block_v, slot_stride):
        raise ValueError(
            f"launch {launch.name}: the TMA form needs K a power of two in [16, 256] (got {K}), V a "
            f"multiple of block_v={launch.block_v} <= 256 (got {V}) and a 16-byte aligned state base and "
            f"slot stride (got slot stride {slot_stride} x {state.element_size()} bytes)")
    if launch.matvec_tc and (state.dtype not in (torch.float16, torch.bfloat16) or K < 32):
        raise ValueError(f"launch {launch.name}: the tensor-core mat-vecs (_mv) need a float16 or bfloat16 "
                         f"state and K >= 32 (got {state.dtype}, K={K})")


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
) -> torch.Tensor:
    """One decode token per row through the replay ring (semantics of `ring_decode_reference`).
    No host sync, safe to capture in a CUDA graph (the two-phase forms allocate a small scratch
    per call, which under capture comes from the graph's memory pool). The launch comes from
    `launch.pick_decode_launch` unless an `override_launch` block names one.

    Args:
        mixed_qkv (torch.Tensor):
            packed q | k | v of shape `[N, 2*H*K + HV*V]`, contiguous in its last dim.
        a (torch.Tensor), b (torch.Tensor):
            the gate inputs of shape `[N, HV]`.
        A_log (torch.Tensor), dt_bias (torch.Tensor):
            the layer's gate parameters, `HV` elements each, contiguous.
        scale (float):
            the query scale (applied after the L2 normalisation).
        state (torch.Tensor):
            the checkpoints, `[slots, HV, V, K]` (fp32, bf16 or fp16); written where a row
            flushes.
        out (torch.Tensor):
            the outputs, contiguous with `N * HV * V` elements ([N, HV, V] or [N, 1, HV, V]).
        state_indices (torch.Tensor):
            the slot of each row, `[N]`; rows with slot <= 0 get a zero output and touch nothing.
        ring_d (torch.Tensor), ring_k (torch.Tensor), ring_g (torch.Tensor):
            the rings, `[slots, HV, L, V]`, `[slots, H, L, K]`, `[slots, HV, L]` (float32).
        cursor (torch.Tensor):
            the entry counts (no window pending: cursor.py), contiguous int32 `[slots]`.
        force_flush (torch.Tensor | None):
            per row: flush whatever the ring's fill.
        start_empty (torch.Tensor | None):
            per row: replay nothing (the row's state came without its ring).
        use_qk_l2norm (bool):
            L2-normalise q and k (as vLLM's GDN layers do).

    Returns:
        `out` viewed as `[N, HV, V]`. State, rings and cursor are updated in place.
    """
    H, HV, K, V, L, strides = ring_geometry(state, ring_d, ring_k, ring_g, cursor, DECODE_MASK)
    N = check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, H, HV, K, V)
    if state_indices.ndim != 1 or state_indices.shape[0] != N:
        raise ValueError(f"state_indices must be 1-D of length {N}")
    if not out.is_contiguous() or out.numel() != N * HV * V:
        raise ValueError(f"out must be contiguous with N*HV*V = {N * HV * V} elements")
    dev = state.device
    check_device(dev, mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out,
                 state_indices=state_indices)
    ff = RowFlags(force_flush, N, "force_flush", dev, state_indices)
    se = RowFlags(start_empty, N, "start_empty", dev, state_indices)
    out3 = out.view(N, HV, V)
    if N == 0:
        return out3
    launch = decode_launch(N, HV, state.dtype, ring_d.dtype, L, dev)
    if launch.form == "tma":
        if not tma_fits(state, K, V, launch.block_v, strides[0]) or (launch.matvec_tc and K < 32):
            launch = decode_launch(N, HV, state.dtype, ring_d.dtype, L, dev, tma=False)  # an override stays
        if launch.form == "tma":
            _check_tma(launch, state, K, V, strides[0])
    _check_flush_tc(launch, V, ring_d, L)
    geo = Geometry(N, H, HV, K, V, L, next_pow2(K), max(16, next_pow2(L)), strides)
    args = Args(mixed_qkv, a, b, A_log, dt_bias, float(scale), state, out, state_indices,
                ring_d, ring_k, ring_g, cursor, ff, se, bool(use_qk_l2norm))
    _FORMS[launch.form](launch, args, geo)
    return out3
