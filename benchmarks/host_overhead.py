#!/usr/bin/env python3
"""Host time of one `ring_decode` call (and of the MTP verify paths): its Python path with the
Triton launches stubbed out, or launched for real on a GPU (`--cuda`).

    python benchmarks/host_overhead.py [--baseline DIR] [--tma] [--verify T] [--verify-step] [--out results.json]

In eager and piecewise-compiled steps vLLM calls the decode once per GDN layer per step, so
this time is paid per layer (under a full CUDA graph it is paid only at capture). Runs on the
CPU with CPU tensors: the argument checks, the launch pick and the scratch allocations run as
on a GPU, only the kernels do not. `--baseline DIR` times a copy of another commit's kernel
package (as in kernel_decode.py) in the same process, interleaved; median of repeats, us.
`--tma` adds an arm that answers the TMA form's capability check with yes (as on Hopper) and its
occupancy lookup as cached after the first call, so the table picks the TMA form where it would
on an H200 and its launcher (tensor descriptor, constexprs, grid) is timed. `--verify T` adds
the MTP verify launcher (`ring_verify`, bf16 state and ring, T tokens per row, empty rings).
`--verify-step` times, per call, what a speculative-only MTP step costs the host around the
verify call: vLLM's `_forward_core` path with our wrapper in it (`wrapper_path`) against
`intercept.verify_step` (`verify_step`), the conv and the verify itself stubbed out
(replayssm_patch.testing.spec_step: a small shape, so that the CPU copies the first path makes
cost next to nothing, as their launches would on a GPU host; T = 3, `--rows` speculative rows).
`--cuda` (on a GPU) launches the kernels for real instead of stubbing them, on CUDA tensors:
the host time per call then includes Triton's launch path, as long as the GPU keeps up (small
`--rows`; the queue is drained between repeats); with `--verify-step` only the conv stays a
stand-in. `--floor` (with `--cuda`) adds what launching alone costs this host: an empty Triton
kernel with 1 and with 32 arguments (16 tensors, 16 ints) and one small torch op.
`--cprofile N` profiles N more calls of every arm with cProfile and keeps, per arm, the
functions with the most own time (us per call), so a slow host path shows where it goes.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import os
import pkgutil
import platform
import statistics
import sys
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402

H, HV, K, V, L = 16, 32, 128, 128, 16  # the Qwen3-Next / Qwen3.5-9B GDN shape


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels(pkg: str) -> None:
    """Replace every @triton.jit kernel (a `_..._kernel` attribute) of every module of the package
    (the one it launches from may be any of them: the prep kernel has a module of its own)."""
    package = importlib.import_module(pkg)
    for info in pkgutil.iter_modules(package.__path__):
        try:
            mod = importlib.import_module(f"{pkg}.{info.name}")
        except ImportError:
            continue
        for attr in dir(mod):
            if attr.startswith("_") and attr.endswith("_kernel"):
                setattr(mod, attr, _NoLaunch())


def tma_arm(pkg):
    """ring_decode with the TMA form allowed on these CPU tensors (kernels stubbed)."""
    decode = importlib.import_module(f"{pkg}.decode")
    launch = importlib.import_module(f"{pkg}.launch")
    decode_tma = importlib.import_module(f"{pkg}.decode_tma")
    decode_tma._programs_per_sm = lambda kernel_args, constexprs, device: 4

    def run(*a):
        saved = decode.tma_capable, launch.tma_capable
        decode.tma_capable = launch.tma_capable = lambda device: True
        try:
            return decode.ring_decode(*a)
        finally:
            decode.tma_capable, launch.tma_capable = saved
    return run


def decode_args(rows: int, slots: int = 600):
    f32 = torch.float32
    return (torch.randn(rows, 2 * H * K + HV * V), torch.randn(rows, HV), torch.randn(rows, HV),
            torch.zeros(HV), torch.zeros(HV), K ** -0.5, torch.zeros(slots, HV, V, K, dtype=f32),
            torch.empty(rows, 1, HV, V), torch.arange(1, rows + 1, dtype=torch.int32),
            torch.zeros(slots, HV, L, V), torch.zeros(slots, H, L, K), torch.zeros(slots, HV, L),
            torch.zeros(slots, dtype=torch.int32), torch.zeros(rows, dtype=torch.bool),
            torch.zeros(rows, dtype=torch.bool))


def verify_args(rows: int, window: int, slots: int = 600):
    """ring_verify's arguments: `rows` rows of `window` tokens, bf16 state and ring, empty rings,
    one accepted token per row."""
    bf16, i32 = torch.bfloat16, torch.int32
    tokens = rows * window
    return (torch.randn(tokens, 2 * H * K + HV * V), torch.randn(tokens, HV), torch.randn(tokens, HV),
            torch.zeros(HV), torch.zeros(HV), K ** -0.5, torch.zeros(slots, HV, V, K, dtype=bf16),
            torch.empty(tokens, HV, V), torch.arange(1, rows + 1, dtype=i32),
            torch.arange(0, tokens + 1, window, dtype=i32), torch.zeros(slots, HV, L, V, dtype=bf16),
            torch.zeros(slots, H, L, K, dtype=bf16), torch.zeros(slots, HV, L), torch.zeros(slots, dtype=i32),
            torch.ones(rows, dtype=i32), window)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, metavar="DIR", help="a copy of another commit's kernel package")
    ap.add_argument("--rows", default="1,64,512")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tma", action="store_true", help="also time the TMA form's host path (as on Hopper)")
    ap.add_argument("--verify", type=int, default=0, metavar="T",
                    help="also time ring_verify (the MTP verify launcher) with T tokens per row")
    ap.add_argument("--verify-step", action="store_true",
                    help="time instead a speculative-only step's host path: vLLM's with our wrapper, and verify_step")
    ap.add_argument("--cuda", action="store_true",
                    help="on a GPU: launch the kernels for real (host time including Triton's launch path)")
    ap.add_argument("--floor", action="store_true",
                    help="with --cuda: also time empty Triton launches (1 and 32 arguments) and one torch op")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also profile N calls of each arm with cProfile (top functions by own time)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.floor and not args.cuda:
        ap.error("--floor needs --cuda (a stubbed launch costs nothing)")
    if args.cuda and (args.tma or args.baseline):
        ap.error("--cuda: not with --tma or --baseline (the GPU's own launch table and kernels are timed)")
    if args.cuda and not torch.cuda.is_available():
        ap.error("--cuda needs a CUDA GPU")
    if args.verify_step:
        return verify_step_times(args)

    import replayssm_patch.ops as ours

    if not args.cuda:
        stub_kernels("replayssm_patch.ops")
    arms = {"ours": ours.ring_decode}
    if args.verify:
        arms["verify"] = ours.ring_verify
    if args.tma:
        arms["ours_tma"] = tma_arm("replayssm_patch.ops")
    if args.baseline:
        import kernel_decode

        arms["baseline"] = kernel_decode.load_baseline(args.baseline)
        stub_kernels("baseline_kernels")
    floor = floor_calls() if args.floor else {}  # compiled once, timed beside every row count
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        dev = "cuda" if args.cuda else "cpu"
        a = _on(decode_args(rows), dev)
        v = _on(verify_args(rows, args.verify), dev) if args.verify else None
        calls = {name: functools.partial(fn, *(v if name == "verify" else a)) for name, fn in arms.items()}
        calls.update(floor)
        row = {"rows": rows, **_time_arms(calls, args)}
        if "baseline" in arms:
            row["ours_over_baseline"] = round(row["ours_us"] / row["baseline_us"], 3)
        if args.tma:
            row["tma_launch"] = _tma_pick(rows)
        rows_out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "cprofile"}), flush=True)
    launches = "Triton launches on the GPU" if args.cuda else "Triton launches stubbed"
    _write(args, rows_out, f"median of {args.repeats} interleaved repeats of {args.calls} calls; {launches}",
           {"H": H, "HV": HV, "K": K, "V": V, "L": L})


def _on(args, dev):
    return tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in args)


def floor_calls() -> dict:
    """What launching alone costs: empty Triton kernels (1 and 32 arguments), one torch op."""
    import triton

    @triton.jit
    def _empty1_kernel(p0):
        pass

    @triton.jit
    def _empty32_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
                        i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15):
        pass

    ts = [torch.zeros(64, device="cuda") for _ in range(16)]
    ints = [3 + 16 * i for i in range(16)]  # neither 1 nor a multiple of 16: no specialisation
    y = torch.empty(64, device="cuda")
    return {"triton_empty_1arg": lambda: _empty1_kernel[(1,)](ts[0]),
            "triton_empty_32args": lambda: _empty32_kernel[(1,)](*ts, *ints),
            "torch_copy": lambda: y.copy_(ts[0])}


def _time_arms(calls: dict, args) -> dict:
    """us per call of each arm (median of interleaved repeats) and, with --cprofile, the top
    functions of each arm by own time."""
    for call in calls.values():  # warm-up: compiles on the GPU
        call()
    times = {k: [] for k in calls}
    for _ in range(args.repeats):  # arms interleaved
        for name, call in calls.items():
            times[name].append(_time(call, args))
    res = {f"{k}_us": round(statistics.median(v), 2) for k, v in times.items()}
    if args.cprofile:
        res["cprofile"] = {k: _profile(call, args) for k, call in calls.items()}
    return res


def _profile(call, args, top: int = 15) -> list:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    if args.cuda:
        torch.cuda.synchronize()
    prof.enable()
    for _ in range(args.cprofile):
        call()
    prof.disable()
    if args.cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    worst = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    n = args.cprofile
    return [{"function": f"{os.path.basename(f)}:{line}({name})", "calls": round(nc / n, 2),
             "own_us": round(tt / n * 1e6, 2), "cumulative_us": round(ct / n * 1e6, 2)}
            for (f, line, name), (_, nc, tt, ct, _) in worst]


def _time(call, args) -> float:
    """us per call: `args.calls` calls; on CUDA the queue drained before and after."""
    if args.cuda:
        torch.cuda.synchronize()
    us = timeit.timeit(call, number=args.calls) / args.calls * 1e6
    if args.cuda:
        torch.cuda.synchronize()
    return us


def verify_step_times(args):
    from replayssm_patch.testing import spec_step
    from replayssm_patch.vllm import spec_verify_step

    conv = spec_step.ConvStandIn(dim_first=False, identity=True)
    arms = {"wrapper_path": spec_step.via_wrapper, "verify_step": spec_verify_step.verify_step}
    floor = floor_calls() if args.floor else {}  # compiled once, timed beside every row count
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        layer, md, inputs = spec_step.make_step(0, rows=rows, slots=rows + 1, device="cuda" if args.cuda else "cpu")
        if not args.cuda:  # both paths call the verify through the layer's ring ops: stubbed on CPU
            layer.ring_ops.verify = lambda *a, **kw: None
        out = torch.zeros(inputs["mixed_qkv"].shape[0], spec_step.HV, spec_step.V, device=inputs["a"].device)
        calls = {name: functools.partial(fn, layer, md, **inputs, core_attn_out=out, gdn=conv)
                 for name, fn in arms.items()}
        calls.update(floor)
        row = {"rows": rows, **_time_arms(calls, args)}
        rows_out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "cprofile"}), flush=True)
    verify = "launched" if args.cuda else "stubbed"
    shape = {k: getattr(spec_step, k) for k in ("H", "HV", "K", "V", "L", "T")}
    _write(args, rows_out, f"median of {args.repeats} interleaved repeats of {args.calls} calls; conv stubbed, "
           f"verify {verify}", shape)


def _write(args, rows_out, method, shape):
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python"] + sys.argv), "machine": platform.machine(), "cpus": os.cpu_count(),
           "python": sys.version.split()[0], "torch": torch.__version__, "shape": shape, "method": method,
           "gpu": torch.cuda.get_device_name() if args.cuda else None,
           "verify_tokens_per_row": args.verify or None, "baseline": args.baseline, "rows": rows_out}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def _tma_pick(rows: int) -> str:
    from replayssm_patch.ops.launch import pick_decode_launch

    return pick_decode_launch(rows, HV, torch.float32, torch.float32, L, "cpu", tma=True).name


if __name__ == "__main__":
    main()
