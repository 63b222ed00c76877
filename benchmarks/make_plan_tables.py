"""Write the tables the plan reads (`replayssm_patch/data/plan_tables.json`) from committed results.

    python benchmarks/make_plan_tables.py [--out replayssm_patch/data/plan_tables.json]

* `kernels`: per (state dtype, ring dtype), the GDN decode kernel's time per layer-step, vLLM's
  and the ring's, against the state bytes one layer-step reads (batch x value heads x V x K x
  element size): the kernel benchmark's rows of both model shapes, keyed by bytes so that a
  model with other head counts reads the same curve. Sources: kernel_decode.json (16-bit ring)
  and kernel_decode_fp32ring.json (fp32 ring for an fp32 state).
* `device`: the copy bandwidth of the GPU those kernels ran on (the kernel benchmark measured it)
  and its dense bf16 matrix rate.
* `rule`: the predicted end-to-end gain the ring must reach before it serves plain decode by
  default, with the end-to-end results that set it (docs/performance.md explains the choice).
* `prefill_step`: what the GDN prefill step a ring engine adds to vLLM's memory profile
  (replayssm_patch/vllm/prefill_profile.py) holds, per state dtype, as a line through the measured
  step's ends: bytes per token in units of the layer's q/k/v bytes per token, and bytes per further
  sequence in units of one sequence's state. Source: gdn_prefill_memory.py's runs of that function.

Nothing here runs a GPU; the numbers come from the files named in the output.
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
SOURCES = {"kernel_decode.json": None, "kernel_decode_fp32ring.json": None}

# The matrix rate: an 8192^3 bf16 product on the lent H100 and H200 (798 and 788 TFLOP/s, the
# device tool's notes, 2026-11); the plan uses it for a step's matrix work at large batches.
MATMUL_TFLOPS = 790.0
# The share of an engine's memory the concurrency estimate leaves to activations and CUDA graphs
# (vLLM profiles them at start; the plan is made before that).
ACTIVATION_SHARE = 0.1
# benchmarks/gdn_prefill_memory.py, per state dtype: the prefill step over 1..N sequences
PREFILL_STEP = {"fp32": "gdn_prefill_memory_h100_2026-12-07/vllm033/gdn_prefill_memory_fp32.json",
                "bf16": "gdn_prefill_memory_h100_2026-12-07/vllm033/gdn_prefill_memory_bf16.json"}
# The end-to-end runs of plain decode through the ring at every batch (e2e_decode.py, 9B shape,
# vLLM's default config) that set the rule's threshold: the smallest 5% step above the predicted
# gain of every cell that measured slower than native, so that no measured loss would have been
# served by default.
CALIBRATION = ["e2e_fp32_2026-12-05/e2e_decode_fp32.json", "e2e_fp32_h100_2026-12-05/e2e_decode_fp32_b64.json",
               "e2e_control_h100_2026-12-05/e2e_fp32.json", "e2e_bf16_2026-12-03/e2e_decode_bf16.json",
               "e2e_bf16_h100_2026-12-05/e2e_decode_bf16.json"]


def kernel_curves() -> tuple[dict, dict]:
    curves: dict[str, list] = {}
    meta = {}
    for name in SOURCES:
        d = json.load(open(os.path.join(RESULTS, name)))
        meta[name] = {"gpu": d["gpu"], "date": d["date"], "copy_bandwidth_TBps": d["summary"]["copy_bandwidth_TBps"]}
        for r in d["rows"]:
            key = f"{r['state_dtype']}/{r['ring_dtype']}"
            state_bytes = r["batch"] * r["HV"] * r["V"] * r["K"] * ELEMENT[r["state_dtype"]]
            curves.setdefault(key, []).append([state_bytes, r["native_us"], r["ours_us"]])
    for key, points in curves.items():  # both shapes reach some byte counts: their mean
        merged: dict[int, list] = {}
        for x, native, ring in points:
            merged.setdefault(x, []).append((native, ring))
        curves[key] = [[x, round(sum(n for n, _ in v) / len(v), 3), round(sum(r for _, r in v) / len(v), 3)]
                       for x, v in sorted(merged.items())]
    return curves, meta


def calibration(curves: dict, bandwidth: float) -> tuple[float, list[dict]]:
    """(the threshold, each calibration cell's predicted gain and measured speedup)."""
    import math
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    sys.path.insert(0, ROOT)
    from e2e_decode import CONFIG_9B

    from replayssm_patch import payoff

    measured = {"kernels": {"curves": curves},  # the tables being written, not the package's file
                "device": {"copy_bandwidth_TBps": bandwidth, "matmul_tflops": MATMUL_TFLOPS}}
    cells = []
    for name in CALIBRATION:
        d = json.load(open(os.path.join(RESULTS, name)))
        cfg = d["config"]
        state = {"float32": "fp32", "bfloat16": "bf16"}[cfg["state_dtype"]]
        max_len = cfg["in_len"] + cfg["out_len"] + 8  # as e2e_decode.py sets max_model_len
        for batch, cell in d["table"].items():
            facts = payoff.facts_from_hf_config(
                SimpleNamespace(**CONFIG_9B), tp=1, weight_bytes_per_param=2, activation_bytes=2,
                kv_bytes_per_element=2, state_bytes_per_slot=32 * 128 * 128 * ELEMENT[state],
                max_num_seqs=int(batch), max_num_batched_tokens=16384, max_model_len=max_len, memory_bytes=0,
                align=True)  # (the gain reads neither the token budget nor the memory)
            gain = payoff.predicted_gain(facts, state, state, int(batch), measured)
            cells.append({"file": name, "state": state, "batch": int(batch), "predicted_gain": round(gain, 4),
                          "measured_speedup": round(cell["speedup"], 4)})
    worst = max(c["predicted_gain"] for c in cells if c["measured_speedup"] < 1)
    return math.floor(worst / 0.05 + 1) * 0.05, cells


def prefill_step() -> dict:
    """Per state dtype, the step's bytes as `per_token` x tokens x q/k/v bytes per token + `per_sequence`
    x (sequences - 1) x state bytes: the line through the runs' fewest and most sequences, above every
    point between them (the measured step grows faster with the sequences where they get short)."""
    out = {}
    for state, name in PREFILL_STEP.items():
        d = json.load(open(os.path.join(RESULTS, name)))
        g = d["gdn"]
        qkv_token = (2 * g["key_heads"] + g["value_heads"]) * g["head_dim"] * 2  # the model's bf16 activations
        state_bytes = g["value_heads"] * g["head_dim"] ** 2 * ELEMENT[state]
        rows = sorted(d["rows"], key=lambda r: r["seqs"])
        first, last = rows[0], rows[-1]
        gib = 1 << 30
        per_token = first["peak_above_inputs_gib"] * gib / first["tokens"] / qkv_token
        grown = (last["peak_above_inputs_gib"] - first["peak_above_inputs_gib"]) * gib
        per_seq = grown / (last["seqs"] - first["seqs"]) / state_bytes
        out[state] = {"per_token": round(per_token, 3), "per_sequence": round(per_seq, 3), "source": name,
                      "gpu": d["gpu"], "vllm": d["versions"]["vllm"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "replayssm_patch", "data", "plan_tables.json"))
    a = ap.parse_args()
    curves, meta = kernel_curves()
    bandwidth = min(m["copy_bandwidth_TBps"] for m in meta.values())
    threshold, cells = calibration(curves, bandwidth)
    tables = {
        "kernels": {"unit": "us per layer-step against state bytes per layer-step", "sources": meta,
                    "curves": curves},
        "device": {"gpu": sorted({m["gpu"] for m in meta.values()}), "copy_bandwidth_TBps": bandwidth,
                   "matmul_tflops": MATMUL_TFLOPS},
        "rule": {"min_predicted_gain": round(threshold, 2), "calibration": cells,
                 "activation_share": ACTIVATION_SHARE},
        "prefill_step": prefill_step(),
        "made_by": "benchmarks/make_plan_tables.py",
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(tables, f, indent=1, separators=(",", ": "))
        f.write("\n")
    print(f"wrote {a.out}: {sum(len(c) for c in curves.values())} kernel points")


if __name__ == "__main__":
    main()
