"""`ring_publish` (ops/publish.py) under TRITON_INTERPRET=1 on the CPU, against its float64 torch
reference (`ring_publish_reference`) and, for the published prefix, an explicit replay loop.

The two uses prefix caching with MTP makes of it:

* the commit + publish after a verify step (`accepted` given): a boundary inside the accepted
  span (the prefix state into another block), full acceptance ending on the boundary (flush in
  place), zero-draft rows, rows without a window, rows that only commit, padding rows;
* the migration to a new live block (no `accepted`): a committed ring, an empty ring (an exact
  copy), one source published to two destinations, a row whose block does not change;
* both as the CUDA path of ring.align launches them (one launch over layers whose checkpoints
  and rings are views into paged cache blocks), with the block ids written out by hand.

Destination checkpoints are NaN and destination cursors garbage before the kernel runs; ring
entries past each source's live span are NaN. Two KV-cache groups with different slot numbers.
Runs in one subprocess (see test_ring_kernel_interpret.py for why).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the subprocess: interpret mode before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm_patch.testing.interpreted import interpreted_test

SLOTS, H, HV, K, V, L = 14, 2, 4, 32, 64, 8  # V spans two value blocks: two programs share a ticket
GROUPS = (0, 1, 0)  # three layers in two KV-cache groups


def _layers(torch, sdt, rdt, gen, group_cursors):
    """Per layer: random checkpoints and rings, NaN past each slot's n + pending, the cursor words
    of its group (`group_cursors[g]`)."""
    from replayssm_patch.ops.cursor import unpack_cursor

    out = []
    for g in GROUPS:
        cursors = group_cursors[g]
        state = (torch.randn(SLOTS, HV, V, K, generator=gen) * 0.5).to(sdt)
        rd = (torch.randn(SLOTS, HV, L, V, generator=gen) * 0.3).to(rdt)
        rk = torch.nn.functional.normalize(torch.randn(SLOTS, H, L, K, generator=gen), dim=-1).to(rdt)
        rg = torch.cumsum(-torch.rand(SLOTS, HV, L, generator=gen) * 0.2, dim=-1)
        n, p = unpack_cursor(cursors)
        for s in range(SLOTS):
            live = int(n[s] + p[s])
            rd[s, :, live:] = float("nan")
            rk[s, :, live:] = float("nan")
            rg[s, :, live:] = float("nan")
        out.append([state, rd, rk, rg, cursors.clone()])
    return out


def _explicit(state, rd, rk, rg, s, m):
    """S_c replayed over its first m entries, one rank-1 term at a time (float64)."""
    S = state[s].double()
    if m == 0:
        return S
    group = HV // H
    G = rg[s].double()
    G_m = G[:, m - 1]
    S = torch_exp(G_m)[:, None, None] * S
    for j in range(m):
        w = torch_exp(G_m - G[:, j])
        d = rd[s, :, j].double()
        k = rk[s, :, j].double().repeat_interleave(group, dim=0)
        S = S + w[:, None, None] * d[:, :, None] * k[:, None, :]
    return S


def torch_exp(x):
    return x.exp()


def _check(torch, layers, before, ref, src, dst, published, tol):
    """Kernel result vs the float64 reference: destinations within tol, everything else untouched."""
    worst = 0.0
    for l, g in enumerate(GROUPS):
        state, rd, rk, rg, cur = layers[l]
        r_state, _, _, _, r_cur = ref[l]
        b_state, b_rd, b_rk, b_rg, _ = before[l]
        assert torch.equal(cur, r_cur), (l, cur.tolist(), r_cur.tolist())
        for t, b in ((rd, b_rd), (rk, b_rk), (rg, b_rg)):  # rings are never written
            assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)), l
        written = sorted({int(dst[g, i]) for i in published})
        for s in range(SLOTS):
            if s in written:
                got, want = state[s].double(), r_state[s]
                assert torch.isfinite(got).all(), (l, s)
                err = float((got - want).norm() / want.norm())
                worst = max(worst, err)
                assert err < tol, (l, s, err)
            else:
                assert torch.equal(state[s].view(torch.uint8), b_state[s].view(torch.uint8)), (l, s)
    return worst


def _run(torch, layers, src, dst, take, accepted):
    from replayssm_patch.ops import ring_publish, ring_publish_reference, ring_table

    before = [[t.clone() for t in layer] for layer in layers]
    ref = [[layer[0].double(), layer[1].double(), layer[2].double(), layer[3].double(), layer[4].clone()]
           for layer in layers]
    ring_publish_reference(*(list(x) for x in zip(*ref)), GROUPS, src, dst, take, accepted)
    table = ring_table(*(list(x) for x in zip(*layers)), GROUPS)
    ring_publish(table, src, dst, take, accepted)
    return before, ref


def _poison_destinations(torch, layers, dst, rows):
    from replayssm_patch.ops.cursor import pack_cursor

    for l, g in enumerate(GROUPS):
        for i in rows:
            d = int(dst[g, i])
            layers[l][0][d] = float("nan")
            layers[l][4][d] = pack_cursor(torch.tensor(5), torch.tensor(3))


def _commit_publish(sdt, rdt, tol):
    import torch

    from replayssm_patch.ops.cursor import pack_cursor

    gen = torch.Generator().manual_seed(1)
    # row: (n0, pending, accepted, take, kind); kind: "boundary" (dst elsewhere), "in place",
    # "commit" (no boundary crossed), "pad" (no slot)
    rows = [(2, 4, 3, 2, "boundary"),        # boundary inside the accepted span
            (1, 4, 4, 4, "in place"),        # full acceptance ending on the boundary
            (3, 1, 1, 0, "commit"),          # zero-draft row, no boundary
            (0, 1, 1, 1, "boundary"),        # zero-draft row whose token completes a block
            (0, 0, 0, 0, "pad"),
            (4, 0, 2, 0, "commit"),          # no window pending: nothing to commit
            (0, 4, 1, 1, "boundary"),        # only the first window token accepted, on the boundary
            (3, 4, 4, 3, "boundary"),        # full acceptance past a boundary inside the window
            (7, 1, 1, 1, "in place")]        # a ring filled to its length by the commit
    src_slots = ([1, 2, 3, 4, 0, 5, 6, 12, 13], [6, 5, 4, 3, 0, 2, 1, 13, 12])
    out_slots = ([7, 2, 0, 8, 9, 0, 10, 11, 13], [10, 5, 0, 9, 11, 0, 7, 8, 12])
    cursors = torch.zeros(2, SLOTS, dtype=torch.int32)
    for g in range(2):  # both groups' sources get the row's (n0, pending)
        for (n0, p, *_), s in zip(rows, src_slots[g]):
            if s > 0:
                cursors[g, s] = int(pack_cursor(torch.tensor(n0), torch.tensor(p)))
    src = torch.tensor(src_slots, dtype=torch.int32)
    dst = torch.tensor([[d if kind != "commit" else 0 for d, (*_, kind) in zip(out_slots[g], rows)]
                        for g in range(2)], dtype=torch.int32)
    take = torch.tensor([r[3] for r in rows], dtype=torch.int32)
    accepted = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    layers = _layers(torch, sdt, rdt, gen, cursors)
    published = [i for i, r in enumerate(rows) if r[4] in ("boundary", "in place")]
    _poison_destinations(torch, layers, dst, [i for i, r in enumerate(rows) if r[4] in ("boundary", "pad")])
    before, ref = _run(torch, layers, src, dst, take, accepted)
    worst = _check(torch, layers, before, ref, src, dst, published, tol)

    # The reference's semantics, spelled out: entries up to the boundary, committed counts.
    for l, g in enumerate(GROUPS):
        b_state, b_rd, b_rk, b_rg, _ = before[l]
        cur = layers[l][4]
        for i, (n0, p, acc, tk, kind) in enumerate(rows):
            s, d = int(src[g, i]), int(dst[g, i])
            if kind == "pad":
                assert int(cur[d]) == int(before[l][4][d]), "a padding row touched its destination"
                continue
            n1 = min(n0 + min(acc, p), L)
            m = n1 if kind == "in place" else n0 + tk
            if kind != "commit":
                want = _explicit(b_state, b_rd, b_rk, b_rg, s, m)
                err = float((layers[l][0][d].double() - want).norm() / want.norm())
                assert err < tol, (l, i, err)
            assert int(cur[s]) == (0 if kind == "in place" else n1), (l, i, int(cur[s]))
            if kind == "boundary":
                assert int(cur[d]) == 0, (l, i)
    return {"max_rel": worst}


def _migrate(sdt, rdt, tol):
    import torch

    gen = torch.Generator().manual_seed(2)
    # row: source's committed entries; the live block moves from src to dst
    n_rows = [3, 0, 5, 2, 2, 4]
    src_slots = ([1, 2, 3, 4, 4, 5], [5, 4, 3, 2, 2, 1])
    out_slots = ([6, 7, 0, 8, 9, 5], [10, 11, 0, 12, 13, 1])  # row 2: no destination; row 5: same block
    cursors = torch.zeros(2, SLOTS, dtype=torch.int32)
    for g in range(2):
        for n, s in zip(n_rows, src_slots[g]):
            cursors[g, s] = n
    src = torch.tensor(src_slots, dtype=torch.int32)
    dst = torch.tensor(out_slots, dtype=torch.int32)
    take = torch.zeros(len(n_rows), dtype=torch.int32)
    layers = _layers(torch, sdt, rdt, gen, cursors)
    moved = [0, 1, 3, 4]
    _poison_destinations(torch, layers, dst, moved)
    before, ref = _run(torch, layers, src, dst, take, None)
    worst = _check(torch, layers, before, ref, src, dst, moved, tol)
    for l, g in enumerate(GROUPS):
        b_state, b_rd, b_rk, b_rg, b_cur = before[l]
        cur = layers[l][4]
        for i in moved:
            s, d = int(src[g, i]), int(dst[g, i])
            want = _explicit(b_state, b_rd, b_rk, b_rg, s, n_rows[i])
            err = float((layers[l][0][d].double() - want).norm() / want.norm())
            assert err < tol, (l, i, err)
            assert int(cur[d]) == 0 and int(cur[s]) == int(b_cur[s]), (l, i)
        s, d = int(src[g, 1]), int(dst[g, 1])  # an empty ring: the checkpoint copied bit for bit
        assert torch.equal(layers[l][0][d].view(torch.uint8), b_state[s].view(torch.uint8))
    return {"max_rel": worst}


def case_commit_publish_fp32():
    import torch
    return _commit_publish(torch.float32, torch.float32, 1e-5)


def case_commit_publish_bf16():
    import torch
    return _commit_publish(torch.bfloat16, torch.bfloat16, 2e-2)


def case_commit_publish_fp32_state_bf16_ring():
    import torch
    return _commit_publish(torch.float32, torch.bfloat16, 1e-5)


def case_migrate_fp32():
    import torch
    return _migrate(torch.float32, torch.float32, 1e-5)


def case_migrate_bf16():
    import torch
    return _migrate(torch.bfloat16, torch.bfloat16, 2e-2)


def case_rejects_bad_inputs():
    import torch

    from replayssm_patch.ops import ring_publish, ring_table
    from replayssm_patch.testing.interpreted import refuses

    gen = torch.Generator().manual_seed(3)
    layers = _layers(torch, torch.float32, torch.float32, gen, torch.zeros(2, SLOTS, dtype=torch.int32))
    table = ring_table(*(list(x) for x in zip(*layers)), GROUPS)
    idx = torch.ones(2, 3, dtype=torch.int32)
    take = torch.zeros(3, dtype=torch.int32)
    refuses(ring_publish, dict(table=table, src=idx, dst=idx, take=take),
            dict(src=idx.long(), dst=idx[:1], take=take.long()))
    try:
        ring_table(*(list(x) for x in zip(*layers)), GROUPS[:2])
    except ValueError as e:
        assert "group" in str(e)
    else:
        raise AssertionError("ring_table accepted fewer groups than layers")
    return {}


def _paged_layer(torch, slots, gen):
    """A ring layer as the engine binds it: conv state, checkpoint and ring as views into one
    page per slot (gdn_layer.bind_kv_cache), so every slot stride is the page's."""
    from types import SimpleNamespace

    from replayssm_patch.ring.runtime import RingBuffers

    shapes = [((3, 8), torch.float32), ((HV, V, K), torch.float32), ((HV, L), torch.float32),
              ((HV, L, V), torch.float32), ((H, L, K), torch.float32)]
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in shapes]
    pages = torch.zeros(slots, sum(sizes) + 64, dtype=torch.uint8)
    views, start = [], 16
    for (shape, dtype), size in zip(shapes, sizes):
        views.append(pages[:, start:start + size].view(dtype).view(-1, *shape))
        start += size
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen) * 0.3)
    views[2].copy_(torch.cumsum(-torch.rand(slots, HV, L, generator=gen) * 0.2, dim=-1))
    ring = RingBuffers(views[2], views[3], views[4], torch.zeros(slots, dtype=torch.int32))
    return SimpleNamespace(kv_cache=[views[0], views[1]], replay_ring=ring, pages=pages)


