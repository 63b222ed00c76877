"""The Triton ring kernels under TRITON_INTERPRET=1 on the CPU, against the torch reference.

TRITON_INTERPRET must be set before triton is first imported, and another test module of the
same pytest process may already have imported triton. So the checks run in ONE fresh Python
subprocess (this file executed as a script, environment set at its top); it prints one JSON
line per case, and each pytest test below asserts its case's line. Skips cleanly when triton
(or torch) is not installed.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the subprocess: interpret mode before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm_patch.testing.interpreted import interpreted_test


# --------------------------------------------------------------------------------------------
# The checks (run inside the subprocess only)
# --------------------------------------------------------------------------------------------

def _rel(x, ref):

    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _make_rings(torch, slots, H, HV, K, V, L, rdt, gen, cursor_init):
    """Random ring contents (any content is a valid ring) and NaN past each slot's cursor."""
    rd = torch.randn(slots, HV, L, V, generator=gen).to(rdt) * 0.3
    rk = torch.nn.functional.normalize(torch.randn(slots, H, L, K, generator=gen), dim=-1).to(rdt)
    rg = torch.cumsum(-torch.rand(slots, HV, L, generator=gen) * 0.2, dim=-1)
    cur = cursor_init.to(torch.int32)
    for s in range(slots):
        n = int(cur[s])
        rd[s, :, n:] = float("nan")
        rk[s, :, n:] = float("nan")
        rg[s, :, n:] = float("nan")
    return rd, rk, rg, cur


def _run_cycles(
    *, H, HV, K, V, L, sdt, rdt, adt, steps, launch=None, seed=0, strided=False,
    use_force=False, use_start_empty=False, out4=False, l2norm=True, full_ring=False, tol_out, tol_state,
):
    import torch

    from replayssm_patch.ops import override_launch, ring_decode, ring_decode_reference

    gen = torch.Generator().manual_seed(seed)
    slots = 2 * L + 3
    # Row r -> slot; rows with slot 0 (NULL) and -1 (padding) are in the batch too.
    real = list(range(1, L + 2))
    idx = torch.tensor(real[:2] + [0] + real[2:] + [-1], dtype=torch.int32)
    N = idx.numel()
    if strided:  # state and rings live in a bigger page per slot, after some other bytes
        pad = 37
        page = torch.randn(slots, pad + HV * V * K + 11, generator=gen).to(sdt)
        state = page[:, pad:pad + HV * V * K].view(slots, HV, V, K)
        page_ref_outside = [page[:, :pad].clone(), page[:, pad + HV * V * K:].clone()]
    else:
        state = torch.randn(slots, HV, V, K, generator=gen).to(sdt)
    state.mul_(0.2)
    # Every cursor position appears among the rows; with full_ring also n == L (a ring filled
    # to the end by a committed verify window: replayed, then flushed).
    top = L + 1 if full_ring else L
    cursor0 = torch.arange(slots) % top
    rd, rk, rg, cur = _make_rings(torch, slots, H, HV, K, V, L, rdt, gen, cursor0)
    if strided:
        dpage = torch.full((slots, HV * L * V + 5), float("nan")).to(rdt)
        rd_view = dpage[:, 3:3 + HV * L * V].view(slots, HV, L, V)
        rd_view.copy_(rd)
        rd = rd_view
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    mine = [state, rd, rk, rg, cur]
    ref = [t.clone() for t in mine]
    worst_out = worst_state = 0.0
    seen_cursors = set()
    for step in range(steps):
        qkv = torch.randn(N, 2 * H * K + HV * V, generator=gen).to(adt)
        a = torch.randn(N, HV, generator=gen).to(adt)
        b = torch.randn(N, HV, generator=gen).to(adt)
        ff = (torch.rand(N, generator=gen) < 0.2) if use_force else None
        se = (torch.rand(N, generator=gen) < 0.15) if use_start_empty else None
        shape = (N, 1, HV, V) if out4 else (N, HV, V)
        o_mine = torch.full(shape, float("nan"), dtype=adt)
        o_ref = torch.full(shape, float("nan"), dtype=adt)
        seen_cursors.update(int(c) for c in cur[idx[idx > 0].long()])
        with override_launch(decode=launch):  # None: the table's pick
            ring_decode(qkv, a, b, A_log, dt_bias, K ** -0.5, mine[0], o_mine, idx, *mine[1:], ff, se, l2norm)
        ring_decode_reference(qkv, a, b, A_log, dt_bias, K ** -0.5, ref[0], o_ref, idx, *ref[1:], ff, se,
                              l2norm)
        assert not torch.isnan(o_mine).any(), f"step {step}: NaN in the output (unwritten?)"
        o3 = o_mine.view(N, HV, V)
        assert (o3[idx <= 0] == 0).all(), "null/padded rows must get a zero output"
        assert torch.equal(mine[4], ref[4]), f"step {step}: cursor {mine[4].tolist()} != {ref[4].tolist()}"
        worst_out = max(worst_out, _rel(o_mine, o_ref))
        worst_state = max(worst_state, _rel(mine[0], ref[0]))
        # Ring entries below each cursor must match; rows never touched keep their poison.
        for s in range(slots):
            n = int(mine[4][s])
            if n:
                for t_m, t_r in zip(mine[1:4], ref[1:4]):
                    r = _rel(t_m[s, :, :n], t_r[s, :, :n])
                    tol = tol_state if t_m.dtype == torch.float32 else max(tol_state, 1e-2)
                    assert r < tol, f"step {step} slot {s}: ring ({t_m.dtype}) mismatch {r}"
        assert worst_out < tol_out, f"step {step}: output rel err {worst_out} >= {tol_out}"
        assert worst_state < tol_state, f"step {step}: state rel err {worst_state} >= {tol_state}"
    untouched = [s for s in range(slots) if s not in set(idx.tolist())]
    for s in untouched:
        assert torch.equal(mine[0][s], ref[0][s]) and int(mine[4][s]) == int(ref[4][s])
    if strided:
        assert torch.equal(page[:, :pad], page_ref_outside[0])
        assert torch.equal(page[:, pad + HV * V * K:], page_ref_outside[1])
        assert torch.isnan(dpage[:, :3].float()).all() and torch.isnan(dpage[:, -2:].float()).all()
    assert seen_cursors == set(range(top)), f"cursor positions seen {sorted(seen_cursors)}"
    return {"out_rel": worst_out, "state_rel": worst_state}


