"""The agreement criterion between a native and a patched greedy run.

Greedy tokens must be identical, except that a request may diverge at a near tie: at the
first differing position the native top-2 logprob gap is below `tie_gap`, and every chosen
token's logprob before it agrees within `logprob_tol`. At least `min_identical` of the
requests must be fully identical (random-weight models have near ties, and the ring sums
fp32 terms in a different order).

`compare_samples` is the analogue for seeded sampling (no top-2 gap: a sample may diverge at
any token as long as every earlier sampled token's logprob agrees within `logprob_tol`).
"""

from __future__ import annotations

from dataclasses import dataclass


def _drift(native_logprobs, patched_logprobs) -> float:
    """Largest |native - patched| over paired logprobs (0 for none): the drift of two arms."""
    return max((abs(a - b) for a, b in zip(native_logprobs, patched_logprobs)), default=0.0)


@dataclass
class Agreement:
    identical: int
    near_tie: int
    failures: list[str]
    total: int
    # every divergence: (request, first differing token, native top-2 gap there, max drift before)
    divergences: list[tuple[int, int, float, float]]
    # largest chosen-token logprob difference anywhere in a fully identical request: how far
    # the arms' numbers drift without changing a token (one bf16 step of a logit is 0.0156-0.031)
    max_drift_identical: float = 0.0

    @property
    def identical_fraction(self) -> float:
        return self.identical / max(self.total, 1)

    def ok(self, min_identical: float = 0.9) -> bool:
        return not self.failures and self.identical_fraction >= min_identical

    def summary(self) -> str:
        return (f"{self.identical}/{self.total} identical, {self.near_tie} diverged at a near tie, "
                f"{len(self.failures)} real divergences")


def compare(native: list[dict], patched: list[dict], tie_gap: float = 0.01, logprob_tol: float = 0.01) -> Agreement:
    """native/patched: per request {"tokens", "logprobs", "top2"} as engine_runner prints them."""
    if len(native) != len(patched):
        return Agreement(0, 0, [f"request count {len(native)} vs {len(patched)}"], len(native), [])
    identical, near, failures, divergences, drift_same = 0, 0, [], [], 0.0
    for r, (n, p) in enumerate(zip(native, patched)):
        if n["tokens"] == p["tokens"]:
            identical += 1
            drift_same = max(drift_same, _drift(n["logprobs"], p["logprobs"]))
            continue
        if len(n["tokens"]) != len(p["tokens"]):
            failures.append(f"request {r}: {len(n['tokens'])} vs {len(p['tokens'])} tokens")
            continue
        i = next(j for j, (a, b) in enumerate(zip(n["tokens"], p["tokens"])) if a != b)
        drift = _drift(n["logprobs"][:i], p["logprobs"][:i])
        top = n["top2"][i]
        gap = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
        divergences.append((r, i, gap, drift))
        if gap < tie_gap and drift <= logprob_tol:
            near += 1
        else:
            failures.append(f"request {r}: diverges at token {i} (native top-2 gap {gap:.4f}, "
                            f"max logprob drift before it {drift:.4f})")
    return Agreement(identical, near, failures, len(native), divergences, drift_same)


@dataclass
class SampleAgreement:
    """The sampling analogue of `Agreement`, for seeded samples drawn by both arms.

    A sample (a native and a patched completion drawn with the same seed) is identical; or it
    diverges at token j while every earlier sampled token's logprob agrees between the arms
    within `logprob_tol` (an acceptable divergence: the seeded draw fell within the tiny
    difference between two nearly equal distributions); otherwise the divergence is real.
    Divergences are (sample, first differing token, max logprob drift before it).
    """

    identical: int
    acceptable: list[tuple[int, int, float]]
    real: list[tuple[int, int, float]]
    total: int
    max_drift_identical: float  # largest logprob difference anywhere in an identical sample

    @property
    def identical_fraction(self) -> float:
        return self.identical / max(self.total, 1)

    def ok(self, min_identical: float = 0.9) -> bool:
        return not self.real and self.identical_fraction >= min_identical

    def summary(self) -> str:
        return (f"{self.identical}/{self.total} identical, {len(self.acceptable)} acceptable divergences, "
                f"{len(self.real)} real divergences")


def compare_samples(native: list[tuple[list[int], list[float]]], patched: list[tuple[list[int], list[float]]],
                    logprob_tol: float = 0.01) -> SampleAgreement:
    """native/patched: per sample (sampled token ids, each sampled token's logprob), paired by seed.

    A sample whose arms stop at different lengths with one a prefix of the other diverges at the
    shorter length (one arm drew a stop token there)."""
    if len(native) != len(patched):
        raise ValueError(f"sample count {len(native)} vs {len(patched)}")
    identical, acceptable, real, max_same = 0, [], [], 0.0
    for s, ((nt, nl), (pt, pl)) in enumerate(zip(native, patched)):
        if len(nt) != len(nl) or len(pt) != len(pl):
            raise ValueError(f"sample {s}: token and logprob counts differ")
        if nt == pt:
            identical += 1
            max_same = max(max_same, _drift(nl, pl))
            continue
        j = next((i for i, (a, b) in enumerate(zip(nt, pt)) if a != b), min(len(nt), len(pt)))
        drift = _drift(nl[:j], pl[:j])
        (acceptable if drift <= logprob_tol else real).append((s, j, drift))
    return SampleAgreement(identical, acceptable, real, len(native), max_same)