def case_engine_moves_through_the_kernel():
    """ring.align's publish and migrate as the CUDA path runs them (use_kernel: one launch over
    the layers' paged views), against the reference with the block ids written out."""
    import torch

    from replayssm_patch.ops import ring_publish_reference
    from replayssm_patch.ops.cursor import pack_cursor
    from replayssm_patch.ring import align

    gen = torch.Generator().manual_seed(4)
    bs, slots = 8, 30
    layers = [_paged_layer(torch, slots, gen) for _ in range(2)]
    tables = [(torch.randperm(slots - 1, generator=gen)[:20].view(4, 5) + 1).to(torch.int32) for _ in range(2)]
    moves = align.Moves(bs, tables, layers, [0, 1], use_kernel=True)
    rows = torch.tensor([0, 1, 2, -1])
    live = torch.tensor([2, 2, 3, 1])
    acc = torch.tensor([3, 2, 1, 2])
    old = torch.tensor([3 * bs - 3, 2 * bs - 1, 3 * bs + 2, bs])  # in place, inside the span, none, padding
    for layer, bt in zip(layers, tables):
        for r, c in zip(rows.tolist(), live.tolist()):
            if r >= 0:
                layer.replay_ring.cursor[int(bt[r, c])] = int(pack_cursor(torch.tensor(2), torch.tensor(4)))

    def expect(src, dst, take, accepted):
        states = [layer.kv_cache[1].double() for layer in layers]
        cursors = [layer.replay_ring.cursor.clone() for layer in layers]
        rings = [layer.replay_ring for layer in layers]
        ring_publish_reference(states, [r.d.double() for r in rings], [r.k.double() for r in rings],
                               [r.g.double() for r in rings], cursors, [0, 1], src, dst, take, accepted)
        return states, cursors

    def check(want, written):
        worst = 0.0
        for layer, ws, wc, slots_written in zip(layers, *want, written):
            assert torch.equal(layer.replay_ring.cursor, wc)
            got = layer.kv_cache[1]
            for s in range(slots):
                if s in slots_written:
                    err = float((got[s].double() - ws[s]).norm() / ws[s].norm())
                    worst = max(worst, err)
                    assert err < 1e-5, (s, err)
                else:
                    assert torch.equal(got[s].double(), ws[s]), s
        return worst

    crosses, dst_col, take = align.boundary(acc, old + acc, bs)
    valid = rows >= 0
    src = torch.stack([torch.where(valid, bt[rows.clamp(min=0), live], 0) for bt in tables]).int()
    dst = torch.stack([torch.where(valid & crosses, bt[rows.clamp(min=0), dst_col.clamp(min=0)], 0)
                       for bt in tables]).int()
    assert bool((dst[:, 0] == src[:, 0]).all()) and bool((dst[:, 1] != src[:, 1]).all()) and not bool(crosses[2])
    want = expect(src, dst, take.int(), acc.int())
    for layer, g in zip(layers, (0, 1)):  # poison the published block's checkpoint
        layer.kv_cache[1][int(dst[g, 1])] = float("nan")
    align.publish(moves, rows, live, acc, old + acc)
    worst = check(want, [{int(dst[g, 0]), int(dst[g, 1])} for g in (0, 1)])

    src_col, dst_col = torch.tensor([2, 1, 3, 0]), torch.tensor([3, 1, 4, 1])  # row 1 stays, row 3 is padding
    moving = torch.tensor([True, False, True, False])
    src = torch.stack([torch.where(moving, bt[rows.clamp(min=0), src_col], 0) for bt in tables]).int()
    dst = torch.stack([torch.where(moving, bt[rows.clamp(min=0), dst_col], 0) for bt in tables]).int()
    for layer, g in zip(layers, (0, 1)):
        for i in (0, 2):
            layer.kv_cache[1][int(dst[g, i])] = float("nan")
            layer.replay_ring.cursor[int(dst[g, i])] = 7
    want = expect(src, dst, torch.zeros(4, dtype=torch.int32), None)
    align.migrate(moves, rows, src_col, dst_col)
    worst = max(worst, check(want, [{int(dst[g, 0]), int(dst[g, 2])} for g in (0, 1)]))
    return {"max_rel": worst}


CASES = [case_commit_publish_fp32, case_commit_publish_bf16, case_commit_publish_fp32_state_bf16_ring,
         case_migrate_fp32, case_migrate_bf16, case_engine_moves_through_the_kernel, case_rejects_bad_inputs]


test_ring_publish_interpreted = interpreted_test(__file__, CASES)


if __name__ == "__main__":
    from replayssm_patch.testing.interpreted import run_cases

    sys.exit(run_cases(CASES, set(sys.argv[1:])))