def _launch(form, block_v, **kw):
    from replayssm_patch.ops import DecodeLaunch

    return DecodeLaunch(form, block_v, **kw)


def case_fp32_gqa2_blocks():
    import torch

    # V=32 in two value blocks of 16 (P = HV*2 tickets per row).
    return _run_cycles(H=2, HV=4, K=32, V=32, L=4, sdt=torch.float32, rdt=torch.float32,
                       adt=torch.float32, steps=9, launch=_launch("fused", 16), full_ring=True,
                       tol_out=1e-5, tol_state=1e-5)


def case_fp32_fused_four_blocks_of_8():
    import torch

    # The table's smallest tiles: V=32 in four blocks of 8 (P = HV*4 tickets per row).
    return _run_cycles(H=2, HV=4, K=32, V=32, L=4, sdt=torch.float32, rdt=torch.float32,
                       adt=torch.float32, steps=9, launch=_launch("fused", 8), full_ring=True,
                       seed=6, tol_out=1e-5, tol_state=1e-5)


def case_fp32_fused_force_flush_start_empty():
    import torch

    return _run_cycles(H=1, HV=3, K=16, V=32, L=5, sdt=torch.float32, rdt=torch.float32,
                       adt=torch.float32, steps=11, launch=_launch("fused", 32), use_force=True,
                       use_start_empty=True, full_ring=True, seed=1, tol_out=1e-5, tol_state=1e-5)


def case_bf16_state_bf16_ring_gqa8_out4():
    import torch

    return _run_cycles(H=1, HV=8, K=16, V=16, L=3, sdt=torch.bfloat16, rdt=torch.bfloat16,
                       adt=torch.bfloat16, steps=6, use_force=True, out4=True, seed=2,
                       tol_out=2e-2, tol_state=2e-2)


def case_fp16_state_strided_k64():
    import torch

    return _run_cycles(H=2, HV=2, K=64, V=64, L=3, sdt=torch.float16, rdt=torch.float16,
                       adt=torch.float16, steps=4, strided=True, seed=3, launch=_launch("fused", 32),
                       tol_out=5e-3, tol_state=5e-3)


def case_fp32_no_l2norm_table_launch():
    import torch

    # A bf16 ring: a d entry that lands on a rounding boundary may round one ulp apart in the
    # two implementations (their fp32 sums differ in order), so later steps differ by ~1e-3.
    return _run_cycles(H=2, HV=2, K=16, V=16, L=2, sdt=torch.float32, rdt=torch.bfloat16,
                       adt=torch.float32, steps=4, l2norm=False, seed=4,
                       tol_out=1e-2, tol_state=1e-2)


