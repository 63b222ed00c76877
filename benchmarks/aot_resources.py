#!/usr/bin/env python3
"""Compile the ring kernels for a CUDA target on a machine without a GPU and report, per launch,
what the compiler made of each kernel: registers per thread, spill and stack
bytes, static shared memory, and SASS instruction counts (global loads/stores, shuffles,
shared-memory traffic = layout conversions, barriers, FMAs).

    python benchmarks/aot_resources.py [--arch 90] [--launches two_phase_bv8_w1 replay_bv16_w1 ...]

It runs the real launchers (`ring_decode`) on small CPU tensors with Triton's driver replaced by
one that names the target and compiles instead of launching (Triton's own `warmup` path), so the
kernels, constexprs and argument specialisations are those a GPU run of the same shapes gets
(pointer alignment, integer divisibility). Needs triton with its NVIDIA backend (ptxas and
cuobjdump ship in the wheel); use the GPU's Triton version for numbers that match it. No
accelerator time; nothing here is a timing.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # after PYTHONPATH: a scratch copy of the package on it wins
    sys.path.append(ROOT)

SASS_CLASSES = {  # opcode prefix -> what it tells
    "LDG": "global loads", "STG": "global stores", "LDS": "shared loads", "STS": "shared stores",
    "SHFL": "warp shuffles", "BAR": "barriers", "FFMA": "fp32 FMAs", "ATOM": "atomics",
    "RED": "atomics", "LDL": "local loads (spills)", "STL": "local stores (spills)",
    "LDGSTS": "async copies", "UTMALDG": "TMA loads",
}


def install_compile_only_driver(arch: int):
    """Make Triton compile for `arch` and never launch (kernel[grid](...) becomes a warmup)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnly:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(CompileOnly())
    compiled = []

    def getitem(self, grid):
        def launch(*args, **kwargs):
            kwargs.pop("launch_pdl", None)
            k = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append((self.__name__, kwargs.get("num_warps"), k))
        return launch

    JITFunction.__getitem__ = getitem
    return compiled, triton.__version__


def let_tma_compile(arch: int) -> None:
    """The TMA form asks the GPU for its capability, occupancy and PDL; compile-only, answer
    for `arch` (the grid size does not change the code)."""
    from replayssm_patch.ops import decode, decode_tma, decode_tma_tc

    decode.tma_capable = lambda device: arch // 10 == 9
    decode_tma.programs_per_sm = lambda kernel, kernel_args, constexprs, device: 1
    decode_tma_tc.programs_per_sm = decode_tma.programs_per_sm
    decode_tma.use_pdl = decode_tma_tc.use_pdl = lambda launch, state: launch.pdl and arch >= 90


def cubin_report(kernel, tools: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    try:
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    out = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"{key}:(\d+)", res)
        out[key.lower()] = int(m.group(1)) if m else None
    counts = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", line)
        if m:
            op = m.group(1)
            for prefix, name in SASS_CLASSES.items():
                if op.startswith(prefix):
                    counts[name] += 1
            counts["instructions"] += 1
    out["sass"] = dict(counts)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90 = Hopper)")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--HV", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--state", choices=["fp32", "fp16", "bf16"], nargs="*", default=["fp32", "fp16"])
    ap.add_argument("--ring", choices=["fp32", "bf16", "fp16", "auto"], default="auto",
                    help="ring d/k dtype (auto: fp32 for an fp32 state, else the state's)")
    ap.add_argument("--launches", nargs="*", default=["fused_bv16_w1", "fused_bv32_w1", "two_phase_bv8_w1",
                                                     "replay_bv8_w1", "replay_bv16_w1", "replay_bv32_w1"],
                    help="launches by name (DecodeLaunch.name: form_bvN_wM[_pdl][_tc][_sS])")
    args = ap.parse_args(argv)

    import torch
    import triton

    compiled, tver = install_compile_only_driver(args.arch)
    from replayssm_patch.ops import DecodeLaunch, override_launch, ring_decode

    if any(name.startswith("tma_") for name in args.launches):
        let_tma_compile(args.arch)

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    dts = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    H, HV, K, L = args.H, args.HV, args.head_dim, args.L
    V = K
    N, slots = 4, 8
    print(f"triton {tver}, sm_{args.arch}, H={H} HV={HV} K=V={K} L={L}")
    print(f"{'state':5s} {'ring':5s} {'launch':20s} {'kernel':22s} {'warps':>5s} {'regs':>4s} {'stack':>5s} "
          f"{'smem':>6s} {'instr':>6s} {'LDG':>4s} {'STG':>4s} {'SHFL':>5s} {'LDS':>4s} {'STS':>4s} "
          f"{'BAR':>4s} {'FFMA':>5s} {'spill':>5s} {'async':>5s}")
    for sname in args.state:
        sdt = dts[sname]
        rdt = dts[args.ring] if args.ring != "auto" else sdt
        for ctext in args.launches:
            launch = DecodeLaunch.from_name(ctext)
            compiled.clear()
            qkv = torch.randn(N, 2 * H * K + HV * V).to(torch.bfloat16)
            a = torch.randn(N, HV).to(torch.bfloat16)
            b = torch.randn(N, HV).to(torch.bfloat16)
            with override_launch(decode=launch):
                ring_decode(qkv, a, b, torch.zeros(HV), torch.zeros(HV), K ** -0.5,
                            torch.zeros(slots, HV, V, K, dtype=sdt), torch.empty(N, 1, HV, V, dtype=torch.bfloat16),
                            torch.arange(1, N + 1, dtype=torch.int32), torch.zeros(slots, HV, L, V, dtype=rdt),
                            torch.zeros(slots, H, L, K, dtype=rdt), torch.zeros(slots, HV, L),
                            torch.zeros(slots, dtype=torch.int32))
            for name, warps, k in compiled:
                r = cubin_report(k, tools)
                s = r["sass"]
                spill = s.get("local loads (spills)", 0) + s.get("local stores (spills)", 0)
                print(f"{sname:5s} {str(rdt)[6:]:5s} {ctext:20s} {name:22s} {warps or 4:5d} {r['reg']:4d} "
                      f"{r['stack']:5d} {r['shared']:6d} {s.get('instructions', 0):6d} "
                      f"{s.get('global loads', 0):4d} {s.get('global stores', 0):4d} "
                      f"{s.get('warp shuffles', 0):5d} {s.get('shared loads', 0):4d} "
                      f"{s.get('shared stores', 0):4d} {s.get('barriers', 0):4d} {s.get('fp32 FMAs', 0):5d} "
                      f"{spill:5d} {s.get('async copies', 0) + s.get('TMA loads', 0):5d}", flush=True)


if __name__ == "__main__":
    main()
