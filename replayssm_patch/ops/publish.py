"""`ring_publish`: write the state a slot's ring stands for (or a prefix of it) into ANOTHER
slot's checkpoint, for many layers in one launch; optionally commit the source's pending window
first (imports torch and triton only). Semantics: `publish_reference.ring_publish_reference`.

What it is for: with prefix caching in align mode a request's state has to move between cache
blocks (its running block changes; a block it completed must hold the state at its boundary).
vLLM's copies move whole pages, which know nothing of the ring; this op moves the state the
ring stands for and leaves the destination's ring empty.

The layers are given as a `RingTable` (`ring_table`): one row of base addresses per layer
(checkpoint, ring d / k / g, cursor), their shared geometry and slot strides, and each layer's
KV-cache group; the rows' source and destination slots are per group (vLLM keeps a block table
per group). Built once per engine: the launch reads the addresses on the device.

Cursor words: without a commit the sources' words are only read (a source may appear in several
rows); with a commit each source's word is rewritten, so the sources must be distinct, and every
program of a publishing row takes an arrival ticket (cursor.py) before the last one writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .cursor import COUNT_MASK, COUNT_MASK_C, MAX_TICKETS, PENDING_MASK_C, PENDING_SHIFT_C, TICKET_C, TICKET_SHIFT_C
from .launch import cdiv, next_pow2
from .ring_checks import ring_geometry

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class RingTable:
    """Every layer's checkpoint and ring, for one launch over rows x layers."""

    addresses: torch.Tensor  # int64 [layers, 5]: state, ring_d, ring_k, ring_g, cursor base addresses
    groups: torch.Tensor  # int32 [layers]: the layer's row in the src / dst slot arrays
    group_count: int  # rows the src / dst arrays need (the largest group + 1), kept on the host
    strides: tuple[int, int, int, int]  # slot strides (elements) of state, ring_d, ring_k, ring_g
    shape: tuple[int, int, int, int, int]  # H, HV, K, V, L
    state_dtype: torch.dtype
    ring_dtype: torch.dtype
    slots: int  # slots per layer (every index must be below it)
    tensors: tuple  # the layers' tensors, kept alive while the table is


def ring_table(states, rings_d, rings_k, rings_g, cursors, groups) -> RingTable:
    """The table of `len(states)` layers (lists, one entry per layer, all of the same geometry,
    dtypes, slot count and strides, on one device); `groups[l]`: layer l's row in the slot arrays
    `ring_publish` takes. Raises ValueError naming what does not match."""
    layers = list(zip(states, rings_d, rings_k, rings_g, cursors))
    if not layers or len(groups) != len(layers):
        raise ValueError(f"ring_table needs one group per layer and at least one layer "
                         f"(got {len(layers)} layers, {len(groups)} groups)")
    first = ring_geometry(*layers[0], COUNT_MASK)
    dev = states[0].device
    for i, tensors in enumerate(layers):
        if ring_geometry(*tensors, COUNT_MASK) != first or tensors[0].dtype != states[0].dtype \
                or tensors[1].dtype != rings_d[0].dtype or tensors[2].dtype != rings_d[0].dtype:
            raise ValueError(f"layer {i} of the ring table differs from layer 0 in geometry, strides or dtypes")
        if tensors[0].shape[0] != states[0].shape[0] or any(t.device != dev for t in tensors):
            raise ValueError(f"layer {i} of the ring table has another slot count or device")
    if states[0].dtype not in _TL_DTYPES or rings_d[0].dtype not in _TL_DTYPES:
        raise ValueError(f"state and ring dtypes must be float32, bfloat16 or float16 "
                         f"(got {states[0].dtype}, {rings_d[0].dtype})")
    H, HV, K, V, L, strides = first
    addresses = torch.tensor([[t.data_ptr() for t in tensors] for tensors in layers], dtype=torch.int64)
    return RingTable(addresses.to(dev), torch.tensor(list(groups), dtype=torch.int32, device=dev),
                     max(int(g) for g in groups) + 1, strides,
                     (H, HV, K, V, L), states[0].dtype, rings_d[0].dtype, states[0].shape[0], tuple(layers))