def case_two_phase_fp32_flags_full_ring():
    import torch

    # The prep + main kernel launch: force_flush, start_empty, n == L, null/padded rows, GQA 2,
    # two value blocks per head.
    return _run_cycles(H=2, HV=4, K=16, V=32, L=4, sdt=torch.float32, rdt=torch.float32,
                       adt=torch.float32, steps=9, launch=_launch("two_phase", 16), full_ring=True,
                       use_force=True, use_start_empty=True, tol_out=1e-5, tol_state=1e-5)


def case_two_phase_bf16_strided_gqa3():
    import torch

    return _run_cycles(H=1, HV=3, K=16, V=16, L=3, sdt=torch.bfloat16, rdt=torch.bfloat16,
                       adt=torch.bfloat16, steps=7, launch=_launch("two_phase", 16, pdl=True), strided=True,
                       out4=True, seed=6, tol_out=2e-2, tol_state=2e-2)


def case_replay_two_phase_fp32_flags_full_ring():
    import torch

    # The replay-vector prep + main launch: force_flush, start_empty, n == L, null/padded rows,
    # GQA 2, two value blocks per head.
    return _run_cycles(H=2, HV=4, K=16, V=32, L=4, sdt=torch.float32, rdt=torch.float32,
                       adt=torch.float32, steps=9, launch=_launch("replay", 16), full_ring=True,
                       use_force=True, use_start_empty=True, seed=8, tol_out=1e-5, tol_state=1e-5)


def case_replay_two_phase_bf16_strided_gqa3_no_l2norm():
    import torch

    return _run_cycles(H=1, HV=3, K=16, V=16, L=3, sdt=torch.bfloat16, rdt=torch.bfloat16,
                       adt=torch.bfloat16, steps=7, launch=_launch("replay", 8), strided=True,
                       out4=True, l2norm=False, seed=9, tol_out=2e-2, tol_state=2e-2)


def case_materialize_reset():
    import torch

    from replayssm_patch.ops import (ring_materialize, ring_materialize_reference, ring_reset,
                                           ring_reset_reference)

    gen = torch.Generator().manual_seed(5)
    H, HV, K, V, L, slots = 2, 4, 32, 32, 5, 8
    res = {}
    for sdt in (torch.float32, torch.bfloat16):
        state = (torch.randn(slots, HV, V, K, generator=gen) * 0.2).to(sdt)
        cursor0 = torch.tensor([3, 0, 5, 2, 0, 1, 3, 4])  # 5 == L: a full ring
        rd, rk, rg, cur = _make_rings(torch, slots, H, HV, K, V, L, torch.bfloat16, gen, cursor0)
        mine = [state, rd, rk, rg, cur]
        ref = [t.clone() for t in mine]
        before = state.clone()
        sel = torch.tensor([2, 0, 1, -1, 4, 6], dtype=torch.int64)  # 1 and 4: empty rings
        ring_materialize(*mine, sel)
        ring_materialize_reference(*ref, sel)
        assert torch.equal(mine[4], ref[4]), (mine[4].tolist(), ref[4].tolist())
        for s in (1, 4):  # empty ring: checkpoint bit-identical
            assert torch.equal(mine[0][s], before[s]), "empty ring changed the checkpoint"
        for s in (0, 3, 5, 7):  # not selected: untouched
            assert torch.equal(mine[0][s], ref[0][s]) and int(mine[4][s]) == int(cursor0[s])
        r = _rel(mine[0], ref[0])
        assert r < (1e-6 if sdt == torch.float32 else 1e-2), r
        res[str(sdt)] = r
        ring_reset(mine[4], torch.tensor([3, -1, 0, 7], dtype=torch.int32))
        ring_reset_reference(ref[4], torch.tensor([3, -1, 0, 7], dtype=torch.int32))
        assert torch.equal(mine[4], ref[4])
        assert int(mine[4][0]) == int(cursor0[0]), "slot 0 must never be touched"
    return res


