"""End-to-end decode throughput of real vLLM, native vs patched, on a GPU.

A Qwen3.5-shaped dense model (`--shape 9b`: hidden 4096, 32 layers of which 24 GDN with 16 key
/ 32 value heads of 128; `--shape 4b`: hidden 2560, intermediate 9216, the same 24 GDN layers,
attention 16 query / 4 KV heads of 256, where GDN's share of the step is larger; dummy
weights, config written locally), fixed prompt and output lengths, `ignore_eos`. Each arm
(native, patched) runs in its own process and measures every batch size in one engine. Per
batch size it times a generate() with 1 output token and one with `--out-len` tokens; the
difference is the decode time of `out_len - 1` steps, so prefill and time to first token are
excluded.

    python benchmarks/e2e_decode.py --out e2e.json [--batches 1,16,64,128,256,512] [--order ABBAAB]
        [--shape 9b|4b] [--tp N] [--gdn-heads HK,HV] [--mtp T] [--profile-batches 64,256]
    python benchmarks/e2e_decode.py --merge a.json b.json --out e2e.json --plot e2e.png   # no GPU

The same arm varies by up to 22% between runs, so one pair decides nothing: `--order` runs the
arms interleaved, and consecutive runs form pairs (AB, BA, ...); each pair gives one
patched/native ratio per batch size, and the summary reports their median with min and max
(`--order ABBAAB`, the default: 3 pairs).

`--tp N` runs both arms with tensor_parallel_size=N, `--gdn-heads` changes the GDN head counts
(16,48 for the TP=2 run of issue 7), `--mtp T` adds one MTP layer and MTP speculative decoding
with T drafts to both arms (the patched arm opts in with patch(allow_mtp_cuda=True), as MTP
on CUDA stays native by default; prefix caching off in both; with dummy weights drafts are rarely
accepted, so this measures the per-step cost of verifying 1+T tokens; vLLM's acceptance
counters are recorded per arm). `--mtp-kernel flashinfer` gives the patched arm FlashInfer's
verify kernel (patch(mtp_kernel=...): the option is patch()'s argument here, so the environment
variable does not reach the arm); the run stops if the patched engine's log does not name it.

`--profile-batches B,...` adds, after each listed batch's timings, a torch-profiler trace of 8
decode steps of that batch in each run (vLLM's `profiler_config`, steps 9-16 of a 32-token
generate, so past the prefill) and reports per run the GPU time per kernel name, the GPU-busy
time and the span of those steps: where a patched step's extra time goes (kernels, or idle GPU
waiting on the host). The table gives both per step beside the wall time.

The Amdahl bound per batch size is computed from the native step time and, when given
(`--kernel-json`), the kernel benchmark's native and ring times for the same shape and state
dtype: bound = step / (step - layers * (t_native_kernel - t_ring_kernel)).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import glob
import gzip
import subprocess
import sys
import tempfile
import time

CONFIG_9B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
CONFIG_4B = dict(CONFIG_9B, hidden_size=2560, intermediate_size=9216)  # 16 q / 4 KV heads of 256 as 9B
SHAPES = {"9b": CONFIG_9B, "4b": CONFIG_4B}
GDN_LAYERS = 24


def model_config(args) -> dict:
    """CONFIG_9B with the GDN head counts of --gdn-heads."""
    try:
        hk, hv = (int(x) for x in args.gdn_heads.split(","))
        assert 0 < hk and hv % hk == 0 and hk % args.tp == 0
    except (ValueError, AssertionError):
        raise SystemExit(f"--gdn-heads: HK,HV with HV a multiple of HK and HK a multiple of --tp "
                         f"(got {args.gdn_heads!r}, --tp {args.tp})")
    cfg = dict(SHAPES[args.shape], linear_num_key_heads=hk, linear_num_value_heads=hv)
    if args.mtp:  # one MTP layer (dummy weights: drafts are rarely accepted, each step costs 1+T tokens)
        cfg["mtp_num_hidden_layers"] = 1
    return cfg


def arm(args) -> None:
    """One arm in this process: print RESULT_JSON with per-batch timings."""
    if args.patched:
        import replayssm_patch

        # MTP on CUDA goes through the ring only when opted in; patch() also sets
        # VLLM_GDN_REPLAYSSM_MTP_CUDA=1 for the engine's processes
        report = replayssm_patch.patch(ring_len=args.ring_len, strict=True, ring_dtype=args.ring_dtype,
                                       allow_mtp_cuda=bool(args.mtp), min_batch=args.min_batch, mtp_kernel=args.mtp_kernel,
                                       allow_16bit_state=args.state_dtype in ("bfloat16", "float16"))
        assert report["applied"], report
    from vllm import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    spec = {}
    if args.mtp:  # the ring plan serves MTP without prefix caching only: both arms run without it
        spec = dict(speculative_config={"method": "mtp", "num_speculative_tokens": args.mtp})
    prof = {}
    profiled = {int(b) for b in args.profile_batches.split(",") if b}
    if profiled:  # traces land in profile_dir (absolute), one file per worker
        prof = dict(profiler_config={"profiler": "torch", "torch_profiler_dir": os.path.abspath(args.profile_dir),
                                     "torch_profiler_with_stack": False, "ignore_frontend": True})
    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.in_len + args.out_len + 8,
              max_num_seqs=max(batches), seed=0, skip_tokenizer_init=True, enable_prefix_caching=not args.mtp,
              disable_log_stats=not args.mtp, **spec,
              mamba_ssm_cache_dtype=args.state_dtype, gpu_memory_utilization=0.85,
              attention_backend="TRITON_ATTN", gdn_prefill_backend="triton",
              compilation_config={"cudagraph_mode": args.cudagraph_mode, "mode": args.compile_mode},
              tensor_parallel_size=args.tp, **prof)
    start_s = time.perf_counter() - t0
    res = {"engine_start_s": start_s, "batches": {}}
    for b in batches:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 150000 + 3 for j in range(args.in_len)]} for i in range(b)]

        def timed(n):
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            torch_sync()
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            torch_sync()
            assert all(len(o.outputs[0].token_ids) == n for o in outs)
            return time.perf_counter() - t

        timed(4)  # warm this batch size (prefix cache: later prompts hit the cache equally in both arms)
        t1 = min(timed(1) for _ in range(2))
        tn = min(timed(args.out_len) for _ in range(args.repeats))
        decode = tn - t1
        steps = args.out_len - 1
        res["batches"][b] = {"t_first_token_s": t1, "t_total_s": tn, "decode_s": decode,
                             "step_ms": 1e3 * decode / steps,
                             "per_request_tok_s": steps / decode, "aggregate_tok_s": b * steps / decode}
        print(f"[{'patched' if args.patched else 'native'}] batch {b}: step {1e3 * decode / steps:.3f} ms, "
              f"{b * steps / decode:.0f} tok/s aggregate", flush=True)
        if b in profiled:
            res["batches"][b]["profile"] = profile_steps(llm, prompts, args.profile_dir)
    if args.mtp:  # vLLM's speculative-decoding counters over the whole arm (all batch sizes)
        from replayssm_patch.testing.engine_runner import spec_decode_metrics

        res["spec_decode"] = spec_decode_metrics(llm)
    print("RESULT_JSON " + json.dumps(res), flush=True)


# engine steps skipped after the prefill chunks, then traced: 16 steps are one whole ring cycle
# (the requests of a batch start together, so their cursors move in step and flush together)
PROFILE_SKIP, PROFILE_STEPS = 8, 16


def profile_steps(llm, prompts, profile_dir) -> dict:
    """Trace PROFILE_STEPS decode steps of a generate over `prompts`; summarise the trace."""
    from vllm import SamplingParams

    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    skip = PROFILE_SKIP + -(-sum(len(p["prompt_token_ids"]) for p in prompts) // chunk)  # + the prefill steps
    before = set(glob.glob(os.path.join(profile_dir, "**", "*.json*"), recursive=True))
    llm.start_profile(delay_iterations=skip, max_iterations=PROFILE_STEPS)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=skip + PROFILE_STEPS + 16,
                                         ignore_eos=True, detokenize=False), use_tqdm=False)
    llm.stop_profile()
    deadline = time.time() + 120  # the worker writes the trace after stop; wait for it
    while time.time() < deadline:
        new = sorted(set(glob.glob(os.path.join(profile_dir, "**", "*.json*"), recursive=True)) - before)
        if new and all(time.time() - os.path.getmtime(f) > 3 for f in new):
            break
        time.sleep(2)
    else:
        return {"error": f"no trace file appeared in {profile_dir}"}
    return dict(summarize_trace(new[0]), trace_file=new[0], steps=PROFILE_STEPS)


def summarize_trace(path, top=30) -> dict:
    """GPU time per kernel name (us), GPU-busy time (union of GPU intervals) and the span from
    the first to the last GPU event, from a Chrome trace written by torch.profiler."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    per_name = {}
    for e in gpu:
        per_name[e["name"]] = per_name.get(e["name"], 0.0) + float(e.get("dur", 0))
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s0, e0 in spans[1:]:  # union of intervals (streams overlap)
        if s0 > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    busy += cur_e - cur_s
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])
    return {"gpu_span_us": spans[-1][1] - spans[0][0], "gpu_busy_us": busy, "gpu_kernel_sum_us": sum(per_name.values()),
            "kernels": len(gpu), "top_kernels_us": {k[:160]: round(v, 1) for k, v in ranked[:top]}}


