"""Plain decode with the default options, across shapes: one summary from e2e_decode.py runs.

Each input is a finished `benchmarks/e2e_decode.py` run (or a `--merge` of runs) of one shape
made with `--min-batch auto`: the patched arm gets what a user gets by default, the plan's rule
(replayssm_patch/payoff.py), and its engine's log says from which batch the rule put plain
decode on the ring (`plan_min_batch`; None: native at every batch). A cell is one shape at one
batch size; the rule chose the ring for it where `plan_min_batch` <= batch. Where the rule keeps
native, both arms run the same kernels and the cell's ratio shows the harness's own spread.

A shape may come in several runs whose batches do not overlap. e2e_decode.py sets `max_num_seqs`
to a run's largest batch, and the rule weighs the ring's pages against `max_num_seqs`. A run of
batches up to 256 is therefore an engine of vLLM's usual 256 sequences, while batch 512 needs an
engine of its own. Each cell keeps its own run's decision and `max_num_seqs`.

    python benchmarks/e2e_auto.py 9b.json 4b.json 4b_512.json moe.json --out e2e_auto.json

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
    max_num_seqs = max(int(b) for b in run["table"])  # e2e_decode.py: the run's largest batch
    rows = []
    for batch, row in sorted(run["table"].items(), key=lambda kv: int(kv[0])):
        b = int(batch)
        rows.append({"shape": cfg["shape"], "batch": b, "max_num_seqs": max_num_seqs, "speedup": row["speedup"],
                     "speedup_min": row["speedup_min"], "speedup_max": row["speedup_max"],
                     "pairs": len(row["pair_speedups"]), "ring": first is not None and b >= first,
                     "plan_min_batch": first})
    return rows


def cell_name(row: dict) -> str:
    return f"{row['shape']} b{row['batch']}"


def summarize(runs: list[tuple[str, dict]]) -> dict:
    """The summary and every cell of `runs` ((path, e2e_decode result) each)."""
    rows = [row for path, run in runs for row in cells(run, path)]
    cell_names = [cell_name(r) for r in rows]
    twice = sorted({c for c in cell_names if cell_names.count(c) > 1})
    if twice:
        raise SystemExit(f"one run per cell (got {', '.join(twice)} twice): merge a configuration's runs with "
                         "e2e_decode.py --merge first")
    shapes = sorted({r["shape"] for r in rows})
    ring = [r for r in rows if r["ring"]]
    at_4b_256 = [r["speedup"] for r in rows if r["shape"] == "4b" and r["batch"] == 256]
    summary = {
        "min_speedup_ring_cells": min((r["speedup"] for r in ring), default=None),
        "min_speedup": min(r["speedup"] for r in rows),
        "speedup_4b_b256": at_4b_256[0] if at_4b_256 else None,
        "ring_cells": [cell_name(r) for r in ring],
        "plan_min_batch": {f"{r['shape']} max_num_seqs {r['max_num_seqs']}": r["plan_min_batch"] for r in rows},
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
    ap.add_argument("runs", nargs="+", metavar="JSON",
                    help="e2e_decode.py results at --min-batch auto (a shape's runs: batches that do not overlap)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = summarize([(path, json.load(open(path))) for path in args.runs])
    json.dump(result, open(args.out, "w"), indent=1)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
