#!/usr/bin/env python3
"""Run one decode launch per arm (for a profiler such as Nsight Compute to attach to).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python benchmarks/profile_decode.py --vllm-root /tmp/vl --batch 512 --hv 64 --state fp16 \
        --launches fused_bv32_w1 two_phase_bv8_w1

Arms: vLLM's native packed decode, then ours with each given launch (by DecodeLaunch.name; see
replayssm_patch.ops.launch). Each arm runs twice (the first call compiles); profile the
second (ncu --launch-skip / -k filters).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import kernel_decode as kd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-root", default=None)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--hv", type=int, default=64)
    ap.add_argument("--state", choices=list(kd.STATE_DTYPES), default="fp16")
    ap.add_argument("--launches", nargs="*", default=[], help="launch names, form_bvN_wM[_pdl][_tc]")
    ap.add_argument("--ring-dtype", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args()
    kd.RING_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.ring_dtype]
    fn, _, _ = kd.load_native(args.vllm_root)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = kd.Layer(args.batch, args.h, args.hv, kd.STATE_DTYPES[args.state], gen)
    for _ in range(2):
        layer.native(fn)
    for name in args.launches:
        launch = kd.DecodeLaunch.from_name(name)
        for _ in range(2):
            layer.ours(launch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