def torch_sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_times(path, shape_key, state):
    """{batch: (native_us, ours_us)} from the kernel benchmark JSON, if it has the shape."""
    if not path or not os.path.exists(path):
        return {}
    data = json.load(open(path))
    out = {}
    for row in data.get("rows", []):
        if row.get("shape") == shape_key and row.get("state_dtype") == state:
            out[int(row["batch"])] = (row["native_us"], row["ours_us"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,16,64,128,256,512")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ring-len", type=int, default=16)
    ap.add_argument("--state-dtype", default="float32")
    ap.add_argument("--order", default="ABBAAB",
                    help="arm order, A = native, B = patched; consecutive runs pair up (AB, BA, ...)")
    ap.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    ap.add_argument("--compile-mode", type=int, default=3, help="vLLM CompilationMode (3 = VLLM_COMPILE, 0 = none)")
    ap.add_argument("--kernel-json", default=None)
    ap.add_argument("--kernel-shape", default="qwen3-next", help="kernel benchmark shape with H=16, HV=32")
    ap.add_argument("--ring-dtype", default="auto")
    ap.add_argument("--min-batch", default="auto",
                    help="patched arm's min_batch: 'auto' (the dispatch table) or N (the ring from batch N; 1: always)")
    ap.add_argument("--workdir", default=None, help="where the arms' logs (and profiles) go (default: a new temp dir)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (multiprocessing executor for > 1)")
    ap.add_argument("--gdn-heads", default="16,32", metavar="HK,HV",
                    help="GDN key and value heads (default 16,32: Qwen3.5-9B; 16,48 for issue 7's TP=2 shape)")
    ap.add_argument("--mtp", type=int, default=0, metavar="T",
                    help="MTP speculative decoding with T drafts (0: off); adds one MTP layer to the config, "
                         "prefix caching off in both arms; step_ms is then the time per output token")
    ap.add_argument("--mtp-kernel", choices=["triton", "flashinfer"], default="triton",
                    help="with --mtp: the patched arm's verify kernel (patch(mtp_kernel=...)); the run stops if "
                         "the patched engine's log does not name it")
    ap.add_argument("--profile-batches", default="", metavar="B,...",
                    help="also trace 8 decode steps of these batches (among --batches) per run with the torch profiler")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="write a plot of patched/native against batch size (needs matplotlib)")
    ap.add_argument("--profile-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--arm", choices=["native", "patched"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                    help="no GPU: join the runs of these result files into --out")
    args = ap.parse_args()
    if not set(filter(None, args.profile_batches.split(","))) <= set(args.batches.split(",")):
        raise SystemExit(f"--profile-batches must be among --batches ({args.batches}), got {args.profile_batches}")
    if args.merge:
        return merge(args)
    if args.arm:
        args.patched = args.arm == "patched"
        return arm(args)

    workdir = args.workdir or tempfile.mkdtemp(prefix="replayssm-e2e-")
    os.makedirs(workdir, exist_ok=True)
    model = os.path.join(workdir, "qwen35-9b-shape")
    os.makedirs(model)
    json.dump(model_config(args), open(os.path.join(model, "config.json"), "w"), indent=1)
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    runs = []
    for a in args.order:
        name = "native" if a == "A" else "patched"
        cmd = [sys.executable, __file__, "--arm", name, "--model", model, "--batches", args.batches,
               "--in-len", str(args.in_len), "--out-len", str(args.out_len), "--repeats", str(args.repeats),
               "--ring-len", str(args.ring_len), "--state-dtype", args.state_dtype, "--ring-dtype", args.ring_dtype,
               "--cudagraph-mode", args.cudagraph_mode, "--compile-mode", str(args.compile_mode),
               "--tp", str(args.tp), "--gdn-heads", args.gdn_heads, "--mtp", str(args.mtp), "--mtp-kernel", args.mtp_kernel,
               "--profile-batches", args.profile_batches, "--shape", args.shape, "--min-batch", args.min_batch,
               "--profile-dir", os.path.join(workdir, f"profile_{len(runs)}_{name}")]
        print(f"== arm {name}", flush=True)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log = p.stdout + p.stderr
        open(os.path.join(workdir, f"{len(runs)}_{name}.log"), "w").write(log)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{log[-6000:]}")
        if name == "patched":
            check_patched_log(log, args)
        print("\n".join(ln for ln in p.stdout.splitlines() if ln.startswith("[")), flush=True)
        res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1][12:])
        # vLLM's own cache report (KV cache size in tokens, maximum concurrency) and our ring size
        res["engine_cache_log"] = [ln.strip()[-220:] for ln in log.splitlines()
                                   if "Maximum concurrency" in ln or "KV cache size" in ln
                                   or "decode through the ring" in ln or "verify kernel:" in ln][:6]
        runs.append({"arm": name, **res})
        if args.out:  # the runs so far, in the form --merge reads: a cut-off session keeps its pairs
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": " ".join(sys.argv), "config": {k: v for k, v in vars(args).items()
                                                                 if k not in ("arm", "model")}, "runs": runs},
                      open(args.out + ".partial", "w"), indent=1)
    finish(args, runs)


