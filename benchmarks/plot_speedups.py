"""Plot the ring's speed against native from committed results: one figure, two panels.

    python benchmarks/plot_speedups.py --kernel KERNEL.json [...] --e2e E2E.json [...] --out PNG

* left: the decode kernel, native time / ring time per batch (`benchmarks/kernel_decode.py`
  JSON files), one line per (shape, state dtype, ring dtype) in them;
* right: end to end, the median pair ratio patched / native per batch with its min-max as an
  error bar (`benchmarks/e2e_decode.py` JSON files, final or merged), one series per file,
  labelled by its GPU and state dtype (`--e2e-label` replaces the labels, in order).

Reads only the files it is given; no GPU. docs/performance.md names the command that made its
plot.
"""

from __future__ import annotations

import argparse
import json
import os


def kernel_series(paths: list[str], shapes: list[str] | None, states: list[str] | None) -> dict:
    series: dict[tuple, list] = {}
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        for r in rows:
            if (shapes and r["shape"] not in shapes) or (states and r["state_dtype"] not in states):
                continue
            key = (r["shape"], r["state_dtype"], r["ring_dtype"])
            series.setdefault(key, []).append((r["batch"], r["native_us"] / r["ours_us"]))
    return {k: sorted(v) for k, v in series.items()}


def e2e_series(path: str) -> tuple[str, list]:
    with open(path) as f:
        d = json.load(f)
    gpu = (d.get("gpu") or "GPU").replace("NVIDIA ", "").split(" 80GB")[0]
    state = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(d["config"]["state_dtype"],
                                                                         d["config"]["state_dtype"])
    points = []
    for batch, cell in d["table"].items():
        pairs = len(cell.get("pair_speedups") or [])
        points.append((int(batch), cell["speedup"], cell["speedup_min"], cell["speedup_max"], pairs))
    return f"{gpu}, {state} state", sorted(points)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", nargs="+", required=True, metavar="JSON")
    ap.add_argument("--e2e", nargs="+", required=True, metavar="JSON")
    ap.add_argument("--e2e-label", nargs="*", default=None, metavar="TEXT")
    ap.add_argument("--shapes", nargs="*", default=None, help="kernel shapes to plot (default: all)")
    ap.add_argument("--states", nargs="*", default=None, help="kernel state dtypes to plot (default: all)")
    ap.add_argument("--out", required=True, metavar="PNG")
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (shape, state, ring), pts in kernel_series(a.kernel, a.shapes, a.states).items():
        xs, ys = zip(*pts)
        left.plot(xs, ys, marker="o", ms=3, label=f"{shape}, {state} state, {ring} ring")
    left.set(xscale="log", xlabel="decode batch", ylabel="native time / ring time",
             title="GDN decode kernel, per layer-step")
    left.set_xscale("log", base=2)

    labels = a.e2e_label or []
    n = len(a.e2e)
    for i, path in enumerate(a.e2e):
        label, pts = e2e_series(path)
        label = labels[i] if i < len(labels) else label
        xs = [p[0] * (1 + 0.06 * (i - (n - 1) / 2)) for p in pts]  # side by side at a shared batch
        ys = [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        right.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, ms=4,
                       label=f"{label} ({'/'.join(str(p[4]) for p in pts)} pairs)")
    right.set_xscale("log", base=2)
    right.set(xlabel="decode batch", ylabel="patched / native tokens/s (median, min-max)",
              title="End to end, vLLM's default config")
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
