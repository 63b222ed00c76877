"""The RL rollout example (sampling, in-place weight update, sampling again) on real vLLM, and
its driver's option checks (no vLLM needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replayssm_patch.testing import cache_dir

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "grpo_rollout.py")


@pytest.mark.slow
def test_sleep_level_needs_cuda(tmp_path):
    # The driver refuses sleep mode without CUDA before it builds a model or starts an arm
    # (so before vLLM is imported). CUDA_VISIBLE_DEVICES="" hides any GPU of this host.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, EXAMPLE, "--sleep-level", "1"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--sleep-level 1 needs a CUDA GPU" in p.stderr
    assert "RESULT_JSON" not in p.stdout and not (tmp_path / ".work").exists()


@pytest.mark.vllm
def test_grpo_rollout_native_vs_patched(tmp_path):
    if not os.environ.get("CI"):
        pytest.importorskip("vllm")
    # The plain checkpoint. The sampling criterion (no real divergence, >= 90% identical) is met
    # in both rounds since the CPU ring rounds as vLLM's CPU kernel does (measured 23/24 + one
    # acceptable divergence, then 24/24; before: 24/24 and 21/24). The decisive checkpoint, the
    # example's default, still misses it in round 0 (21/24 with one real divergence after a
    # one-bf16-step logprob drift of its sampled tokens; round 1 23/24 meets it).
    env = dict(os.environ, VLLM_GDN_REPLAYSSM_SHADOW="1")
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    p = subprocess.run([sys.executable, EXAMPLE, "--checkpoint", "plain", "--models-dir",
                        str(cache_dir() / "tiny-models"), "--rounds", "2",
                        "--prompts", "3", "--samples", "8", "--tokens", "32", "--min-batch", "1"],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    print("\n".join(ln for ln in p.stdout.splitlines() if ln.startswith(("round", "  ", "served"))))
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("SUMMARY_JSON ")][-1][13:])
    nat, pat = res["native"], res["patched"]
    assert res["checkpoint"] == "plain"
    assert res["options"]["sleep_level"] == 0 and not res["options"]["poison"]
    assert [r["round"] for r in res["rounds"]] == [0, 1]
    # the per-round verdict is complete and consistent with its parts
    for r in res["rounds"]:
        assert r["identical"] + len(r["acceptable"]) + len(r["real"]) == r["samples"] == 24
        assert r["criterion_met"] == (not r["real"] and r["identical"] >= 0.9 * 24)
        assert all(d["max_drift"] <= 0.01 for d in r["acceptable"]) and all(d["max_drift"] > 0.01 for d in r["real"])
    assert res["criterion_met"] == all(r["criterion_met"] for r in res["rounds"])
    assert res["criterion_met"], [(r["round"], r["identical"], r["real"]) for r in res["rounds"]]
    # the update reached both engines, identically
    assert nat["weight_checksums"][0] != nat["weight_checksums"][1]
    assert nat["weight_checksums"] == pat["weight_checksums"]
    # every round: n samples per prompt of full length; the first round's samples start alike
    for rnd_n, rnd_p in zip(nat["rounds"], pat["rounds"]):
        for rnd in (rnd_n, rnd_p):
            assert [len(s["tokens"]) for ps in rnd for s in ps] == [32] * 24
        assert all(a["tokens"][:4] == b["tokens"][:4] for pa, pb in zip(rnd_n, rnd_p) for a, b in zip(pa, pb))
    c = pat["counters"]
    # the ring served both rounds; prefills reset it, and the shadow check (vLLM's kernel on
    # exact states) saw no stale ring entry replayed into a new request
    assert c["decode_calls"] > 0 and c["reset_calls"] >= 2
    assert c["shadow_checks"] == c["decode_calls"] and c["shadow_max_rel_err_x1e6"] < 2e4