def check_patched_log(log: str, args) -> None:
    """Stop unless the patched engine's log shows the ring (and with --mtp, the verify kernel
    asked for): strict mode does not raise for a config that is native by default (an opt-in
    off), and an unmet kernel option falls back with a log line, not an error."""
    if "decode through the ring" not in log:
        raise SystemExit(f"patched arm: no 'decode through the ring' line (GDN layers native, "
                         f"or VLLM_LOGGING_LEVEL above INFO):\n{log[-6000:]}")
    if args.mtp and f"verify kernel: {args.mtp_kernel}" not in log:
        raise SystemExit(f"patched arm: no 'verify kernel: {args.mtp_kernel}' line (--mtp-kernel not "
                         f"served):\n{log[-6000:]}")


def pairs_of(runs) -> list[tuple[dict, dict]]:
    """(native, patched) per consecutive pair of runs: AB, BA, ... in the order they ran."""
    if len(runs) % 2:
        raise SystemExit(f"{len(runs)} runs: the arms must pair up (--order AB, ABBA, ABBAAB, ...)")
    out = []
    for a, b in zip(runs[0::2], runs[1::2]):
        if {a["arm"], b["arm"]} != {"native", "patched"}:
            raise SystemExit("--order must pair a native with a patched run (AB or BA), pair after pair")
        out.append((a, b) if a["arm"] == "native" else (b, a))
    return out


