#!/usr/bin/env python3
"""Run a few speculative verify launches (for a profiler such as Nsight Compute to attach to).

    ncu -k regex:_ring_verify_block --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section LaunchStats \
        python benchmarks/profile_spec.py --vllm-root /tmp/vl --batch 256 --drafts 8 --launch 16,1

Builds one kernel_spec layer (Qwen3.5-9B GDN shape, fp32 state, fp32 ring) and runs ours
(with the given launch of its main kernel) and vLLM's native kernel
three times each, accepted counts uniform in 1..T+1.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import kernel_spec as ks  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-root", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--drafts", type=int, default=8)
    ap.add_argument("--launch", default=None, metavar="BV,WARPS", help="the main kernel's VerifyLaunch")
    args = ap.parse_args()
    if args.launch:
        ks.VERIFY_LAUNCH = ks.VerifyLaunch(*(int(x) for x in args.launch.split(",")))
    native_fn, _ = ks.load_native(args.vllm_root)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lay = ks.Layer(args.batch, args.drafts, gen, "cuda")
    table = ks.acceptance_table(args.batch, args.drafts, 3, seed=1, mode="uniform", dev="cuda")
    for acc in table:
        lay.ours(acc)
    for acc in table:
        lay.native(native_fn, acc)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
