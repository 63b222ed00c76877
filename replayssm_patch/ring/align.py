"""The ring under prefix caching in align mode with MTP: the state moves between cache blocks.

In align mode vLLM keeps a request's running state in the block of its last token and moves it
when that block changes; the block a request completes must hold the exact state at its last
token, since that block is what the prefix cache hashes and hands to later requests. vLLM moves
states with byte copies (its "precopy" before a step, its "postprocess" after sampling) that
know nothing of the ring. With MTP and one state slot per request, the ring layers' SSM state
is taken out of those copies (vllm.align_copy_funcs keeps vLLM's conv copies only) and moved
here instead, with `ring_publish`:

* after the verify step, before vLLM's postprocess rewrites `num_accepted_tokens` (`publish`):
  commit each row's accepted entries; where the accepted tokens reached a block boundary B,
  write the state at B into the block that B completes (replaying the committed entries and
  the window's first B - old), or flush the ring in place when that block is the live one;
* before the next step, where the live block changed (`migrate`): the state the old block's
  ring stands for becomes the new block's checkpoint, with an empty ring.

Every destination's ring ends empty, so a block handed to another request through the cache
never carries a ring the new owner would misread. `Moves` holds what a step's moves need; it is
captured from vLLM's own context (`moves_for`) once per engine. On CPU vLLM's fused copy kernels
are Triton (they do not run there), so `cpu_copy` reproduces the copies vLLM's kernels make for
the states still in its lists (conv states; temporal states of layers off the ring).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from .call import cpu_state_view


@dataclass
class StateCopy:
    """One state tensor in vLLM's copy lists: conv (shifted by the accepted bias) or temporal."""

    tensor: torch.Tensor  # [blocks, ...]
    group: int  # its KV-cache group's row in `block_tables`
    conv: bool
    dim_first: bool = False  # conv layout (dim, state_len) per block, else (state_len, dim)


@dataclass
class Moves:
    """What a step's state moves need, for one engine."""

    block_size: int
    block_tables: list[torch.Tensor]  # per group: [rows, blocks] int32 (V1: batch rows; V2: request slots)
    layers: list  # ring layers (ReplayQwenGDN), each with its group in `ring_groups`
    ring_groups: list[int]
    copies: list[StateCopy] = field(default_factory=list)  # what vLLM's copy kernels move (CPU replays them)
    stats: Counter | None = None
    use_kernel: bool = False  # the Triton op (CUDA), else its torch reference (CPU)
    table: object = None  # ops.RingTable over the ring layers (the kernel's), for `table_rings`
    table_rings: tuple = ()  # the layers' RingBuffers the table was built from

    def ring_lists(self):
        """(states, ring d, k, g, cursors) of the ring layers, in the ring's [slot, HV, V, K] view."""
        rings = [layer.replay_ring for layer in self.layers]
        if any(r is None for r in rings):
            raise RuntimeError("GDN ring: a ring layer has no bound cache at an align-mode state move")
        # the checkpoint as the ring indexes it: vLLM's [slot, HV, V, K] on CUDA (the kernel's
        # platform), its CPU kernels' transposed view on CPU (ring.call)
        states = [layer.kv_cache[1] if self.use_kernel else cpu_state_view(layer) for layer in self.layers]
        return states, [r.d for r in rings], [r.k for r in rings], [r.g for r in rings], [r.cursor for r in rings]


