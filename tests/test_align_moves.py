"""The ring's align-mode moves under MTP (`ring.align`), without vLLM: the boundary decision
against vLLM's postprocess formulas written out by hand, the block ids each row's publish and
migration read per KV-cache group (padding rows, unchanged blocks), and the copies the CPU path
makes in vLLM's place (conv shifted by the accepted bias in both layouts, temporal states from
the accepted column) against explicit slices. The op's numbers are test_publish_interpret's."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from replayssm_patch.ops.cursor import pack_cursor
from replayssm_patch.ops.publish_reference import ring_publish_reference
from replayssm_patch.ring import align
from replayssm_patch.ring.call import cpu_state_view
from replayssm_patch.ring.runtime import RingBuffers

BS = 8  # block size of these tests


def test_boundary_follows_vllms_postprocess_formulas():
    gen = torch.Generator().manual_seed(0)
    old = torch.randint(0, 40, (200,), generator=gen)
    acc = torch.randint(0, 5, (200,), generator=gen)
    crosses, dst_col, take = align.boundary(acc, old + acc, BS)
    for o, a, c, d, t in zip(old.tolist(), acc.tolist(), crosses.tolist(), dst_col.tolist(), take.tolist()):
        running = o + 1  # vLLM: num_tokens_running_state; new = running + acc - 1
        new = running + a - 1
        aligned = new // BS * BS
        assert c == (aligned >= running), (o, a)
        if c:
            assert d == aligned // BS - 1 and t == aligned - running + 1 and 1 <= t <= a, (o, a, d, t)


def _layer(slots, HV=2, H=1, K=4, V=4, L=6, gen=None):
    kv = [torch.randn(slots, 3, 5, generator=gen), torch.randn(slots, HV, V, K, generator=gen)]
    ring = RingBuffers(torch.cumsum(-torch.rand(slots, HV, L, generator=gen), -1), torch.randn(slots, HV, L, V, generator=gen),
                       torch.randn(slots, H, L, K, generator=gen), torch.zeros(slots, dtype=torch.int32))
    return SimpleNamespace(kv_cache=kv, replay_ring=ring)


def _moves(gen):
    slots = 40
    # per group: every row's blocks distinct from every other row's (block 0 is vLLM's null block)
    tables = [(torch.randperm(slots - 1, generator=gen)[:30].view(6, 5) + 1).to(torch.int32) for _ in range(2)]
    layers = [_layer(slots, gen=gen) for _ in range(3)]
    return align.Moves(BS, tables, layers, [0, 1, 0])


def _expect(moves, src, dst, take, accepted):
    """ring_publish_reference on copies of the layers, with the given slots."""
    states = [cpu_state_view(layer).clone() for layer in moves.layers]
    rings = [layer.replay_ring for layer in moves.layers]
    args = ([r.d for r in rings], [r.k for r in rings], [r.g for r in rings], [r.cursor.clone() for r in rings])
    ring_publish_reference(states, *args, moves.ring_groups, src, dst, take, accepted)
    return states, args[3]


def test_publish_reads_each_groups_live_and_boundary_blocks():
    gen = torch.Generator().manual_seed(1)
    moves = _moves(gen)
    rows = torch.tensor([0, 1, 2, 3, -1, 5])
    # live column = (old + window - 1) // BS, as vLLM allocates it with the drafts counted
    live = torch.tensor([2, 2, 3, 1, 1, 2])
    acc = torch.tensor([3, 2, 1, 4, 2, 1])
    old = torch.tensor([3 * BS - 3, 2 * BS - 1, 3 * BS + 2, BS - 3, BS, 3 * BS - 1])
    for l, layer in enumerate(moves.layers):  # each live slot: 2 committed entries, a window of 4
        bt = moves.block_tables[moves.ring_groups[l]]
        for r, c in zip(rows.tolist(), live.tolist()):
            if r >= 0:
                layer.replay_ring.cursor[int(bt[r, c])] = int(pack_cursor(torch.tensor(2), torch.tensor(4)))
    crosses, dst_col, take = align.boundary(acc, old + acc, BS)
    src = torch.stack([torch.where(rows >= 0, bt[rows.clamp(min=0), live], 0) for bt in moves.block_tables]).int()
    dst = torch.stack([torch.where((rows >= 0) & crosses, bt[rows.clamp(min=0), dst_col.clamp(min=0)], 0)
                       for bt in moves.block_tables]).int()
    assert bool(crosses[0]) and int(dst_col[0]) == 2 and bool((dst[:, 0] == src[:, 0]).all())  # in place
    assert bool(crosses[1]) and int(dst_col[1]) == 1 and bool((dst[:, 1] != src[:, 1]).all())  # inside the span
    assert not bool(crosses[2])
    assert bool(crosses[3]) and int(dst_col[3]) == 0 and bool((dst[:, 3] != src[:, 3]).all())  # inside the span
    assert bool(crosses[5]) and int(dst_col[5]) == 2  # zero-draft row completing its live block
    want_states, want_cursors = _expect(moves, src, dst, take.int(), acc.int())
    align.publish(moves, rows, live, acc, old + acc)
    for layer, ws, wc in zip(moves.layers, want_states, want_cursors):
        assert torch.equal(layer.replay_ring.cursor, wc)
        assert torch.equal(cpu_state_view(layer), ws)


def test_migrate_moves_only_rows_whose_block_changed():
    gen = torch.Generator().manual_seed(2)
    moves = _moves(gen)
    for layer in moves.layers:
        layer.replay_ring.cursor.random_(0, 5, generator=gen)
    rows = torch.tensor([0, 1, 2, -1, 4])
    src_col = torch.tensor([1, 2, -1, 0, 3])
    dst_col = torch.tensor([2, 2, 0, 1, 4])
    moving = torch.tensor([True, False, False, False, True])
    src = torch.stack([torch.where(moving, bt[rows.clamp(min=0), src_col.clamp(min=0)], 0) for bt in moves.block_tables]).int()
    dst = torch.stack([torch.where(moving, bt[rows.clamp(min=0), dst_col], 0) for bt in moves.block_tables]).int()
    want_states, want_cursors = _expect(moves, src, dst, torch.zeros(5, dtype=torch.int32), None)
    align.migrate(moves, rows, src_col, dst_col)
    for layer, ws, wc in zip(moves.layers, want_states, want_cursors):
        assert torch.equal(layer.replay_ring.cursor, wc)
        assert torch.equal(cpu_state_view(layer), ws)


def test_cpu_copy_makes_vllms_copies():
    gen = torch.Generator().manual_seed(3)
    blocks, width, dim = 10, 5, 3
    sd = torch.randn(blocks, width, dim, generator=gen)  # (state_len, dim) per block
    ds = torch.randn(blocks, dim, width, generator=gen)  # (dim, state_len) per block
    temporal = torch.randn(blocks, 2, 4, 4, generator=gen)
    bt = torch.tensor([[3, 5, 7, 2, 9]], dtype=torch.int32)
    moves = align.Moves(BS, [bt], [], [], [align.StateCopy(sd, 0, True), align.StateCopy(ds, 0, True, True),
                                           align.StateCopy(temporal, 0, False)])
    before = [t.clone() for t in (sd, ds, temporal)]
    align.cpu_copy(moves, 0, 1, 3, 2)  # columns 1 -> 3, bias 2: blocks 5 -> 2
    assert torch.equal(sd[2, :width - 2], before[0][5, 2:]) and torch.equal(sd[2, width - 2:], before[0][2, width - 2:])
    assert torch.equal(ds[2, :, :width - 2], before[1][5, :, 2:])
    assert torch.equal(temporal[2], before[2][bt[0, 1 + 2]])  # the accepted column's block (7)
    for t, b in zip((sd, ds, temporal), before):
        keep = [i for i in range(blocks) if i != 2]
        assert torch.equal(t[keep], b[keep])
    sd2 = sd.clone()
    align.cpu_copy(align.Moves(BS, [bt], [], [], [align.StateCopy(sd, 0, True)]), 0, 1, 1, 3)  # in-block shift
    assert torch.equal(sd[5, :width - 3], sd2[5, 3:])
