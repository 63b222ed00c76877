"""Plain decode with the default options, across shapes: one summary from e2e_decode.py runs.

Each input is a finished `benchmarks/e2e_decode.py` run (or a `--merge` of runs) of one shape
made with `--min-batch auto`: the patched arm gets what a user gets by default, the plan's rule
(replayssm_patch/payoff.py), and its engine's log says from which batch the rule put plain
decode on the ring (`plan_min_batch`; None: native at every batch). A cell is one shape at one
batch size; the rule chose the ring for it where `plan_min_batch` <= batch. Where the rule keeps
native, both arms run the same kernels and the cell's ratio shows the harness's own spread.

    python benchmarks/e2e_auto.py 9b.json 4b.json moe.json --out e2e_auto.json

The summary: `min_speedup_ring_cells` (the smallest median pair ratio over the cells where the
rule chose the ring; None where it chose none), `min_speedup` (over all cells), `speedup_4b_b256`
(where the 4b shape ran batch 256), `ring_cells` and `pairs` (the fewest pairs of any cell),
beside the GPU and vLLM of the runs. No GPU needed.
"""

from __future__ import annotations

import argparse
import datetime
import json


def cells(run: dict, path: str) -> list[dict]:
    """One row per batch of `run` (an e2e_decode result at --min-batch auto)."""
    cfg = run.get("config", {})
    if str(cfg.get("min_batch")) != "auto" or cfg.get("control") or cfg.get("mtp"):
        raise SystemExit(f"{path}: not a plain-decode run at --min-batch auto (min_batch "
                         f"{cfg.get('min_batch')!r}, control {cfg.get('control')}, mtp {cfg.get('mtp')})")
    first = run["engines"]["patched"].get("plan_min_batch")
    rows = []
    for batch, row in sorted(run["table"].items(), key=lambda kv: int(kv[0])):
        b = int(batch)
        rows.append({"shape": cfg["shape"], "batch": b, "speedup": row["speedup"], "speedup_min": row["speedup_min"],
                     "speedup_max": row["speedup_max"], "pairs": len(row["pair_speedups"]),
                     "ring": first is not None and b >= first})
    return rows


def summarize(runs: list[tuple[str, dict]]) -> dict:
    """The summary and every cell of `runs` ((path, e2e_decode result) each)."""
    shapes = [run["config"]["shape"] for _, run in runs]
    if len(set(shapes)) != len(shapes):
        raise SystemExit(f"one run per shape (got {shapes}): merge a shape's runs with e2e_decode.py --merge first")
    rows = [row for path, run in runs for row in cells(run, path)]
    ring = [r for r in rows if r["ring"]]
    at_4b_256 = [r["speedup"] for r in rows if r["shape"] == "4b" and r["batch"] == 256]
    summary = {
        "min_speedup_ring_cells": min((r["speedup"] for r in ring), default=None),
        "min_speedup": min(r["speedup"] for r in rows),
        "speedup_4b_b256": at_4b_256[0] if at_4b_256 else None,
        "ring_cells": [f"{r['shape']} b{r['batch']}" for r in ring],
        "plan_min_batch": {run["config"]["shape"]: run["engines"]["patched"].get("plan_min_batch") for _, run in runs},
        "pairs": min(r["pairs"] for r in rows),
        "shapes": shapes,
        "gpu": sorted({str(run.get("gpu")) for _, run in runs}),
        "vllm": sorted({str((run.get("versions") or {}).get("vllm")) for _, run in runs}),
    }
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "runs": [{"path": path, "command": run.get("command"), "date": run.get("date"), "model": run.get("model"),
                      "gpu": run.get("gpu")} for path, run in runs],
            "cells": rows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="JSON", help="e2e_decode.py results at --min-batch auto, one per shape")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = summarize([(path, json.load(open(path))) for path in args.runs])
    json.dump(result, open(args.out, "w"), indent=1)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