def case_compile_ahead_changes_nothing_and_slices_still_work():
    """CudaRingOps.compile_ahead on poisoned rings leaves every byte as it was (all its launches name
    slot 0); then reset, materialise and commit on slices of an index list that start at every
    alignment (as vLLM's state-index slices do) agree with the references."""
    import torch

    from collections import Counter

    from replayssm_patch.ops import (pack_cursor, ring_commit, ring_commit_pending_reference, ring_materialize,
                                     ring_materialize_reference, ring_reset, ring_reset_reference, unpack_cursor)
    from replayssm_patch.ring.runtime import CudaRingOps, RingBuffers

    gen = torch.Generator().manual_seed(11)
    H, HV, K, V, L, slots = 2, 4, 32, 32, 5, 9
    state = (torch.randn(slots, HV, V, K, generator=gen) * 0.2)
    state[0] = float("nan")  # the null slot: nothing may read or write it
    cursor0 = torch.tensor([2, 3, 0, 5, 2, 0, 1, 3, 4])
    rd, rk, rg, cur = _make_rings(torch, slots, H, HV, K, V, L, torch.bfloat16, gen, cursor0)
    ring = RingBuffers(g=rg, d=rd, k=rk, cursor=cur)
    before = [t.clone() for t in (state, rd, rk, rg, cur)]
    stats = Counter()
    CudaRingOps(stats).compile_ahead(state, ring, speculative=True)
    for t, b in zip((state, rd, rk, rg, cur), before):  # as bytes: NaN poison compares equal
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)), "compile_ahead wrote"
    assert not stats, stats  # warming up is not ring work
    index = torch.tensor([0, 3, 1, 7, 0, 8, 2], dtype=torch.int32)
    for off in range(4):
        sel = index[off:off + 3]  # int32 slice: its data pointer moves by 4 bytes per offset
        mine = [state.clone(), rd.clone(), rk.clone(), rg.clone(), cur.clone()]
        ref = [t.clone() for t in mine]
        ring_materialize(*mine, sel)
        ring_materialize_reference(*ref, sel)
        assert torch.equal(mine[4], ref[4]) and _rel(mine[0][1:], ref[0][1:]) < 1e-6, off
        c, c_ref = cur.clone(), cur.clone()
        ring_reset(c, sel)
        ring_reset_reference(c_ref, sel)
        assert torch.equal(c, c_ref), off
        acc = torch.tensor([1, 2, 1, 3, 1, 2, 1], dtype=torch.int32)[off:off + 3]
        words = pack_cursor(cur.clamp(max=2), torch.tensor([0, 2, 1, 3, 0, 2, 1, 3, 2]))  # pending windows
        c = words.clone()
        ring_commit(c, sel, acc, L)
        n, pending = unpack_cursor(words.clone())
        ring_commit_pending_reference(n, pending, sel, acc, L)
        assert torch.equal(c, pack_cursor(n, pending)), (off, c.tolist())
    return {"offsets": 4}


def case_materialize_drops_start_empty_rows():
    """A row flagged start_empty has a stale ring (its state came without it): dropped (cursor
    0, checkpoint bit-identical), while the other rows flush as usual."""
    import torch

    from replayssm_patch.ops import ring_materialize, ring_materialize_reference

    gen = torch.Generator().manual_seed(6)
    H, HV, K, V, L, slots = 1, 2, 16, 16, 4, 6
    state = torch.randn(slots, HV, V, K, generator=gen) * 0.2
    cursor0 = torch.tensor([0, 3, 2, 4, 1, 2])
    rd, rk, rg, cur = _make_rings(torch, slots, H, HV, K, V, L, torch.float32, gen, cursor0)
    mine = [state.clone(), rd, rk, rg, cur]
    ref = [t.clone() for t in mine]
    sel = torch.tensor([1, 2, 0, 3, 5], dtype=torch.int32)
    empty = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int8)  # slots 1 and 5 stale; 0 is null
    ring_materialize(*mine, sel, empty)
    ring_materialize_reference(*ref, sel, empty)
    assert torch.equal(mine[4], ref[4]) and mine[4][[1, 2, 3, 5]].tolist() == [0, 0, 0, 0], mine[4].tolist()
    for s in (1, 5):
        assert torch.equal(mine[0][s], state[s]), "a dropped ring changed the checkpoint"
    assert int(mine[4][4]) == 1 and torch.equal(mine[0][4], state[4]), "an unselected slot changed"
    r = _rel(mine[0], ref[0])
    assert r < 1e-6 and not torch.equal(mine[0][2], state[2]), r
    return {"rel": r}


def case_tc_flush_fused_fp16_flags_full_ring():
    import torch

    # The tensor-core flush of the fused kernel (fp16 ring: the interpreter's fp16 dots are
    # right): poisoned entries past every cursor, forced flushes, n == L, GQA 2, two blocks.
    return _run_cycles(H=2, HV=4, K=32, V=32, L=16, sdt=torch.float16, rdt=torch.float16,
                       adt=torch.float32, steps=6, launch=_launch("fused", 16, flush_tc=True), full_ring=True,
                       use_force=True, seed=11, tol_out=2e-3, tol_state=2e-3)


