"""The Triton speculative-verify kernel under TRITON_INTERPRET=1 on the CPU, against float64.

Ground truth is `ring_spec_verify_reference` (delayed commit + verify, `verify_reference`) run on
a float64 copy of the checkpoint (and of fp32 rings); the reference itself is tested against
the plain sequential recurrence in tests/test_reference.py. As in test_ring_kernel_interpret.py,
the checks run in ONE fresh subprocess (TRITON_INTERPRET must be set before triton is first
imported), which prints one JSON line per case.

Every case draws fresh random inputs; per step each row verifies a random number of tokens
(ragged, 1..T+1, some rows 0), the previous window's accepted count is random in 0..W (every
value is seen), rings start with random committed entries and NaN past them, outputs are
poisoned with NaN, a NULL-slot row and a padded row are in the batch, and tokens outside every
row must stay untouched. Ring lengths are small, so flushes happen during pending windows and
committed windows fill the ring to its end (n == L). The fp32 cases run the main kernel with
blocks of 16 value rows and 4 warps (an `override_launch`), the bf16 case with the default launch.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the subprocess: interpret mode before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm_patch.testing.interpreted import interpreted_test


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _run_spec(*, H, HV, K, V, L, T, sdt, rdt, adt, steps, seed, tol_out, tol_state, launch=None,
              out4=False, check_decode_after=False, verify=None):
    """`steps` speculative steps (window up to W = T + 1 tokens) on the kernel and the reference.
    `verify`: the implementation under test, called as `ring_verify` is (default: the Triton kernel)."""
    import torch

    from replayssm_patch.ops import (
        override_launch,
        pack_cursor,
        ring_commit,
        ring_commit_pending_reference,
        ring_decode,
        ring_decode_reference,
        ring_spec_verify_reference,
        ring_verify,
    )

    gen = torch.Generator().manual_seed(seed)
    W = T + 1
    slots = 9
    idx = torch.tensor([3, 0, 1, 5, -1, 7], dtype=torch.int32)
    N = idx.numel()
    valid = (idx > 0).nonzero().flatten().tolist()
    state = (torch.randn(slots, HV, V, K, generator=gen) * 0.2).to(sdt)
    # Random committed entries (any content is a valid ring), NaN past the cursor, no window.
    cursor0 = torch.randint(0, L - W + 1, (slots,), generator=gen).to(torch.int32)
    rd = (torch.randn(slots, HV, L, V, generator=gen) * 0.3).to(rdt)
    rk = torch.nn.functional.normalize(torch.randn(slots, H, L, K, generator=gen), dim=-1).to(rdt)
    rg = torch.cumsum(-torch.rand(slots, HV, L, generator=gen) * 0.2, dim=-1)
    for s in range(slots):
        n = int(cursor0[s])
        rd[s, :, n:] = float("nan")
        rk[s, :, n:] = float("nan")
        rg[s, :, n:] = float("nan")
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen) * 0.5

    state0 = state.clone()
    mine = dict(state=state, d=rd, k=rk, g=rg, word=cursor0.clone())
    f64 = torch.float64
    ref = dict(state=state.to(f64), d=rd.to(f64) if rdt == torch.float32 else rd.clone(),
               k=rk.to(f64) if rdt == torch.float32 else rk.clone(), g=rg.to(f64),
               cursor=cursor0.clone(), pending=torch.zeros(slots, dtype=torch.int32))
    seen_acc, flushes, full_rings = set(), 0, 0
    worst_out = worst_state = 0.0
    last_T = torch.zeros(N, dtype=torch.long)
    for step in range(steps):
        Ts = torch.randint(1, W + 1, (N,), generator=gen)
        Ts[torch.rand(N, generator=gen) < 0.12] = 0
        cu = torch.zeros(N + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(Ts, 0)
        extra = 3  # tokens outside every row (vLLM pads token counts for graphs)
        ntok = int(cu[-1]) + extra
        # accepted counts of the previous window: every value 0..W over the run
        # (all accepted a third of the time, else uniform; vLLM never sends 0, the API allows it)
        draw = torch.rand(N, generator=gen) * (last_T + 1).double()
        acc = torch.where(torch.rand(N, generator=gen) < 1 / 3, last_T, draw.long())
        acc = torch.where(last_T > 0, acc, torch.ones_like(acc)).to(torch.int32)
        seen_acc.update(int(acc[i]) for i in valid if last_T[i] > 0)
        qkv = torch.randn(ntok, 2 * H * K + HV * V, generator=gen).to(adt)
        a = torch.randn(ntok, HV, generator=gen).to(adt)
        b = torch.randn(ntok, HV, generator=gen).to(adt)
        shape = (ntok, 1, HV, V) if out4 else (ntok, HV, V)
        o_mine = torch.full(shape, float("nan"), dtype=adt)
        o_ref = torch.full(shape, float("nan"), dtype=f64)
        c_before = ref["cursor"].clone()
        p_before = ref["pending"].clone()
        with override_launch(verify=launch):  # None: the default launch
            (verify or ring_verify)(qkv, a, b, A_log, dt_bias, K ** -0.5, mine["state"], o_mine, idx, cu,
                                    mine["d"], mine["k"], mine["g"], mine["word"], acc, W)
        ring_spec_verify_reference(qkv, a, b, A_log, dt_bias, K ** -0.5, ref["state"], o_ref, idx, cu,
                                   ref["d"], ref["k"], ref["g"], ref["cursor"], ref["pending"], acc)
        for i in valid:
            s = int(idx[i])
            committed = int(c_before[s]) + min(int(acc[i]), int(p_before[s])) if p_before[s] > 0 else int(c_before[s])
            if Ts[i] > 0 and committed + int(Ts[i]) > L:
                flushes += 1
            if committed == L:
                full_rings += 1
        o3m, o3r = o_mine.view(ntok, HV, V), o_ref.view(ntok, HV, V)
        inside = int(cu[-1])
        assert torch.isnan(o3m[inside:].float()).all(), f"step {step}: a token outside every row was written"
        assert not torch.isnan(o3m[:inside].float()).any(), f"step {step}: NaN in the output (unwritten?)"
        for i in range(N):
            if idx[i] <= 0:
                assert (o3m[int(cu[i]):int(cu[i + 1])] == 0).all(), "null/padded rows must get zero outputs"
        worst_out = max(worst_out, _rel(o3m[:inside], o3r[:inside]))
        expect_word = pack_cursor(ref["cursor"], ref["pending"])
        assert torch.equal(mine["word"], expect_word), \
            f"step {step}: cursor word {mine['word'].tolist()} != {expect_word.tolist()}"
        worst_state = max(worst_state, _rel(mine["state"], ref["state"]))
        for s in set(idx[idx > 0].tolist()):
            n = int(ref["cursor"][s]) + int(ref["pending"][s])  # committed + pending entries
            for name in ("d", "k", "g"):
                r = _rel(mine[name][s, :, :n], ref[name][s, :, :n])
                tol = tol_state if mine[name].dtype == torch.float32 else max(tol_state, 1e-2)
                assert r < tol, f"step {step} slot {s}: ring {name} mismatch {r}"
        assert worst_out < tol_out, f"step {step}: output rel err {worst_out} >= {tol_out}"
        assert worst_state < tol_state, f"step {step}: state rel err {worst_state} >= {tol_state}"
        last_T = Ts.clone()
    untouched = [s for s in range(slots) if s not in set(idx.tolist())]
    for s in untouched:
        assert torch.equal(mine["state"][s], state0[s]), "a checkpoint outside the batch changed"
        assert int(mine["word"][s]) == int(cursor0[s]), "a slot outside the batch changed"
    assert seen_acc >= set(range(0, W + 1)), f"accepted counts seen {sorted(seen_acc)}"
    assert flushes > 0, "no flush during a pending window"
    info = {"out_rel": worst_out, "state_rel": worst_state, "flushes": flushes, "full_rings": full_rings}
    if check_decode_after:
        # After a standalone commit the slots hold the plain entry count ring_decode expects.
        acc = torch.randint(1, W + 1, (N,), generator=gen).to(torch.int32)
        ring_commit(mine["word"], idx, acc, L)
        ring_commit_pending_reference(ref["cursor"], ref["pending"], idx, acc, L)
        assert torch.equal(mine["word"], ref["cursor"]), (mine["word"].tolist(), ref["cursor"].tolist())
        cursor_m = mine["word"]
        qkv = torch.randn(N, 2 * H * K + HV * V, generator=gen).to(adt)
        a = torch.randn(N, HV, generator=gen).to(adt)
        b = torch.randn(N, HV, generator=gen).to(adt)
        o_m = torch.full((N, HV, V), float("nan"), dtype=adt)
        o_r = torch.full((N, HV, V), float("nan"), dtype=f64)
        ring_decode(qkv, a, b, A_log, dt_bias, K ** -0.5, mine["state"], o_m, idx,
                    mine["d"], mine["k"], mine["g"], cursor_m)
        ring_decode_reference(qkv, a, b, A_log, dt_bias, K ** -0.5, ref["state"], o_r, idx,
                              ref["d"], ref["k"], ref["g"], ref["cursor"])
        assert torch.equal(cursor_m, ref["cursor"])
        r = _rel(o_m, o_r)
        assert r < tol_out, f"decode after commit: rel err {r}"
        info["decode_after_commit_rel"] = r
    return info


def _blocks_of_16():
    from replayssm_patch.ops import VerifyLaunch

    return VerifyLaunch(block_v=16, num_warps=4)


def case_fp32_t3_gqa2_ragged():
    import torch

    # W up to 4 on an 8-entry ring: windows often do not fit, so verify flushes first.
    return _run_spec(H=2, HV=4, K=16, V=32, L=8, T=3, sdt=torch.float32, rdt=torch.float32,
                     adt=torch.float32, steps=10, seed=0, tol_out=1e-5, tol_state=1e-5,
                     launch=_blocks_of_16(), check_decode_after=True)


def case_fp32_t7_ring16_out4():
    import torch

    # T = 7 (W = 8) on a 16-entry ring, one key head, value dim in two blocks.
    return _run_spec(H=1, HV=2, K=16, V=32, L=16, T=7, sdt=torch.float32, rdt=torch.float32,
                     adt=torch.float32, steps=10, seed=1, tol_out=1e-5, tol_state=1e-5,
                     launch=_blocks_of_16(), out4=True)


def case_bf16_state_bf16_ring_t1():
    import torch

    return _run_spec(H=1, HV=2, K=16, V=16, L=4, T=1, sdt=torch.bfloat16, rdt=torch.bfloat16,
                     adt=torch.bfloat16, steps=12, seed=2, tol_out=2e-2, tol_state=2e-2)


def case_rejects_bad_inputs():
    import torch

    from replayssm_patch.ops import ring_commit, ring_verify

    H, HV, K, V, L, slots, N, ntok = 1, 2, 16, 16, 8, 3, 2, 5
    args = dict(
        mixed_qkv=torch.randn(ntok, 2 * H * K + HV * V), a=torch.randn(ntok, HV), b=torch.randn(ntok, HV),
        A_log=torch.zeros(HV), dt_bias=torch.zeros(HV), scale=0.25,
        state=torch.zeros(slots, HV, V, K), out=torch.zeros(ntok, HV, V),
        state_indices=torch.tensor([1, 2], dtype=torch.int32), cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32),
        ring_d=torch.zeros(slots, HV, L, V), ring_k=torch.zeros(slots, H, L, K),
        ring_g=torch.zeros(slots, HV, L), cursor=torch.zeros(slots, dtype=torch.int32),
        num_accepted=torch.ones(N, dtype=torch.int32), max_tokens=3,
    )
    ring_verify(**args)  # the good call runs
    bad = {
        "cursor": torch.zeros(slots, dtype=torch.int64),
        "ring_d": torch.zeros(slots, HV, L + 1, V),
        "state": torch.zeros(slots, HV, K, V).transpose(2, 3),
        "out": torch.zeros(ntok, V, HV).transpose(1, 2),
        "mixed_qkv": torch.randn(ntok, 2 * H * K + HV * V + 1),
        "cu_seqlens": torch.tensor([0, 2], dtype=torch.int32),
        "num_accepted": torch.ones(N, dtype=torch.float32),
        "max_tokens": L + 1,
        "a": torch.randn(ntok + 1, HV),
    }
    for name, t in bad.items():
        try:
            ring_verify(**{**args, name: t})
        except ValueError as e:
            assert name.split("_")[0] in str(e), f"the error for {name} does not name it: {e}"
            continue
        raise AssertionError(f"bad {name} was accepted")
    try:
        ring_commit(torch.zeros(slots, dtype=torch.int32), torch.tensor([1]), None, 300)
    except ValueError as e:
        assert "L" in str(e)
    else:
        raise AssertionError("ring_commit accepted L=300")
    return {}


CASES = [case_fp32_t3_gqa2_ragged, case_fp32_t7_ring16_out4, case_bf16_state_bf16_ring_t1,
         case_rejects_bad_inputs]


test_ring_verify_interpreted = interpreted_test(__file__, CASES)


if __name__ == "__main__":
    from replayssm_patch.testing.interpreted import run_cases

    sys.exit(run_cases(CASES, set(sys.argv[1:])))