def _per_step(profile, steps):
    if not profile or "gpu_busy_us" not in profile:
        return None
    return {"gpu_busy_ms": profile["gpu_busy_us"] / 1e3 / steps, "span_ms": profile["gpu_span_us"] / 1e3 / steps}


def config_name(args) -> str:
    if args.compile_mode == 3 and args.cudagraph_mode == "FULL_AND_PIECEWISE":
        return "default"  # what vLLM gives a user: torch.compile + FULL_AND_PIECEWISE graphs
    if args.compile_mode == 0 and args.cudagraph_mode == "FULL_DECODE_ONLY":
        return "full_decode_only_no_compile"
    return f"compile{args.compile_mode}_{args.cudagraph_mode}"


def finish(args, runs):
    """Per batch: the ratio of each native/patched pair, their median, min and max, the Amdahl
    bound, the profiler's GPU-busy and span per step beside the wall time; the summary; JSON."""
    import statistics

    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(args.state_dtype, args.state_dtype)
    kt = kernel_times(args.kernel_json, args.kernel_shape, short)
    pairs = pairs_of(runs)
    table = {}
    for b in [int(x) for x in args.batches.split(",")]:
        key = str(b)
        ratios = [p["batches"][key]["aggregate_tok_s"] / n["batches"][key]["aggregate_tok_s"] for n, p in pairs]
        step_n = statistics.median(n["batches"][key]["step_ms"] for n, _ in pairs)
        step_p = statistics.median(p["batches"][key]["step_ms"] for _, p in pairs)
        speedup = statistics.median(ratios)
        row = {"pair_speedups": [round(r, 4) for r in ratios], "speedup": speedup, "speedup_min": min(ratios),
               "speedup_max": max(ratios), "native_step_ms": step_n, "patched_step_ms": step_p,
               "native_aggregate_tok_s": statistics.median(n["batches"][key]["aggregate_tok_s"] for n, _ in pairs),
               "patched_aggregate_tok_s": statistics.median(p["batches"][key]["aggregate_tok_s"] for _, p in pairs)}
        steps = PROFILE_STEPS
        prof = [(_per_step(n["batches"][key].get("profile"), steps), _per_step(p["batches"][key].get("profile"), steps))
                for n, p in pairs]
        prof = [(x, y) for x, y in prof if x and y]
        if prof:  # GPU idle inside the step: span - busy; the target is idle_p <= idle_n + 2% of native's step
            n_busy, n_span = statistics.median(x["gpu_busy_ms"] for x, _ in prof), statistics.median(x["span_ms"] for x, _ in prof)
            p_busy, p_span = statistics.median(y["gpu_busy_ms"] for _, y in prof), statistics.median(y["span_ms"] for _, y in prof)
            row.update(native_gpu_busy_ms=n_busy, native_span_ms=n_span, patched_gpu_busy_ms=p_busy, patched_span_ms=p_span,
                       idle_excess_of_native_step=((p_span - p_busy) - (n_span - n_busy)) / n_span)
        if b in kt:
            kn, ko = kt[b]
            bound = step_n / (step_n - GDN_LAYERS * (kn - ko) / 1e3)
            row.update(kernel_native_us=kn, kernel_ours_us=ko, gdn_share_of_native_step=GDN_LAYERS * kn / 1e3 / step_n,
                       amdahl_bound=bound, fraction_of_bound=speedup / bound)
        table[b] = row
        print(f"batch {b}: patched/native x{speedup:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, "
              f"{len(ratios)} pairs)" + (f", Amdahl bound x{row['amdahl_bound']:.3f}" if "amdahl_bound" in row else ""),
              flush=True)
    summary = {"config": config_name(args), "shape": args.shape, "pairs": len(pairs)}
    if args.mtp:
        summary["mtp_kernel"] = args.mtp_kernel
    tag = f"t{args.mtp}_" if args.mtp else ""
    for b, row in table.items():
        summary[f"speedup_{tag}b{b}"] = round(row["speedup"], 4)
        if "fraction_of_bound" in row:
            summary[f"bound_fraction_{tag}b{b}"] = round(row["fraction_of_bound"], 4)
        if "idle_excess_of_native_step" in row:
            summary[f"idle_excess_{tag}b{b}"] = round(row["idle_excess_of_native_step"], 4)
    config = model_config(args)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "config": {k: v for k, v in vars(args).items() if k not in ("arm", "model")},
              "model": f"Qwen3.5-{args.shape}-shaped dense (dummy weights): " + json.dumps({k: config[k] for k in (
                  "hidden_size", "intermediate_size", "num_hidden_layers", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim")}),
              "order": "".join("A" if r["arm"] == "native" else "B" for r in runs),
              "runs": runs, "table": table, "summary": summary}
    try:
        import torch
        import vllm

        result["gpu"] = torch.cuda.get_device_name(0)
        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    except Exception as e:
        result["versions"] = {"error": repr(e)}
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)
    if args.plot:
        plot(result, args.plot)
    return result


def plot(result, path):
    """patched/native against batch size: the median of the pairs, their min-max band, the
    Amdahl bound where the kernel benchmark gave one, and 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((int(b), r) for b, r in result["table"].items())
    xs = [b for b, _ in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.fill_between(xs, [r["speedup_min"] for _, r in rows], [r["speedup_max"] for _, r in rows], alpha=0.25,
                    label="min-max over pairs")
    ax.plot(xs, [r["speedup"] for _, r in rows], "o-", label="patched / native (median of pairs)")
    bounded = [(b, r["amdahl_bound"]) for b, r in rows if "amdahl_bound" in r]
    if bounded:
        ax.plot(*zip(*bounded), "k--", label="Amdahl bound (kernel benchmark)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("aggregate decode tok/s, patched / native")
    s = result["summary"]
    ax.set_title(f"{s['shape']} shape, config {s['config']}, {s['pairs']} pairs ({result.get('gpu', '?')})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(args):
    """Join the runs of several result files (e.g. an AB and a BA call) into one table."""
    runs, first = [], None
    for path in args.merge:
        data = json.load(open(path))
        first = first or data
        runs += data["runs"]
    for k, v in first["config"].items():
        if k not in ("out", "merge", "order", "kernel_json", "plot"):
            setattr(args, k, v)
    out, png = args.out, args.plot
    args.out = args.plot = None
    res = finish(args, runs)
    res["merged_from"] = [{"path": p, "command": json.load(open(p))["command"], "date": json.load(open(p))["date"]}
                          for p in args.merge]
    res["gpu"], res["versions"] = first.get("gpu"), first.get("versions")
    if out:
        json.dump(res, open(out, "w"), indent=1)
    if png:
        plot(res, png)
    return res


if __name__ == "__main__":
    main()
