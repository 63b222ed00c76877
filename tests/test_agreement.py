"""The agreement criteria of replayssm_patch.testing.agreement on synthetic tokens (no vLLM)."""

from __future__ import annotations

import pytest

from replayssm_patch.testing.agreement import compare_samples


def sample(tokens, logprobs=None):
    return list(tokens), list(logprobs if logprobs is not None else [-1.0] * len(tokens))


def test_identical_samples():
    nat = [sample([1, 2, 3], [-0.5, -1.0, -2.0]), sample([4, 5, 6])]
    pat = [sample([1, 2, 3], [-0.5, -1.004, -2.0]), sample([4, 5, 6])]
    a = compare_samples(nat, pat)
    assert (a.identical, a.acceptable, a.real, a.total) == (2, [], [], 2)
    assert a.max_drift_identical == pytest.approx(0.004)
    assert a.ok() and a.identical_fraction == 1.0


def test_divergence_after_agreeing_logprobs_is_acceptable():
    nat = [sample([1, 2, 3, 4], [-0.5, -1.0, -2.0, -3.0])]
    pat = [sample([1, 2, 9, 9], [-0.505, -1.008, -0.1, -0.1])]  # logprobs at and after the divergence do not count
    a = compare_samples(nat, pat)
    assert a.identical == 0 and a.real == []
    [(s, j, drift)] = a.acceptable
    assert (s, j) == (0, 2) and drift == pytest.approx(0.008)


def test_divergence_after_drifting_logprobs_is_real():
    nat = [sample([1, 2, 3], [-0.5, -1.0, -2.0])] * 10
    pat = [sample([1, 2, 3], [-0.5, -1.0, -2.0])] * 9 + [sample([1, 2, 7], [-0.5, -1.02, -2.0])]
    a = compare_samples(nat, pat)
    assert a.identical == 9 and a.acceptable == []
    [(s, j, drift)] = a.real
    assert (s, j) == (9, 2) and drift == pytest.approx(0.02)
    assert not a.ok()  # 90% identical, but one real divergence
    assert "1 real divergences" in a.summary()


def test_too_few_identical_fails_without_real_divergences():
    nat = [sample([1, 2, 3])] * 10
    pat = [sample([1, 2, 3])] * 8 + [sample([1, 5, 3])] * 2  # two acceptable divergences at token 1
    a = compare_samples(nat, pat)
    assert (a.identical, len(a.acceptable), a.real) == (8, 2, [])
    assert [j for _, j, _ in a.acceptable] == [1, 1]
    assert not a.ok() and a.ok(min_identical=0.8)


def test_divergence_at_first_token_and_at_a_stop():
    nat = [sample([5, 1]), sample([1, 2, 3], [-0.1, -0.2, -0.3])]
    pat = [sample([6, 1]), sample([1, 2], [-0.1, -0.3])]  # patched stopped one token early
    a = compare_samples(nat, pat)
    assert a.acceptable == [(0, 0, 0.0)]  # nothing before token 0 can drift
    [(s, j, drift)] = a.real
    assert (s, j) == (1, 2) and drift == pytest.approx(0.1)


def test_mismatched_inputs_raise():
    with pytest.raises(ValueError, match="sample count"):
        compare_samples([sample([1])], [])
    with pytest.raises(ValueError, match="token and logprob counts"):
        compare_samples([([1, 2], [-1.0])], [sample([1, 2])])


def greedy(tokens, logprobs, gaps):
    # one request as engine_runner prints it: top2 per token as [[tok, lp], [tok2, lp2]]
    return {"tokens": list(tokens), "logprobs": list(logprobs),
            "top2": [[[t, lp], [t + 1, lp - g]] for t, lp, g in zip(tokens, logprobs, gaps)]}


def test_greedy_drift_in_identical_requests_and_tie_rule():
    from replayssm_patch.testing.agreement import compare

    nat = [greedy([1, 2, 3], [-0.5, -1.0, -2.0], [1, 1, 1]), greedy([4, 5, 6], [-1, -1, -1], [1, 0.005, 1])]
    pat = [greedy([1, 2, 3], [-0.5, -1.03, -2.0], [1, 1, 1]), greedy([4, 9, 6], [-1.004, -1, -1], [1, 1, 1])]
    a = compare(nat, pat)
    assert (a.identical, a.near_tie, a.failures) == (1, 1, [])  # request 1: a tie (gap 0.005), drift 0.004
    assert a.max_drift_identical == pytest.approx(0.03)  # only identical requests count
    assert not a.ok()  # 1 of 2 identical < 90%
    late = [nat[0], greedy([4, 9, 6], [-1.02, -1, -1], [1, 1, 1])]  # same tie after a 0.02 drift: real
    b = compare(nat, late)
    assert b.near_tie == 0 and len(b.failures) == 1 and "gap 0.0050" in b.failures[0]
