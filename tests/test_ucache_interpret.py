"""The ring bookkeeping around FlashInfer's verify kernel (`ops/ucache.py`) under
TRITON_INTERPRET=1 on the CPU, against torch.

The reference is the same bookkeeping written as torch ops (what `flashinfer_verify` ran before
the two kernels; GPU-tested there against our verify kernel), with the delayed commit from
`ring_commit_pending_reference`. Fresh random inputs per case: cursor words with random
committed counts (0..L) and pending windows (0..W), accepted counts beyond the window, rows
ending exactly at and one past the fold threshold (16 committed entries), padding
rows (slot 0 and -1), rings as strided views inside bigger pages with random content, so that
entries the kernels must not move are checked too. `ucache_finish` sees committed counts on both
sides of the fold threshold (16 - W + 1). Runs in one fresh subprocess, as
test_ring_verify_interpret.py does.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the subprocess: interpret mode before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm_patch.testing.interpreted import interpreted_test

LIVE, L = 16, 32


def _prepare_reference(cursor, slots, acc):
    import torch

    from replayssm_patch.ops import pack_cursor, ring_commit_pending_reference, unpack_cursor

    n, pending = unpack_cursor(cursor)
    ring_commit_pending_reference(n, pending, slots, acc, L)
    cursor = pack_cursor(n, pending)
    real = slots > 0
    rows_slot = torch.where(real, slots, 0).long()
    n = torch.where(real, cursor[rows_slot] & 0xFF, 0)
    return (cursor, rows_slot.int(), torch.where(n > LIVE, 0, n).int(), torch.where(n > LIVE, slots, 0).int())


def _finish_reference(d, k, g, cursor, rows_slot, hist, window):
    import torch

    from replayssm_patch.ops import pack_cursor

    rows = rows_slot.shape[0]
    folded = hist >= LIVE - window + 1
    src = torch.where(folded, hist, 0).long()[:, None] + torch.arange(window)
    dst = torch.arange(window).expand(rows, window)
    at = rows_slot.long()[:, None]
    for t in (d, k, g):
        t[at, :, dst] = t[at, :, src]
    word = pack_cursor(torch.where(folded, 0, hist), torch.full_like(hist, window))
    real = rows_slot > 0
    cursor[rows_slot.long()] = torch.where(real, word, cursor[rows_slot.long()])


def _paged(slots, shape, dtype, gen, device):
    """A [slots, *shape] view inside bigger per-slot pages (strided, as the rings in vLLM's cache)."""
    import torch

    inner = 1
    for s in shape:
        inner *= s
    page = torch.randn(slots, 32 + inner + 32, generator=gen).to(dtype).to(device)
    return page[:, 32:32 + inner].view(slots, *shape)


def _check_prepare(seed, with_acc, device="cpu"):
    import torch

    from replayssm_patch.ops import pack_cursor, ucache_prepare

    gen = torch.Generator().manual_seed(seed)
    nslots, window = 40, 4
    n = torch.randint(0, L + 1, (nslots,), generator=gen)
    pending = torch.randint(0, window + 1, (nslots,), generator=gen)
    cursor = pack_cursor(n, pending)
    slots = torch.randperm(nslots - 1, generator=gen)[:24].int() + 1
    slots[3], slots[11] = 0, -1  # padding rows
    acc = torch.randint(-1, window + 3, (slots.shape[0],), generator=gen).int() if with_acc else None
    # rows that end exactly at the fold threshold and one past it, after the commit
    for row, (n_i, p_i, a_i) in zip((0, 1, 2), ((LIVE, 0, 2), (LIVE - 1, 2, 1), (LIVE + 1, 0, 0))):
        cursor[slots[row]] = int(pack_cursor(torch.tensor(n_i), torch.tensor(p_i if with_acc else 0)))
        if acc is not None:
            acc[row] = a_i
    want = _prepare_reference(cursor.clone(), slots, acc)
    got_cursor = cursor.to(device)
    slot_out, hist, base, fold = (t.cpu() for t in ucache_prepare(
        got_cursor, slots.to(device), None if acc is None else acc.to(device), L, LIVE))
    got_cursor = got_cursor.cpu()
    for name, g, w in zip(("cursor", "slot", "hist", "fold"), (got_cursor, slot_out, hist, fold), want):
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"
    assert torch.equal(base, torch.zeros_like(base))
    assert all(t.dtype == torch.int32 for t in (slot_out, hist, base, fold))
    folded = int((fold > 0).sum())
    assert folded and folded < int((slots > 0).sum()), "the draw should fold some rows, not all"
    return {"rows": slots.shape[0], "folded": folded}


def case_prepare_with_accepted_counts():
    return _check_prepare(1, with_acc=True)


def case_prepare_drops_windows_without_counts():
    return _check_prepare(2, with_acc=False)


def _check_finish(seed, window, device="cpu"):
    import torch

    from replayssm_patch.ops import ucache_finish

    gen = torch.Generator().manual_seed(seed)
    nslots, H, HV, K, V = 12, 2, 4, 128, 128
    d = _paged(nslots, (HV, L, V), torch.bfloat16, gen, device)
    k = _paged(nslots, (H, L, K), torch.bfloat16, gen, device)
    g = _paged(nslots, (HV, L), torch.float32, gen, device)
    cursor = torch.randint(0, 1 << 12, (nslots,), generator=gen).int().to(device)
    slots = torch.tensor([3, 0, 7, 5, 1, 9, 0, 11], dtype=torch.int32)
    # committed counts on both sides of the fold threshold, and the extremes
    hist = torch.tensor([LIVE, 4, LIVE - window + 1, LIVE - window, 0, LIVE - 1, 12, 2], dtype=torch.int32)
    hist[~(slots > 0)] = 0
    ref = [t.cpu().clone() for t in (d, k, g, cursor)]
    _finish_reference(*ref, slots, hist, window)
    ucache_finish(d, k, g, cursor, slots.to(device), hist.to(device), window, LIVE)
    d, k, g, cursor = (t.cpu() for t in (d, k, g, cursor))
    for name, got, want in zip("dkg", (d, k, g), ref[:3]):
        assert torch.equal(got, want), f"ring {name} differs"
    assert torch.equal(cursor, ref[3]), f"cursor {cursor.tolist()} != {ref[3].tolist()}"
    moved = int((hist >= LIVE - window + 1).sum())
    assert moved >= 2
    return {"window": window, "moved_rows": moved}


def case_finish_window_4():
    return _check_finish(3, 4)


def case_finish_window_8():
    return _check_finish(4, 8)


def case_prepare_outputs_aligned():
    """FlashInfer assumes 16-byte aligned int32 row tensors: every row count gets them."""
    import torch

    from replayssm_patch.ops import ucache_prepare

    cursor = torch.zeros(16, dtype=torch.int32)
    for rows in range(1, 10):
        slots = torch.arange(1, rows + 1, dtype=torch.int32)
        outs = ucache_prepare(cursor, slots, None, L, LIVE)
        for name, t in zip(("slot", "hist", "base", "fold"), outs):
            assert t.is_contiguous() and t.shape == (rows,), (name, t.shape, t.stride())
            assert t.data_ptr() % 16 == 0, f"rows={rows}: {name} starts at {t.data_ptr() % 16} mod 16"
        assert torch.equal(outs[0], slots)
    return {"rows": "1-9"}


def case_rejects_bad_inputs():
    import torch

    from replayssm_patch.ops import ucache_finish, ucache_prepare
    from replayssm_patch.testing.interpreted import refuses

    cursor = torch.zeros(8, dtype=torch.int32)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    refuses(ucache_prepare, dict(cursor=cursor, slots=slots, num_accepted=None, L=L, live_rows=LIVE),
            dict(L=300, live_rows=40))
    d, k, g = torch.zeros(8, 4, L, 128), torch.zeros(8, 2, L, 128), torch.zeros(8, 4, L)
    refuses(ucache_finish, dict(ring_d=d, ring_k=k, ring_g=g, cursor=cursor, slots=slots, hist=slots.clone(),
                                window=4, live_rows=LIVE), dict(window=6, hist=slots.long()))
    return {}


CASES = [case_prepare_with_accepted_counts, case_prepare_drops_windows_without_counts, case_prepare_outputs_aligned,
         case_finish_window_4, case_finish_window_8, case_rejects_bad_inputs]


test_ucache_bookkeeping_interpreted = interpreted_test(__file__, CASES)


if __name__ == "__main__":
    from replayssm_patch.testing.interpreted import run_cases

    sys.exit(run_cases(CASES, set(sys.argv[1:])))