# one variant whatever the row count and the arrays' alignment (they are slices of persistent buffers)
@triton.jit(do_not_specialize=["rows", "stride_group"], do_not_specialize_on_alignment=["src", "dst", "take", "accepted"])
def _ring_publish_kernel(
    addresses, groups, src, dst, take, accepted, rows, stride_group,
    slot_stride_state, slot_stride_d, slot_stride_k, slot_stride_g,
    STATE_DT: tl.constexpr, RING_DT: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, COMMIT: tl.constexpr,
):
    i_n = tl.program_id(0)  # row
    i_l = tl.program_id(1)  # layer
    tile = tl.program_id(2)  # (value head, value block)
    i_v = tile % NV
    i_hv = tile // NV
    GROUP: tl.constexpr = HV // H
    P: tl.constexpr = HV * NV
    i_h = i_hv // GROUP

    g = tl.load(groups + i_l).to(tl.int64)
    s = tl.load(src + g * stride_group + i_n).to(tl.int64)
    d = tl.load(dst + g * stride_group + i_n).to(tl.int64)
    if s <= 0 or (not COMMIT and d == s):  # an in-place flush is a commit's
        return
    row = addresses + i_l.to(tl.int64) * 5
    cursor = tl.load(row + 4).to(tl.pointer_type(tl.int32))
    if d <= 0:  # nothing to publish: the commit alone, by one program
        if COMMIT and tile == 0:
            word = tl.load(cursor + s)
            n0 = word & COUNT_MASK_C
            pend = (word >> PENDING_SHIFT_C) & PENDING_MASK_C
            acc = tl.maximum(tl.load(accepted + i_n).to(tl.int32), 0)
            tl.store(cursor + s, tl.minimum(n0 + tl.minimum(acc, pend), L))
        return

    if COMMIT:  # the word is rewritten below: read it with a ticket
        word = tl.atomic_add(cursor + s, TICKET_C, sem="relaxed")
    else:
        word = tl.load(cursor + s)
    n0 = word & COUNT_MASK_C
    pend = (word >> PENDING_SHIFT_C) & PENDING_MASK_C
    n1 = n0
    if COMMIT:
        n1 = tl.minimum(n0 + tl.minimum(tl.maximum(tl.load(accepted + i_n).to(tl.int32), 0), pend), L)
    # in place: the committed ring is flushed; elsewhere: the committed entries and `take` of the window
    m = tl.where(d == s, n1, tl.minimum(n0 + tl.minimum(tl.maximum(tl.load(take + i_n).to(tl.int32), 0), pend), L))

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    state = tl.load(row).to(tl.pointer_type(STATE_DT))
    tile_off = i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    S = tl.load(state + s * slot_stride_state + tile_off, mask=m_vk, other=0.0).to(tl.float32)
    if m > 0:
        p_g = tl.load(row + 3).to(tl.pointer_type(tl.float32)) + s * slot_stride_g + i_hv * L
        p_d = tl.load(row + 1).to(tl.pointer_type(RING_DT)) + s * slot_stride_d + i_hv * (L * V)
        p_k = tl.load(row + 2).to(tl.pointer_type(RING_DT)) + s * slot_stride_k + i_h * (L * K)
        G_m = tl.load(p_g + m - 1)
        S = S * tl.exp(G_m)
        for j in range(0, m):  # rank-1 fp32 updates, as the materialise kernel's flush
            d_j = tl.load(p_d + j * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            k_j = tl.load(p_k + j * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            S += (tl.exp(G_m - tl.load(p_g + j)) * d_j)[:, None] * k_j[None, :]
    tl.store(state + d * slot_stride_state + tile_off, S.to(STATE_DT), mask=m_vk)

    if COMMIT:
        if (word >> TICKET_SHIFT_C) == P - 1:  # the last program of this (row, layer)
            tl.atomic_xchg(cursor + s, tl.where(d == s, 0, n1), sem="relaxed")
            if d != s:
                tl.store(cursor + d, 0)
    elif tile == 0:
        tl.store(cursor + d, 0)


def ring_publish(
    table: RingTable,
    src: torch.Tensor,
    dst: torch.Tensor,
    take: torch.Tensor,
    accepted: torch.Tensor | None = None,
    rows: int | None = None,
) -> None:
    """For every row i and every layer l of `table` (group g = its group), with s = src[g, i],
    d = dst[g, i] and (n, pending) = the cursor word of s: where s > 0 and d > 0, write the
    state of s's checkpoint and its first m ring entries into d's checkpoint and empty d's ring,
    m = n + min(take[i], pending); with `accepted`, first commit s's window (n += min(accepted[i],
    pending), the window cleared), and where d == s flush s's committed ring into its own
    checkpoint instead. Semantics of `ring_publish_reference`. Graph safe, no host sync.

    Args:
        table (RingTable):
            the layers (`ring_table`).
        src (torch.Tensor), dst (torch.Tensor):
            int32 `[groups, >= rows]`, last dim contiguous, on the table's device: the rows'
            source and destination slots per group; <= 0: nothing for that row and group (src)
            or commit only (dst). Destinations must not be any row's source (except itself).
        take (torch.Tensor):
            int32 `[>= rows]`: entries of the source's pending window that the published state
            includes (0: the committed entries only).
        accepted (torch.Tensor | None):
            int32 `[>= rows]`, vLLM's num_accepted_tokens: commit the sources' windows by it
            (sources then distinct); None: the sources' cursors are only read.
        rows (int | None):
            rows to process (default: src.shape[1]).

    Returns:
        None. Each publishing row's destination checkpoint holds the replayed state (an exact
        copy where m == 0); the sources' checkpoints and rings are unchanged except by the
        in-place flush.
    """
    rows = src.shape[1] if rows is None else rows
    dev = table.addresses.device
    for name, t in (("src", src), ("dst", dst)):
        if t.ndim != 2 or t.dtype != torch.int32 or t.stride(1) != 1 or t.device != dev or t.shape[1] < rows \
                or t.shape[0] < table.group_count:
            raise ValueError(f"{name} must be int32 [groups, >= {rows}] with a contiguous last dim on {dev} "
                             f"(got {t.dtype} {tuple(t.shape)} on {t.device})")
    if src.stride(0) != dst.stride(0):
        raise ValueError("src and dst must have the same group stride")
    for name, t in (("take", take), ("accepted", accepted)):
        if t is not None and (t.ndim != 1 or t.dtype != torch.int32 or t.stride(0) != 1 or t.shape[0] < rows
                              or t.device != dev):
            raise ValueError(f"{name} must be contiguous int32 [>= {rows}] on {dev}")
    if rows == 0:
        return
    H, HV, K, V, L = table.shape
    BK = next_pow2(K)
    BV = min(32, max(16, next_pow2(V)))
    NV = cdiv(V, BV)
    if HV * NV >= MAX_TICKETS:
        raise ValueError(f"too many programs per slot ({HV * NV}) for the cursor ticket")
    ss, sd, sk, sg = table.strides
    grid = (rows, table.addresses.shape[0], HV * NV)
    _ring_publish_kernel[grid](
        table.addresses, table.groups, src, dst, take, take if accepted is None else accepted, rows, src.stride(0),
        ss, sd, sk, sg, STATE_DT=_TL_DTYPES[table.state_dtype], RING_DT=_TL_DTYPES[table.ring_dtype],
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, NV=NV, COMMIT=accepted is not None,
        num_warps=max(1, BV * BK // 4096), num_stages=1,
    )
