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
                max_num_seqs=int(batch), max_model_len=max_len, memory_bytes=0, align=True)
            gain = payoff.predicted_gain(facts, state, state, int(batch), measured)
            cells.append({"file": name, "state": state, "batch": int(batch), "predicted_gain": round(gain, 4),
                          "measured_speedup": round(cell["speedup"], 4)})
    worst = max(c["predicted_gain"] for c in cells if c["measured_speedup"] < 1)
    return math.floor(worst / 0.05 + 1) * 0.05, cells


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
        "made_by": "benchmarks/make_plan_tables.py",
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(tables, f, indent=1, separators=(",", ": "))
        f.write("\n")
    print(f"wrote {a.out}: {sum(len(c) for c in curves.values())} kernel points")


if __name__ == "__main__":
    main()