def case_tc_flush_two_phase_fp32_state_start_empty():
    import torch

    # The two-phase main kernel's tensor-core flush; an fp32 checkpoint keeps its accuracy.
    return _run_cycles(H=1, HV=2, K=32, V=16, L=12, sdt=torch.float32, rdt=torch.float16,
                       adt=torch.float32, steps=14, launch=_launch("two_phase", 16, pdl=True, flush_tc=True),
                       use_start_empty=True, seed=12, tol_out=1e-5, tol_state=1e-5)


def case_tc_flush_refused_where_it_cannot_run():
    import torch

    from replayssm_patch.ops import DecodeLaunch, override_launch, pick_decode_launch, ring_decode

    H, HV, K, V, slots, N = 1, 2, 16, 16, 3, 2
    for L, rdt, BV in ((16, torch.bfloat16, 16), (16, torch.float32, 16), (8, torch.float16, 16),
                       (16, torch.float16, 8)):
        try:
            with override_launch(decode=DecodeLaunch("fused", BV, flush_tc=True)):
                ring_decode(torch.randn(N, 2 * H * K + HV * V), torch.randn(N, HV), torch.randn(N, HV),
                            torch.zeros(HV), torch.zeros(HV), 0.25, torch.zeros(slots, HV, V, K),
                            torch.zeros(N, HV, V), torch.tensor([1, 2], dtype=torch.int32),
                            torch.zeros(slots, HV, L, V, dtype=rdt), torch.zeros(slots, H, L, K, dtype=rdt),
                            torch.zeros(slots, HV, L), torch.zeros(slots, dtype=torch.int32))
        except ValueError as e:
            assert "tensor-core flush" in str(e), e
            continue
        raise AssertionError(f"tensor-core flush accepted with L={L}, ring {rdt}, BV={BV}")
    # The launch table asks for it only where it runs: never with a bf16 ring off the GPU.
    for pairs_rows in (1, 4, 40):
        launch = pick_decode_launch(pairs_rows, 32, torch.bfloat16, torch.bfloat16, 16, "cpu")
        assert not launch.flush_tc, launch
    assert pick_decode_launch(1, 32, torch.bfloat16, torch.float16, 16, "cpu").flush_tc
    return {}


def case_rejects_bad_inputs():
    import torch

    from replayssm_patch.ops import ring_decode

    H, HV, K, V, L, slots, N = 1, 2, 16, 16, 4, 3, 2
    args = dict(
        mixed_qkv=torch.randn(N, 2 * H * K + HV * V), a=torch.randn(N, HV), b=torch.randn(N, HV),
        A_log=torch.zeros(HV), dt_bias=torch.zeros(HV), scale=0.25,
        state=torch.zeros(slots, HV, V, K), out=torch.zeros(N, HV, V),
        state_indices=torch.tensor([1, 2], dtype=torch.int32),
        ring_d=torch.zeros(slots, HV, L, V), ring_k=torch.zeros(slots, H, L, K),
        ring_g=torch.zeros(slots, HV, L), cursor=torch.zeros(slots, dtype=torch.int32),
    )
    bad = {
        "cursor": torch.zeros(slots, dtype=torch.int64),
        "ring_d": torch.zeros(slots, HV, L + 1, V),
        "state": torch.zeros(slots, HV, K, V).transpose(2, 3),
        "out": torch.zeros(N, V, HV).transpose(1, 2),
        "mixed_qkv": torch.randn(N, 2 * H * K + HV * V + 1),
    }
    for name, t in bad.items():
        try:
            ring_decode(**{**args, name: t})
        except ValueError:
            continue
        raise AssertionError(f"bad {name} was accepted")
    return {}


CASES = [
    case_fp32_gqa2_blocks,
    case_fp32_fused_four_blocks_of_8,
    case_fp32_fused_force_flush_start_empty,
    case_bf16_state_bf16_ring_gqa8_out4,
    case_fp16_state_strided_k64,
    case_fp32_no_l2norm_table_launch,
    case_two_phase_fp32_flags_full_ring,
    case_two_phase_bf16_strided_gqa3,
    case_replay_two_phase_fp32_flags_full_ring,
    case_replay_two_phase_bf16_strided_gqa3_no_l2norm,
    case_materialize_reset,
    case_materialize_drops_start_empty_rows,
    case_compile_ahead_changes_nothing_and_slices_still_work,
    case_tc_flush_fused_fp16_flags_full_ring,
    case_tc_flush_two_phase_fp32_state_start_empty,
    case_tc_flush_refused_where_it_cannot_run,
    case_rejects_bad_inputs,
]


test_ring_kernel_interpreted = interpreted_test(__file__, CASES)


if __name__ == "__main__":
    from replayssm_patch.testing.interpreted import run_cases

    sys.exit(run_cases(CASES, set(sys.argv[1:])))
