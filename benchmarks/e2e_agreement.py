"""Patched vs native greedy agreement in real vLLM on a GPU (issue: vLLM integration).

A small random-weight Qwen3.5 model, runner V2 (vLLM's default), CUDA graphs on
(FULL_AND_PIECEWISE, vLLM's default for hybrid models), prefix caching on (align), 32
requests x 256 tokens, SSM state fp32 and bf16. Each arm runs in its own process
(replayssm_patch.testing.engine_runner); the result JSON holds both arms' tokens, the
agreement by the project's criterion and a native-vs-native control (another batch size).

    python benchmarks/e2e_agreement.py --out results.json [--tokens 256] [--requests 32]

Needs a CUDA GPU and vLLM (>= 0.29, < 0.34). With the offline bundle, vLLM runs with
attention_backend=TRITON_ATTN, gdn_prefill_backend=triton, VLLM_USE_FLASHINFER_SAMPLER=0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile

from replayssm_patch.testing.agreement import compare
from replayssm_patch.testing.tiny_models import build_tiny_model


def run_arm(spec: dict, workdir: str, name: str, env: dict) -> dict:
    path = os.path.join(workdir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, "-m", "replayssm_patch.testing.engine_runner", path],
                          env=env, capture_output=True, text=True)
    with open(os.path.join(workdir, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1]
    return json.loads(line[len("RESULT_JSON "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--ring-len", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--states", default="float32,bfloat16", help="SSM state dtypes to run")
    ap.add_argument("--no-control", action="store_true", help="skip the native-vs-native control engine")
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="replayssm-e2e-")
    model = str(build_tiny_model(os.path.join(workdir, "models"), "qwen3_5"))
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    prompts = []
    for i in range(args.requests):  # a quarter share a long prefix: prefix-cache hits
        if i % 4 == 0:
            prompts.append(shared[: 200 + rng.randrange(100)])
        else:
            prompts.append([rng.randrange(3, 1000) for _ in range(rng.randrange(8, 300))])
    base = dict(load_format="safetensors", dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True,
                max_num_seqs=args.requests, seed=0, enable_prefix_caching=True, gpu_memory_utilization=0.5,
                attention_backend="TRITON_ATTN", gdn_prefill_backend="triton", disable_log_stats=False)
    engines = []
    states = args.states.split(",")
    for state in states:
        eng = dict(base, mamba_ssm_cache_dtype=state)
        engines.append({"name": state, "scenario": "staggered", "engine": eng, "prompts": prompts,
                        "max_tokens": [args.tokens] * len(prompts)})
    controls = [] if args.no_control else [dict(engines[0], name="control", engine=dict(engines[0]["engine"], max_num_seqs=8))]
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    spec = {"model": model, "ring_len": args.ring_len}
    native = run_arm(dict(spec, patched=False, engines=engines + controls), workdir, "native", env)
    patched = run_arm(dict(spec, patched=True, engines=engines), workdir, "patched", env)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "requests": args.requests, "tokens": args.tokens,
              "status": patched.get("_status"), "arms": {}}
    try:
        import torch
        import vllm

        result["gpu"] = torch.cuda.get_device_name(0)
        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    except Exception as e:  # reported, not hidden
        result["versions"] = {"error": repr(e)}
    for state in states:
        ag = compare(native[state]["requests"], patched[state]["requests"])
        entry = {"patched_vs_native": ag.summary(), "identical_fraction": ag.identical_fraction,
                 "criterion_met": ag.ok(), "failures": ag.failures,
                 "layers_patched": patched[state].get("layers"), "layers_native": native[state].get("layers")}
        if controls and state == states[0]:
            c = compare(native[state]["requests"], native["control"]["requests"])
            entry["native_vs_native_control"] = c.summary()
        result["arms"][state] = entry
        print(f"[{state} state] patched vs native: {ag.summary()}", flush=True)
    if controls:
        print(f"[control] native (max_num_seqs={args.requests}) vs native (max_num_seqs=8): "
              f"{result['arms'][states[0]]['native_vs_native_control']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
