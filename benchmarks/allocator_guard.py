"""Ways to hold a serving engine's GPU memory to its gpu_memory_utilization, measured on an
engine already built (issue 46's `within_budget`; run by `capacity.py --allocator-guards`).

vLLM sizes the KV cache from a profile (weights, memory outside PyTorch's allocator, a dummy
step's peak, CUDA graphs), but nothing bounds what the allocator keeps cached once serving starts:
blocks freed by steps of other shapes stay reserved, and both arms' processes grow past their
budget (capacity.py's `over_budget_gib_{arm}`, with `torch_reserved_growth_gib` well above
`torch_live_peak_growth_gib`). The guards, installed in the engine's worker through
`collective_rpc` after its build, each with the same limit on what the allocator may hold (the
budget less what the engine's processes hold outside the allocator, read through NVML when the
guards are measured):

* "trim": after each of the worker's step calls (`execute_model`, `sample_tokens`), where the
  allocator holds more than the limit, `torch.cuda.empty_cache()`. Only cached blocks go, so it
  cannot fail a step; it costs a device sync each time it fires, and a step can still pass the
  limit between two checks;
* "expandable": the allocator's expandable segments (`expandable_segments:True`, switched on
  while it serves, the process's other allocator settings kept: segments it maps from then on
  grow in place instead of new blocks being allocated beside them). No limit: whether the cache's
  growth is fragmentation, and how much of it this leaves;
* "cap": `torch.cuda.set_per_process_memory_fraction` at the limit. The allocator then frees
  cached blocks itself when an allocation would pass the limit, inside a step too, at no cost
  below it; but a step whose live tensors (with the blocks they split) pass it fails with an
  out-of-memory error, which ends the engine.

Per guard, `pairs` pairs of the same load, the engine without a guard ("off") and with it,
alternating (off/guard, guard/off, ...); before each run the allocator's cache is emptied and its
peaks restarted, so that each run's peak is its own. Per run: tokens/s, the peak the allocator
held (`max_reserved_gib`) and, with what lies outside it, the engine's peak against its budget;
the guard's counters. A run that fails is recorded (`errors`) and ends its guard's pairs; the
next guard is measured if the engine still answers (the cap's out-of-memory error ends it, so the
cap comes last). This module holds the guards, their measurement and the reading of a worker's
allocator that it and capacity.py take (`torch_memory`); which guard the package should install
is the measurement's question, not settled here.
"""

from __future__ import annotations

import statistics
from typing import Callable

GIB = 1 << 30
GUARDS = ("trim", "expandable", "cap")  # the cap last: it can end the engine
_STEP_CALLS = ("execute_model", "sample_tokens")


def set_guard(worker, guard: str, limit_bytes: int | None) -> None:
    """In an engine's worker: remove any guard, empty the allocator's cache, install `guard`
    ("off" or one of GUARDS; "trim" and "cap" at `limit_bytes`), restart the allocator's peaks and
    the counters."""
    import torch

    if guard not in ("off", *GUARDS):
        raise ValueError(f"guard must be 'off' or one of {GUARDS}, got {guard!r}")
    inner = getattr(worker, "worker", worker)  # vLLM's worker behind its wrapper, whose step calls it
    for name in _STEP_CALLS:
        inner.__dict__.pop(name, None)  # back to the class's method
    torch.cuda.set_per_process_memory_fraction(1.0)
    if inner.__dict__.get("_allocator_guard", {}).get("guard") == "expandable":
        torch.cuda.memory._set_allocator_settings(_settings_with_expandable(False))
    torch.cuda.empty_cache()
    counters = {"guard": guard, "step_calls": 0, "trims": 0, "trimmed_bytes": 0}
    inner.__dict__["_allocator_guard"] = counters
    if guard == "trim":
        for name in _STEP_CALLS:
            inner.__dict__[name] = _trimming(getattr(inner, name), limit_bytes, counters)
    elif guard == "expandable":
        torch.cuda.memory._set_allocator_settings(_settings_with_expandable(True))
    elif guard == "cap":
        torch.cuda.set_per_process_memory_fraction(limit_bytes / torch.cuda.get_device_properties(
            torch.cuda.current_device()).total_memory)
    torch.cuda.reset_peak_memory_stats()


def _settings_with_expandable(on: bool) -> str:
    """The allocator settings the process started with (PYTORCH_ALLOC_CONF, else
    PYTORCH_CUDA_ALLOC_CONF) with expandable segments on or off: torch takes the settings whole,
    resetting every option the string leaves out."""
    import os

    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    kept = [opt for opt in conf.split(",") if opt.strip() and not opt.strip().startswith("expandable_segments")]
    return ",".join([*kept, f"expandable_segments:{on}"])


def _trimming(step: Callable, limit_bytes: int, counters: dict) -> Callable:
    """`step` (a worker's bound step call), followed by emptying the allocator's cache where it
    holds more than `limit_bytes`."""
    import torch

    def trimmed(*args, **kwargs):
        out = step(*args, **kwargs)
        counters["step_calls"] += 1
        held = torch.cuda.memory_reserved()
        if held > limit_bytes:
            torch.cuda.empty_cache()
            counters["trims"] += 1
            counters["trimmed_bytes"] += held - torch.cuda.memory_reserved()
        return out

    return trimmed


