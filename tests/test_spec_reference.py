"""The speculative-decoding reference (delayed commit + verify) against the plain recurrence.

Ground truth: per request, a float64 state advanced token by token with the sequential GDN
step (`recurrent_decode_reference`) over the tokens that were accepted. Every verify output
must equal the sequential output with the row's earlier tokens of the window accepted, and
after the next step's delayed commit the ring must replay to the truth state.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_patch.ops.commit_reference import ring_commit_pending_reference
from replayssm_patch.ops.gdn_reference import recurrent_decode_reference
from replayssm_patch.ops.ring_state_reference import replayed_state
from replayssm_patch.ops.verify_reference import ring_spec_verify_reference

F64 = torch.float64


@pytest.mark.parametrize("L,T,group,seed", [(8, 3, 2, 0), (32, 7, 1, 1), (4, 1, 4, 2), (16, 7, 2, 3)])
def test_spec_steps_match_sequential_recurrence(L, T, group, seed):
    gen = torch.Generator().manual_seed(seed)
    H, K, V = 2, 16, 16
    HV = H * group
    W = T + 1
    slots = 7
    idx = torch.tensor([2, 0, 5, 1, -1, 6], dtype=torch.int32)
    N = idx.numel()
    state = torch.randn(slots, HV, V, K, generator=gen, dtype=F64) * 0.2
    truth = state.clone()
    rd = torch.full((slots, HV, L, V), float("nan"), dtype=F64)
    rk = torch.full((slots, H, L, K), float("nan"), dtype=F64)
    rg = torch.full((slots, HV, L), float("nan"), dtype=F64)
    cursor = torch.zeros(slots, dtype=torch.int32)
    pending = torch.zeros(slots, dtype=torch.int32)
    A_log = torch.randn(HV, generator=gen, dtype=F64) * 0.5
    dt_bias = torch.randn(HV, generator=gen, dtype=F64) * 0.5
    windows = {}  # slot -> list of truth states after each token of its pending window
    last_T = torch.zeros(N, dtype=torch.long)
    flushed = 0
    seen = set()
    for step in range(14):
        Ts = torch.randint(1, W + 1, (N,), generator=gen)
        Ts[torch.rand(N, generator=gen) < 0.1] = 0
        acc = torch.where(last_T > 0, (torch.rand(N, generator=gen) * (last_T + 1)).long(), 1)
        acc = torch.where(torch.rand(N, generator=gen) < 0.3, last_T.clamp(min=1), acc).to(torch.int32)
        # the truth: commit the previous windows
        for i in range(N):
            s = int(idx[i])
            if s > 0 and s in windows:
                a = min(int(acc[i]), len(windows[s]))
                seen.add(a)
                if a:
                    truth[s] = windows[s][a - 1]
                del windows[s]
        cu = torch.zeros(N + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(Ts, 0)
        ntok = int(cu[-1])
        qkv = torch.randn(ntok, 2 * H * K + HV * V, generator=gen, dtype=F64)
        a_in = torch.randn(ntok, HV, generator=gen, dtype=F64)
        b_in = torch.randn(ntok, HV, generator=gen, dtype=F64)
        out = torch.full((ntok, HV, V), float("nan"), dtype=F64)
        before = cursor.clone()
        ring_spec_verify_reference(qkv, a_in, b_in, A_log, dt_bias, K ** -0.5, state, out, idx, cu,
                                   rd, rk, rg, cursor, pending, acc)
        for i in range(N):
            s, lo, hi = int(idx[i]), int(cu[i]), int(cu[i + 1])
            if s <= 0:
                assert (out[lo:hi] == 0).all()
                continue
            if hi == lo:
                continue
            h = truth[s:s + 1].clone()
            states = []
            for t in range(lo, hi):
                o = torch.zeros(1, HV, V, dtype=F64)
                # slot 0 is a NULL row for recurrent_decode_reference: a 2-slot scratch state
                scratch = torch.cat([torch.zeros_like(h), h])
                recurrent_decode_reference(qkv[t:t + 1], a_in[t:t + 1], b_in[t:t + 1], A_log, dt_bias,
                                           K ** -0.5, scratch, o, torch.tensor([1]))
                h = scratch[1:2]
                states.append(h[0].clone())
                err = float((out[t] - o[0]).norm() / o[0].norm())
                assert err < 1e-10, f"step {step} row {i} token {t - lo}: rel err {err}"
            windows[s] = states
            assert int(pending[s]) == hi - lo
            if int(cursor[s]) == 0 and int(before[s]) > 0:
                flushed += 1
        # the committed part replays to the truth (the window is not part of it yet)
        live = idx[idx > 0].long()
        S, _ = replayed_state(state, rd, rk, rg, live, cursor[live].long(), F64)
        err = float((S - truth[live]).norm() / truth[live].norm())
        assert err < 1e-10, f"step {step}: committed state rel err {err}"
        last_T = Ts.clone()
    # a final commit, then the replayed state equals the truth
    acc = torch.where(last_T > 0, last_T, 1).to(torch.int32)
    for i in range(N):
        s = int(idx[i])
        if s > 0 and s in windows:
            truth[s] = windows[s][min(int(acc[i]), len(windows[s])) - 1]
    ring_commit_pending_reference(cursor, pending, idx, acc, L)
    live = idx[idx > 0].long()
    S, _ = replayed_state(state, rd, rk, rg, live, cursor[live].long(), F64)
    assert float((S - truth[live]).norm() / truth[live].norm()) < 1e-10
    assert (pending[live] == 0).all()
    assert flushed > 0 or L >= 32, "no flush happened"
    assert seen >= set(range(0, W + 1)) or L >= 32, f"accepted counts seen {sorted(seen)}"


def test_commit_without_window_commits_nothing():
    cursor = torch.tensor([0, 3, 2, 5], dtype=torch.int32)
    pending = torch.tensor([0, 0, 4, 2], dtype=torch.int32)
    idx = torch.tensor([1, 2, 3, 0], dtype=torch.int32)
    ring_commit_pending_reference(cursor, pending, idx, torch.tensor([1, 9, 2, 1], dtype=torch.int32), L=6)
    # slot 1: no window; slot 2: min(9, 4) = 4 -> 6 (<= L); slot 3: min(2, 2) -> 7 clamped to 6
    assert cursor.tolist() == [0, 3, 6, 6]
    assert pending.tolist() == [0, 0, 0, 0]