def full_table(view: torch.Tensor) -> torch.Tensor:
    """The persistent block table behind `view` (vLLM hands its first rows only): every row its
    storage holds, so later steps' rows index it too."""
    rows = (view.untyped_storage().nbytes() // view.element_size() - view.storage_offset()) // view.stride(0)
    return view.as_strided((rows, view.shape[1]), view.stride(), view.storage_offset())


def _slots(moves: Moves, bt_rows: torch.Tensor, cols: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """int32 [groups, rows]: block ids at (bt_rows, cols) per group, 0 where not `live`."""
    out = []
    for bt in moves.block_tables:
        ids = bt[bt_rows.clamp(min=0), cols.clamp(min=0)]
        out.append(torch.where(live, ids, torch.zeros_like(ids)))
    return torch.stack(out).to(torch.int32).contiguous()


def boundary(acc: torch.Tensor, new: torch.Tensor, block_size: int):
    """Per row: whether the accepted tokens of this step reached a block boundary B (the last
    multiple of block_size at or below `new`, past the row's old count new - acc), the column
    of the block B completes, and the window entries up to B (B - old)."""
    old = new - acc
    aligned = torch.div(new, block_size, rounding_mode="floor") * block_size
    return aligned > old, torch.div(aligned, block_size, rounding_mode="floor") - 1, aligned - old


def publish(moves: Moves, bt_rows, live_col, acc, new) -> None:
    """After a verify step: commit each row's accepted entries and publish the state at a block
    boundary its accepted tokens reached (in place when that block is the live one). Rows with
    bt_rows < 0 are padding."""
    if moves.layers == [] or bt_rows.numel() == 0:
        return
    crosses, dst_col, take = boundary(acc.long(), new.long(), moves.block_size)
    valid = (bt_rows >= 0) & (live_col >= 0)
    src = _slots(moves, bt_rows, live_col, valid)
    dst = _slots(moves, bt_rows, dst_col, valid & crosses)
    _run(moves, src, dst, take.to(torch.int32).contiguous(), acc.to(torch.int32).contiguous())
    if moves.stats is not None:
        moves.stats["align_publish_calls"] += 1
        if not moves.use_kernel:  # what the boundaries did (a host sync on CUDA: counted on CPU only)
            at = (dst[0] > 0) & (src[0] > 0)
            moves.stats["align_boundaries_in_place"] += int((at & (dst[0] == src[0])).sum())
            moves.stats["align_boundaries_published"] += int((at & (dst[0] != src[0])).sum())


def migrate(moves: Moves, bt_rows, src_col, dst_col) -> None:
    """Before a step: where a row's live block changed, its old block's state (checkpoint and
    committed ring) becomes the new block's checkpoint, with an empty ring."""
    if moves.layers == [] or bt_rows.numel() == 0:
        return
    moving = (bt_rows >= 0) & (src_col >= 0) & (src_col != dst_col)
    src = _slots(moves, bt_rows, src_col, moving)
    dst = _slots(moves, bt_rows, dst_col, moving)
    _run(moves, src, dst, torch.zeros(bt_rows.shape[0], dtype=torch.int32, device=src.device), None)
    if moves.stats is not None:
        moves.stats["align_migrate_calls"] += 1
        if not moves.use_kernel:  # a host sync on CUDA: counted on CPU only
            moves.stats["align_migrations"] += int(moving.sum())


def _run(moves: Moves, src, dst, take, accepted) -> None:
    if moves.use_kernel:
        from ..ops import ring_publish, ring_table

        rings = tuple(layer.replay_ring for layer in moves.layers)
        # built once; again only if vLLM rebound the caches (identity: RingBuffers compare by content)
        if len(rings) != len(moves.table_rings) or any(a is not b for a, b in zip(rings, moves.table_rings)):
            moves.table = ring_table(*moves.ring_lists(), moves.ring_groups)
            moves.table_rings = rings
        ring_publish(moves.table, src, dst, take, accepted)
    else:
        from ..ops.publish_reference import ring_publish_reference

        ring_publish_reference(*moves.ring_lists(), moves.ring_groups, src, dst, take, accepted)


def cpu_copy(moves: Moves, bt_row: int, src_col: int, dst_col: int, bias: int) -> None:
    """vLLM's align copy of one request, as its fused kernels make it: conv states shifted by
    `bias` tokens from column src_col to dst_col, temporal states from column src_col + bias."""
    for c in moves.copies:
        bt = moves.block_tables[c.group][bt_row]
        dst = c.tensor[int(bt[dst_col])]
        if c.conv:
            src = c.tensor[int(bt[src_col])]
            width = src.shape[-1] if c.dim_first else src.shape[0]
            if c.dim_first:
                dst[:, :width - bias] = src[:, bias:].clone()  # a same-block shift overlaps
            else:
                dst[:width - bias] = src[bias:].clone()
        else:
            dst.copy_(c.tensor[int(bt[src_col + bias])])