def torch_memory(worker, reset_peaks: bool = False) -> dict:
    """In an engine's worker: what PyTorch's allocator holds (reserved) and what live tensors take
    (allocated), now and at most since the peaks were last reset (GiB), to tell the allocator's
    growth from the rest of the process (CUDA context, NCCL; graphs' pools are the allocator's),
    and live tensors beyond vLLM's profile (allocated peak) from blocks the allocator keeps cached;
    {} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out = {"reserved_gib": torch.cuda.memory_reserved() / GIB, "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
           "allocated_gib": torch.cuda.memory_allocated() / GIB,
           "max_allocated_gib": torch.cuda.max_memory_allocated() / GIB}
    if reset_peaks:
        torch.cuda.reset_peak_memory_stats()
    return out


def guard_report(worker) -> dict:
    """In an engine's worker: the guard's counters and the allocator's memory since set_guard."""
    inner = getattr(worker, "worker", worker)
    return dict(inner.__dict__.get("_allocator_guard", {}), **torch_memory(worker))


def measure(llm, run_load: Callable[[str], dict], engine_gib: Callable[[], float | None], budget_gib: float,
            pairs: int) -> dict:
    """The guards on the built engine `llm` (module docstring). `run_load(rid)` serves the load
    once and returns its measurement (capacity.drive); `engine_gib()` reads what the engine's
    processes hold (NVML); `budget_gib` is its gpu_memory_utilization's share of the GPU."""
    llm.collective_rpc(set_guard, args=("off", None))
    held = engine_gib()
    if held is None:
        return {"skipped": "NVML does not report the engine's processes"}
    outside = held - llm.collective_rpc(guard_report)[0]["reserved_gib"]
    limit_gib = budget_gib - outside
    out = {"budget_gib": budget_gib, "outside_allocator_gib": outside, "limit_gib": limit_gib, "guards": {},
           "errors": []}
    for guard in GUARDS:
        out["guards"][guard] = runs = []
        g = "off"
        try:
            for p in range(pairs):
                pair = {}
                runs.append(pair)
                for g in ("off", guard) if p % 2 == 0 else (guard, "off"):
                    llm.collective_rpc(set_guard, args=(g, int(limit_gib * GIB)))
                    run = run_load(f"guard-{guard}{p}-{g}")
                    pair[g] = {"tok_s": run["tok_s"], "steps": run["steps"], "wall_s": run["wall_s"],
                               "allocator": llm.collective_rpc(guard_report)[0],
                               "gpu_used_by_processes_gib": engine_gib()}
        except Exception as e:  # what ran stays recorded
            out["errors"].append({"guard": guard, "run": g, "what": f"{type(e).__name__}: {e}"[:2000]})
        try:
            llm.collective_rpc(set_guard, args=("off", None))
        except Exception:  # the engine no longer answers (the cap's out-of-memory error ends it)
            break
    return out


def summarize(measured: dict, tolerance_gib: float) -> dict:
    """Per guard and for the runs without one: the largest peak over the runs (what the
    allocator held at most, with what lies outside it) against the budget, and whether it stayed
    within `tolerance_gib` of it; per guard: its tokens/s over the paired run's without it
    (median, min, max) and how often it trimmed."""
    if "guards" not in measured:
        return dict(measured)
    out = {k: measured[k] for k in ("budget_gib", "outside_allocator_gib", "limit_gib", "errors")}
    failed = {e["run"] for e in measured["errors"]}
    for g in ("off", *GUARDS):
        rs = [p[g] for ps in measured["guards"].values() for p in ps if g in p]
        ok = g not in failed  # a guard with a failed run did not hold the engine within anything
        if not rs:
            if not ok:
                out[g] = {"runs": 0, "within_budget": False}
            continue
        peak = max(r["allocator"]["max_reserved_gib"] for r in rs) + measured["outside_allocator_gib"]
        over = peak - measured["budget_gib"]
        out[g] = {"runs": len(rs), "peak_gib": peak, "over_budget_gib": over, "within_budget": over <= tolerance_gib and ok,
                  "gpu_used_by_processes_max_gib": max((r["gpu_used_by_processes_gib"] or 0) for r in rs)}
    for g in GUARDS:
        paired = [p for p in measured["guards"].get(g, []) if g in p and "off" in p]
        if paired and g in out:
            ratios = [p[g]["tok_s"] / p["off"]["tok_s"] for p in paired]
            out[g].update(tok_s_ratio=statistics.median(ratios), tok_s_ratio_min=min(ratios),
                          tok_s_ratio_max=max(ratios), pairs=len(ratios),
                          trims=sum(p[g]["allocator"]["trims"] for p in paired),
                          step_calls=sum(p[g]["allocator"]["step_calls"] for p in paired))
    return out
