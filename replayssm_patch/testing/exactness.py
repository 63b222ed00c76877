"""Exactness of the patched engine against native vLLM, measured by teacher forcing.

`compare_arms` runs, each arm in its own process (engine_runner) and every model of a set:

* native at the given batch size, greedy: the reference; its tokens are the forced sequence
* native at batch 1 (max_num_seqs=1), forced: vLLM's own batch-size noise, the yardstick
* the ring at each ring length asked for (16: the default; 1: a flush every step, the step's
  arithmetic alone), forced

and, with `greedy=True`, the same arms decoding greedily (token identity by the agreement
criterion, `testing.agreement`). Every forced arm records its full next-token distribution at
every position (testing.teacher_forced); `deviation` compares two arms position by position.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .agreement import compare
from .engine_runner import run_arm


@dataclass
class ForcedDeviation:
    """How far `other`'s next-token distributions are from `ref`'s over the same forced tokens."""

    positions: int
    max_abs_dlogprob: float  # |delta logprob| of the forced token, largest
    mean_abs_dlogprob: float  # ... and mean over positions
    mean_kl: float  # KL(ref || other) over the whole vocabulary, mean over positions
    max_kl: float
    identical_positions: float  # fraction of positions whose logprob vectors are bit-identical
    median_first_difference: float  # per request: the first position whose vector differs

    def as_dict(self) -> dict:
        return asdict(self)


def deviation(ref: list[torch.Tensor], other: list[torch.Tensor], tokens: list[list[int]]) -> ForcedDeviation:
    """ref/other: per request [positions, vocab] logprobs from two arms forced to `tokens`."""
    if len(ref) != len(other) or len(ref) != len(tokens):
        raise ValueError(f"request counts differ: {len(ref)}, {len(other)}, {len(tokens)} tokens")
    dl, kl, same, first = [], [], 0, []
    for r, (a, b, t) in enumerate(zip(ref, other, tokens)):
        if a.shape != b.shape or a.shape[0] != len(t):
            raise ValueError(f"request {r}: shapes {tuple(a.shape)}, {tuple(b.shape)} for {len(t)} tokens")
        a, b = a.double(), b.double()
        idx = torch.tensor(t).unsqueeze(-1)
        dl += (a.gather(1, idx) - b.gather(1, idx)).abs().flatten().tolist()
        kl += (a.exp() * (a - b)).nan_to_num(0.0).sum(-1).tolist()  # 0 * -inf terms count as 0
        equal = (a == b).all(-1)
        same += int(equal.sum())
        diff = (~equal).nonzero().flatten()
        first.append(int(diff[0]) if diff.numel() else a.shape[0])
    n = len(dl)
    return ForcedDeviation(
        positions=n, max_abs_dlogprob=max(dl, default=0.0), mean_abs_dlogprob=sum(dl) / max(n, 1),
        mean_kl=sum(kl) / max(n, 1), max_kl=max(kl, default=0.0), identical_positions=same / max(n, 1),
        median_first_difference=statistics.median(first) if first else math.nan)


def compare_arms(models: dict[str, str], prompts: list[list[int]], tokens: int, engine: dict, workdir,
                 ring_lens=(16, 1), greedy: bool = False, extra_env=None) -> dict:
    """models: name -> checkpoint path. Returns per model {"forced": {arm: ForcedDeviation as a
    dict}, "greedy": {arm: agreement summary} (with `greedy`), "ring_counters": {arm: counters}}.
    `extra_env`: added to every arm's environment (engine_runner.run_arm)."""
    work = Path(workdir)

    def save(model, arm):
        return str(work / f"{model}-{arm}.pt".replace(" ", "_").replace("/", "_"))

    def eng(model, arm, forced=None, **kw):
        e = {"name": f"{model}/{arm}", "model": models[model], "engine": dict(engine, **kw), "prompts": prompts,
             "max_tokens": [tokens] * len(prompts)}
        if forced is not None:
            e["teacher_forced"] = dict(forced, save=save(model, arm))
        return e

    first = next(iter(models.values()))
    native = []
    for m in models:
        native += [eng(m, "native", {"tokens": None}),
                   eng(m, "native_b1", {"tokens_from": f"{m}/native"}, max_num_seqs=1)]
        if greedy:
            native.append(eng(m, "native_b1_greedy", max_num_seqs=1))
    res, _ = run_arm(work, "native", {"model": first, "patched": False, "engines": native}, extra_env=extra_env)
    forced_tokens = {m: [r["tokens"] for r in res[f"{m}/native"]["requests"]] for m in models}
    out = {m: {"forced": {}, "greedy": {}, "ring_counters": {}} for m in models}
    for m in models:
        if greedy:
            out[m]["greedy"]["native_b1"] = compare(res[f"{m}/native"]["requests"],
                                                    res[f"{m}/native_b1_greedy"]["requests"]).summary()
    for L in ring_lens:
        arm = f"ring{L}"
        engines = []
        for m in models:
            engines.append(eng(m, arm, {"tokens": forced_tokens[m]}))
            if greedy:
                engines.append(eng(m, f"{arm}_greedy"))
        ring, _ = run_arm(work, arm, {"model": first, "patched": True, "ring_len": L, "engines": engines},
                          extra_env=extra_env)
        bad = {k: v for k, v in ring["_status"]["layers"].items() if v != "ring"}
        if bad:
            raise AssertionError(f"layers not on the ring: {bad}")
        for m in models:
            out[m]["ring_counters"][arm] = ring[f"{m}/{arm}"]["ring_counters"]
            if greedy:
                out[m]["greedy"][arm] = compare(res[f"{m}/native"]["requests"],
                                                ring[f"{m}/{arm}_greedy"]["requests"]).summary()
    for m in models:
        ref = torch.load(save(m, "native"))
        for arm in ["native_b1"] + [f"ring{L}" for L in ring_lens]:
            out[m]["forced"][arm] = deviation(ref, torch.load(save(m, arm)), forced_tokens[m]).as_dict()
    return out
