#!/usr/bin/env python3
"""Kernel benchmark, speculative decoding: our ring verify vs vLLM's native GDN spec kernel.

    python benchmarks/kernel_spec.py --vllm-root DIR [--out-dir benchmarks/results]
    python benchmarks/kernel_spec.py --vllm-root DIR --smoke      # CPU, TRITON_INTERPRET=1

Arms, in one process on one GPU, on the same inputs:

* native: `fused_sigmoid_gating_delta_rule_update` (vLLM's FLA kernel, loaded from the file in
  an unpacked vLLM tree or an installed vLLM) with 1+T state slots per request: it reads the
  slot of the last accepted token and writes the state after every token of the window;
* ours: `ring_verify` (one checkpoint slot per request + a 32-entry replay ring; the delayed
  commit of the previous window from num_accepted runs inside the same step): prep kernel per
  (row, key head), main kernel per (row, value head, BV value rows), finish kernel per (row,
  key head).

Shape: Qwen3.5-9B / Qwen3-Next GDN (H=16, HV=32, K=V=128), fp32 SSM state (Qwen3.5's
default), bf16 activations, fp32 ring (the integration's default for an fp32 state).
T = 4 and 8 drafts (windows of T+1 tokens), batch 16, 32, 64, 128, 256.

Timing: a step = one call per layer. Accepted counts are drawn per (step, row) uniformly in
1..T+1 (fixed seed, a table of S steps; a second "ours, all accepted" arm is the worst case
for the ring: it fills fastest and flushes most). For each arm a CUDA graph is captured over
S steps x NL layers (NL independent buffer sets so that NL x bytes per layer >= 256 MiB: a
layer's state is not still in L2 from the previous step); the graphs replay alternately, each
timed with CUDA events; the median over replays / (S x NL) is the time per layer-step. The
ring's state evolves across replays (cursors, flushes) as in a real run.

Before timing, a sanity check runs both kernels from the same state for two steps (the second
with random accepted counts) and reports the largest relative output difference.

GDN cache bytes per request at T = 7 (Qwen3.5-9B GDN layer, conv state bf16, vLLM's page =
conv + SSM state): native keeps 1+T pages, ours one page plus the ring.

Writes <out-dir>/kernel_spec.json (with `summary.speedup_b256_t8` and
`summary.gdn_cache_bytes_ratio_t7`) and <out-dir>/kernel_spec.md.

`--flashinfer` (issue 23) instead times FlashInfer's ReplaySSM MTP kernel
(`gated_delta_rule_mtp_ucache_flush`: verify, with a fold of a full ring into the checkpoint
in the same launch; its own 32-slot rings and per-row cursors, committed by the caller after
each window) beside ours and native in one rotation, with the state, activations and rings
all bf16 (the only state it takes) at its native windows of 4 and 8 tokens, batch 16 / 64 /
256; first a two-window sanity check of all three from one state. Writes
<out-dir>/kernel_spec_flashinfer.{json,md}; a FlashInfer that does not import is recorded as
the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from replayssm_patch.ops import VerifyLaunch, override_launch, ring_verify  # noqa: E402

H, HV, HEAD = 16, 32, 128
STATE_DTYPE = torch.float32
ACT_DTYPE = torch.bfloat16
RING_DTYPE = torch.float32
L = 32
TS = [4, 8]
BATCHES = [16, 32, 64, 128, 256]
STEPS = 8  # steps per captured graph (one acceptance table)
REPLAYS = 15
MIN_FOOTPRINT = 256 << 20
MAX_LAYERS = 32
VERIFY_LAUNCH = None  # a VerifyLaunch for ring_verify's main kernel; None: its default
# as the GPU tests' launches
SWEEP_LAUNCHES = [VerifyLaunch(bv, w) for bv, w in ((8, 1), (16, 1), (32, 1), (16, 2), (32, 2), (32, 4), (64, 4))]
SWEEP_CELLS = [(8, 256), (8, 64), (4, 16)]  # (T, batch)
CONV_KERNEL = 4
FI_RING_SLOTS = 32  # FlashInfer's ucache rings (a window of <= 16 live entries)
FI_WINDOWS = (4, 8)  # the ucache kernels' native windows (T + 1 tokens: T = 3 and 7 drafts)
FI_BATCHES = (16, 64, 256)
NATIVE_FILE = os.path.join("vllm", "third_party", "flash_linear_attention", "ops", "fused_sigmoid_gating.py")


# --------------------------------------------------------------------------------------------
# vLLM's native spec kernel, loaded from its source file
# --------------------------------------------------------------------------------------------

def load_native(vllm_root: str | None):
    """(fused_sigmoid_gating_delta_rule_update, where it came from).

    The module needs only torch and `vllm.triton_utils.{triton, tl}`; importing vLLM itself
    from an unpacked tree (no compiled extensions, no package metadata) would swap triton for
    a placeholder, so the file is loaded on its own with a stand-in `vllm.triton_utils`."""
    import triton
    import triton.language as tl

    if vllm_root:
        path = os.path.join(vllm_root, NATIVE_FILE)
    else:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("vLLM not found: pass --vllm-root DIR (an unpacked vLLM wheel)")
        path = os.path.join(os.path.dirname(list(spec.submodule_search_locations)[0]), NATIVE_FILE)
    if not os.path.isfile(path):
        raise SystemExit(f"{path} does not exist (--vllm-root must hold the vllm/ package folder)")
    version = "unknown"
    vfile = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(path)))), "_version.py")
    if os.path.isfile(vfile):
        import re

        m = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", open(vfile).read(), re.M)
        version = m.group(1) if m else version
    if "vllm.triton_utils" not in sys.modules:
        pkg = sys.modules.get("vllm") or types.ModuleType("vllm")
        pkg.__path__ = getattr(pkg, "__path__", [])
        tu = types.ModuleType("vllm.triton_utils")
        tu.triton, tu.tl = triton, tl
        sys.modules.setdefault("vllm", pkg)
        sys.modules["vllm.triton_utils"] = tu
    spec = importlib.util.spec_from_file_location("_native_fused_sigmoid_gating", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fused_sigmoid_gating_delta_rule_update, {"file": path, "vllm_version": version}


# --------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------

class Layer:
    """One layer's inputs for B requests x W tokens, our checkpoint + ring, native's 1+T slots."""

    def __init__(self, B, T, gen, dev, ours=True, native=True, shape=(H, HV, HEAD), fi=False):
        h, hv, kd = shape
        self.h, self.hv, self.kd = h, hv, kd
        W = T + 1
        self.B, self.T, self.W = B, T, W
        ntok = B * W
        self.qkv = torch.randn(ntok, 2 * h * kd + hv * kd, generator=gen, device=dev).to(ACT_DTYPE)
        # native takes q, k, v split (vLLM passes views; its launcher makes them contiguous):
        # pre-split contiguous copies, so no copy is timed
        q, k, v = torch.split(self.qkv, [h * kd, h * kd, hv * kd], dim=-1)
        self.q = q.reshape(1, ntok, h, kd).contiguous()
        self.k = k.reshape(1, ntok, h, kd).contiguous()
        self.v = v.reshape(1, ntok, hv, kd).contiguous()
        self.a = torch.randn(ntok, hv, generator=gen, device=dev).to(ACT_DTYPE)
        self.b = torch.randn(ntok, hv, generator=gen, device=dev).to(ACT_DTYPE)
        self.A_log = torch.rand(hv, generator=gen, device=dev) * 2 - 1
        self.dt_bias = torch.randn(hv, generator=gen, device=dev)
        self.cu = torch.arange(0, ntok + 1, W, dtype=torch.int32, device=dev)
        self.out = torch.empty(ntok, hv, kd, dtype=ACT_DTYPE, device=dev)
        s0 = torch.randn(B, hv, kd, kd, generator=gen, device=dev) * 0.05
        if ours:
            self.idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
            self.state = torch.zeros(B + 1, hv, kd, kd, dtype=STATE_DTYPE, device=dev)
            self.state[1:] = s0.to(STATE_DTYPE)
            self.ring_d = torch.zeros(B + 1, hv, L, kd, dtype=RING_DTYPE, device=dev)
            self.ring_k = torch.zeros(B + 1, h, L, kd, dtype=RING_DTYPE, device=dev)
            self.ring_g = torch.zeros(B + 1, hv, L, dtype=torch.float32, device=dev)
            self.cursor = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        if native:
            slots = B * W + 1
            self.nstate = torch.zeros(slots, hv, kd, kd, dtype=STATE_DTYPE, device=dev)
            self.nidx = torch.arange(1, slots, dtype=torch.int32, device=dev).view(B, W)
            self.nstate[self.nidx[:, 0].long()] = s0.to(STATE_DTYPE)
        if fi:  # FlashInfer's ucache pair: checkpoint + its own 32-slot rings, per-row cursors
            self.fstate = torch.zeros(B + 1, hv, kd, kd, dtype=STATE_DTYPE, device=dev)
            self.fstate[1:] = s0.to(STATE_DTYPE)
            self.fidx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
            self.k_cache = torch.zeros(B + 1, h, FI_RING_SLOTS, kd, dtype=ACT_DTYPE, device=dev)
            self.u_cache = torch.zeros(B + 1, hv, FI_RING_SLOTS, kd, dtype=ACT_DTYPE, device=dev)
            self.g_cache = torch.zeros(B + 1, hv, FI_RING_SLOTS, dtype=torch.float32, device=dev)
            self.hist_len = torch.zeros(B, dtype=torch.int32, device=dev)
            self.cache_base = torch.zeros(B, dtype=torch.int32, device=dev)
            self.fq, self.fk = self.q.view(B, W, h, kd), self.k.view(B, W, h, kd)
            self.fv = self.v.view(B, W, hv, kd)
            self.fa, self.fb = self.a.view(B, W, hv), self.b.view(B, W, hv)
            self.fout = torch.empty(B, W, hv, kd, dtype=ACT_DTYPE, device=dev)

    def redraw_inputs(self, gen):
        """Fresh random inputs in place (the split copies follow the packed qkv)."""
        for t in (self.qkv, self.a, self.b):
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))
        q, k, v = torch.split(self.qkv, [self.h * self.kd, self.h * self.kd, self.hv * self.kd], dim=-1)
        self.q.copy_(q.reshape(self.q.shape))
        self.k.copy_(k.reshape(self.k.shape))
        self.v.copy_(v.reshape(self.v.shape))

    def ours(self, acc):
        with override_launch(verify=VERIFY_LAUNCH):
            ring_verify(self.qkv, self.a, self.b, self.A_log, self.dt_bias, self.kd ** -0.5, self.state, self.out,
                        self.idx, self.cu, self.ring_d, self.ring_k, self.ring_g, self.cursor, acc, self.W)
        return self.out

    def flashinfer(self, fn, commit):
        """One window through `gated_delta_rule_mtp_ucache_flush` (verify; a row whose ring
        holds >= 16 - W + 1 entries folds it into its checkpoint first and restarts it), then
        the caller-owned commit of `commit` accepted tokens (its rows' ring length += commit)."""
        fn(self.A_log, self.fa, self.dt_bias, q=self.fq, k=self.fk, v=self.fv, b=self.fb,
           initial_state_source=self.fstate, initial_state_indices=self.fidx, scale=self.kd ** -0.5,
           output=self.fout, k_cache=self.k_cache, u_cache=self.u_cache, g_cache=self.g_cache,
           hist_len=self.hist_len, cache_base=self.cache_base, restart_hist_on_flush=True)
        self.hist_len.add_(commit)
        return self.fout

    def native(self, fn, acc):
        o, _ = fn(A_log=self.A_log, a=self.a, b=self.b, dt_bias=self.dt_bias, q=self.q, k=self.k, v=self.v,
                  scale=self.kd ** -0.5, initial_state=self.nstate, inplace_final_state=True,
                  cu_seqlens=self.cu, ssm_state_indices=self.nidx, num_accepted_tokens=acc,
                  use_qk_l2norm_in_kernel=True)
        return o


def bytes_per_layer(B, T, arm):
    W = T + 1
    st = HV * HEAD * HEAD * torch.tensor([], dtype=STATE_DTYPE).element_size()
    rb = torch.tensor([], dtype=RING_DTYPE).element_size()
    ring = HV * L * HEAD * rb + H * L * HEAD * rb + HV * L * 4
    io = B * W * (2 * H * HEAD + HV * HEAD + 2 * HV + HV * HEAD) * 2
    if arm == "native":
        return B * W * st + io
    return B * (st + ring) + io


def gdn_cache_bytes_per_request(T, ring_dtype=RING_DTYPE):
    """(native, ours) GDN cache bytes per request and layer (Qwen3.5-9B GDN layer)."""
    conv_dim = 2 * H * HEAD + HV * HEAD
    conv = (CONV_KERNEL - 1 + T) * conv_dim * 2  # bf16 conv state, rows for the drafts
    ssm = HV * HEAD * HEAD * torch.tensor([], dtype=STATE_DTYPE).element_size()
    rb = torch.tensor([], dtype=ring_dtype).element_size()
    ring = HV * L * 4 + HV * L * HEAD * rb + H * L * HEAD * rb
    return (1 + T) * (conv + ssm), conv + ssm + ring


def acceptance_table(B, T, steps, seed, mode, dev):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if mode == "all":
        t = torch.full((steps, B), T + 1, dtype=torch.int32)
    else:
        t = torch.randint(1, T + 2, (steps, B), generator=g, dtype=torch.int32)
    return [row.to(dev) for row in t]


# --------------------------------------------------------------------------------------------
# Sanity check: both kernels from the same state
# --------------------------------------------------------------------------------------------

def sanity(native_fn, dev, B=4, T=3, shape=(H, HV, HEAD)):
    gen = torch.Generator(device=dev).manual_seed(7)
    lay = Layer(B, T, gen, dev, shape=shape)
    worst = 0.0
    for step, acc in enumerate([torch.ones(B, dtype=torch.int32, device=dev),
                                torch.tensor([1, T + 1, 2, T][:B] + [1] * max(0, B - 4), dtype=torch.int32, device=dev)]):
        if step:  # new inputs for the second window
            lay.redraw_inputs(gen)
        o_ours = lay.ours(acc).float().clone()
        o_nat = lay.native(native_fn, acc).float().reshape(o_ours.shape)
        err = float((o_ours - o_nat).norm() / o_nat.norm())
        worst = max(worst, err)
    return worst


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up (compiles) outside the graph
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def cell_layers(B, T, dev):
    """Enough independent layers per arm that a step's footprint is >= MIN_FOOTPRINT (a
    layer's state is not still in L2 from the previous step): (ours, native) lists."""
    gen = torch.Generator(device=dev).manual_seed(B * 100 + T)
    nl_o = max(1, min(MAX_LAYERS, math.ceil(MIN_FOOTPRINT / bytes_per_layer(B, T, "ours"))))
    nl_n = max(1, min(MAX_LAYERS, math.ceil(MIN_FOOTPRINT / bytes_per_layer(B, T, "native"))))
    return ([Layer(B, T, gen, dev, native=False) for _ in range(nl_o)],
            [Layer(B, T, gen, dev, ours=False) for _ in range(nl_n)])


def arm_steps(layers, table, call):
    """One arm's graph body: every step of the acceptance table through every layer."""
    def f():
        for acc in table:
            for lay in layers:
                call(lay, acc)
    return f


def median_us(graphs, replays):
    """graphs: name -> (CUDA graph of STEPS steps, layers); replayed in rotation after one
    settling replay each; the median microseconds per layer-step per name."""
    for g, _ in graphs.values():  # settle the ring's cursors into their steady state
        g.replay()
    torch.cuda.synchronize()
    times = {k: [] for k in graphs}
    for _ in range(replays):
        for name, (g, nl) in graphs.items():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            times[name].append(e0.elapsed_time(e1) * 1e3 / (STEPS * nl))
    return {k: statistics.median(v) for k, v in times.items()}


def time_cell(native_fn, B, T, dev):
    ours, nat = cell_layers(B, T, dev)
    nl_o, nl_n = len(ours), len(nat)
    acc_u = acceptance_table(B, T, STEPS, seed=B + T, mode="uniform", dev=dev)
    acc_all = acceptance_table(B, T, STEPS, seed=0, mode="all", dev=dev)

    def run_ours(table):
        return arm_steps(ours, table, lambda lay, acc: lay.ours(acc))

    # (ours and ours_all_accepted share the ring buffers: each replay continues from the cursors
    # the last one left)
    graphs = {"ours": (_capture(run_ours(acc_u)), nl_o), "ours_all_accepted": (_capture(run_ours(acc_all)), nl_o),
              "native": (_capture(arm_steps(nat, acc_u, lambda lay, acc: lay.native(native_fn, acc))), nl_n)}
    med = median_us(graphs, REPLAYS)
    ok = all(torch.isfinite(lay.out.float()).all() for lay in ours)
    graphs.clear(), ours.clear(), nat.clear()  # free the buffers before the next cell
    torch.cuda.empty_cache()
    return {"B": B, "T": T, "layers_ours": nl_o, "layers_native": nl_n,
            "us_native": med["native"], "us_ours": med["ours"], "us_ours_all_accepted": med["ours_all_accepted"],
            "speedup": med["native"] / med["ours"],
            "speedup_all_accepted": med["native"] / med["ours_all_accepted"],
            "native_GBps": bytes_per_layer(B, T, "native") / (med["native"] * 1e-6) / 1e9,
            "ours_outputs_finite": bool(ok)}


def profile_cells(native_fn, dev, out_dir, cells=((8, 256), (4, 16))):
    """Where a verify step's time goes: device time per kernel (torch profiler, eager launches
    after warm-up) for ours and native, and what the bytes each arm must move would cost at the
    measured copy bandwidth (the memory roofline)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.kernel_decode import copy_bandwidth  # the decode benchmark's measurement

    bw = copy_bandwidth()
    rows = []
    for T, B in cells:
        ours, nat = cell_layers(B, T, dev)
        table = acceptance_table(B, T, STEPS, seed=B + T, mode="uniform", dev=dev)
        arms = {"ours": (arm_steps(ours, table, lambda lay, acc: lay.ours(acc)), len(ours)),
                "native": (arm_steps(nat, table, lambda lay, acc: lay.native(native_fn, acc)), len(nat))}
        cell = {"T": T, "B": B, "copy_bandwidth_TBps": bw / 1e12}
        for name, (fn, nl) in arms.items():
            fn()  # compile and settle the cursors
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            per_kernel = {}
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None)
                if t is None:
                    t = ev.cuda_time_total
                if t > 0 and ev.count > 0:
                    per_kernel[ev.key] = round(t / (STEPS * nl), 2)
            cell[name] = {"us_per_layer_step_by_kernel": per_kernel,
                          "us_per_layer_step": round(sum(per_kernel.values()), 2),
                          "roofline_us": round(bytes_per_layer(B, T, name) / bw * 1e6, 2)}
        rows.append(cell)
        print(json.dumps(cell), flush=True)
        ours.clear(), nat.clear()
        torch.cuda.empty_cache()
    path = os.path.join(out_dir, "kernel_spec_profile.json")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cells": rows,
                   "note": "eager launches under torch.profiler; kernel names as the profiler reports them"},
                  f, indent=1)
    print("wrote", path)


def sweep(native_fn, dev, out_dir):
    """The main kernel's launches (SWEEP_LAUNCHES) at a few cells, native in the same graphs'
    rotation; prints one line per launch and writes kernel_spec_sweep.json."""
    global VERIFY_LAUNCH
    rows = []
    for T, B in SWEEP_CELLS:
        ours, nat = cell_layers(B, T, dev)
        acc_u = acceptance_table(B, T, STEPS, seed=B + T, mode="uniform", dev=dev)
        graphs = {"native": (_capture(arm_steps(nat, acc_u, lambda lay, acc: lay.native(native_fn, acc))), len(nat))}
        for cfg in SWEEP_LAUNCHES:
            VERIFY_LAUNCH = cfg  # read by Layer.ours while the graph is captured
            try:
                graphs[cfg] = (_capture(arm_steps(ours, acc_u, lambda lay, acc: lay.ours(acc))), len(ours))
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(f"T={T} B={B} {cfg}: failed: {e!r}"[:300], flush=True)
        VERIFY_LAUNCH = None
        med = median_us(graphs, 5)
        for key, us in med.items():
            if key == "native":
                continue
            row = {"T": T, "B": B, "launch": [key.block_v, key.num_warps], "us_ours": us, "us_native": med["native"],
                   "speedup": med["native"] / us}
            rows.append(row)
            print(json.dumps({k: (round(x, 2) if isinstance(x, float) else x) for k, x in row.items()}), flush=True)
        graphs.clear(), ours.clear(), nat.clear()
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernel_spec_sweep.json"), "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


def load_flashinfer():
    """(FlashInfer's `gated_delta_rule_mtp_ucache_flush`, its version), or (None, why not)."""
    try:
        import flashinfer
        from flashinfer.gdn_kernels.gdn_decode_bf16_wy_ucache_flush import gated_delta_rule_mtp_ucache_flush
    except Exception as e:  # reported, not fatal: the other arms still run
        return None, f"{type(e).__name__}: {e}"
    return gated_delta_rule_mtp_ucache_flush, getattr(flashinfer, "__version__", "unknown")


def flashinfer_sanity(native_fn, fi_fn, dev, B=4, T=3):
    """Two windows from the same state through the three arms (the second after mixed
    accepted counts): each arm's relative output difference from native's."""
    gen = torch.Generator(device=dev).manual_seed(7)
    lay = Layer(B, T, gen, dev, fi=True)
    accs = [torch.ones(B, dtype=torch.int32, device=dev),
            torch.tensor([1, T + 1, 2, T][:B] + [1] * max(0, B - 4), dtype=torch.int32, device=dev)]
    worst = {"ours": 0.0, "flashinfer": 0.0}
    for step, acc in enumerate(accs):
        if step:  # new inputs for the second window (FlashInfer's q/k/v/a/b are views of these)
            lay.redraw_inputs(gen)
        o_nat = lay.native(native_fn, acc).float().reshape(lay.out.shape).clone()
        outs = {"ours": lay.ours(acc).float().clone(),
                # its commit comes after the call: the next window's accepted count
                "flashinfer": lay.flashinfer(fi_fn, accs[min(step + 1, len(accs) - 1)]).float().reshape(lay.out.shape)}
        for name, o in outs.items():
            worst[name] = max(worst[name], float((o - o_nat).norm() / o_nat.norm()))
    return worst


def flashinfer_run(native_fn, info, dev, out_dir, command):
    """Issue 23: FlashInfer's ReplaySSM MTP kernel beside ours and vLLM's, bf16 state (the
    only state it takes), windows of 4 and 8 tokens (its native ones), in one rotation."""
    fi_fn, fi_version = load_flashinfer()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "native": info,
           "flashinfer": fi_version if fi_fn else None, "shape": {"H": H, "HV": HV, "K": HEAD, "V": HEAD},
           "state": "bf16", "ring_ours": f"bf16, L={L}", "ring_flashinfer": f"bf16, {FI_RING_SLOTS} slots",
           "steps_per_graph": STEPS, "replays": REPLAYS, "command": command, "cells": []}
    if fi_fn is None:
        res["flashinfer_unavailable"] = fi_version
        print("FlashInfer unavailable:", fi_version, flush=True)
    else:
        res["sanity_rel_diff_vs_native"] = flashinfer_sanity(native_fn, fi_fn, dev)
        print("sanity (rel diff vs native):", res["sanity_rel_diff_vs_native"], flush=True)
        for W in FI_WINDOWS:
            T = W - 1
            for B in FI_BATCHES:
                gen = torch.Generator(device=dev).manual_seed(B * 100 + T)
                nl = max(1, min(MAX_LAYERS, math.ceil(MIN_FOOTPRINT / bytes_per_layer(B, T, "ours"))))
                nl_n = max(1, min(MAX_LAYERS, math.ceil(MIN_FOOTPRINT / bytes_per_layer(B, T, "native"))))
                arms = {"ours": [Layer(B, T, gen, dev, native=False) for _ in range(nl)],
                        "native": [Layer(B, T, gen, dev, ours=False) for _ in range(nl_n)],
                        "flashinfer": [Layer(B, T, gen, dev, ours=False, native=False, fi=True) for _ in range(nl)]}
                table = acceptance_table(B, T, STEPS, seed=B + T, mode="uniform", dev=dev)
                calls = {"ours": lambda lay, acc: lay.ours(acc),
                         "native": lambda lay, acc: lay.native(native_fn, acc),
                         "flashinfer": lambda lay, acc: lay.flashinfer(fi_fn, acc)}
                graphs = {k: (_capture(arm_steps(arms[k], table, calls[k])), len(arms[k])) for k in arms}
                med = median_us(graphs, REPLAYS)
                cell = {"window": W, "T": T, "B": B, **{f"us_{k}": v for k, v in med.items()},
                        "flashinfer_over_ours": med["flashinfer"] / med["ours"],
                        "native_over_ours": med["native"] / med["ours"],
                        "native_over_flashinfer": med["native"] / med["flashinfer"],
                        "finite": bool(all(torch.isfinite(lay.fout.float()).all() for lay in arms["flashinfer"])
                                       and all(torch.isfinite(lay.out.float()).all() for lay in arms["ours"]))}
                res["cells"].append(cell)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in cell.items()}), flush=True)
                graphs.clear(), arms.clear()
                torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernel_spec_flashinfer.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["# Speculative verify, bf16 state: ours vs vLLM native vs FlashInfer's ucache MTP kernel", "",
             f"{res['device']}, torch {res['torch']}, native from vLLM {info['vllm_version']}, FlashInfer "
             f"{res['flashinfer']}; H={H}, HV={HV}, K=V={HEAD}; bf16 state, activations and rings (ours L={L}, "
             f"FlashInfer {FI_RING_SLOTS} slots, lazy flush); CUDA graphs, median of {REPLAYS} replays of {STEPS} "
             "steps; us per layer-step. Accepted counts uniform in 1..window.", ""]
    if fi_fn is None:
        lines.append(f"FlashInfer unavailable: {fi_version}")
    else:
        lines += [f"Sanity (two windows from one state, relative output difference from native): "
                  f"{res['sanity_rel_diff_vs_native']}", "",
                  "| window | batch | native | ours | FlashInfer | native / ours | native / FlashInfer | FlashInfer / ours |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in res["cells"]:
            lines.append(f"| {c['window']} | {c['B']} | {c['us_native']:.1f} | {c['us_ours']:.1f} | "
                         f"{c['us_flashinfer']:.1f} | {c['native_over_ours']:.2f} | {c['native_over_flashinfer']:.2f} | "
                         f"{c['flashinfer_over_ours']:.2f} |")
    lines += ["", f"Command: `{command}`"]
    with open(os.path.join(out_dir, "kernel_spec_flashinfer.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_results(res, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernel_spec.json"), "w") as f:
        json.dump(res, f, indent=1)
    s = res["summary"]
    lines = [
        "# Speculative verify kernel: ours (1 slot + ring) vs vLLM native (1+T slots)",
        "",
        f"{res['device']}, torch {res['torch']}, triton {res['triton']}, native from vLLM "
        f"{res['native']['vllm_version']}; H={H}, HV={HV}, K=V={HEAD}, fp32 state, bf16 activations, "
        f"fp32 ring of L={L}; CUDA graphs, median of {REPLAYS} replays of {STEPS} steps; "
        "time per layer-step in microseconds. Accepted counts uniform in 1..T+1 "
        "(\"all accepted\": every window fully accepted, the ring's worst case). \"ours\" is "
        "`ring_verify` (prep kernel per (row, key head), main kernel per (row, value head, BV value "
        "rows), finish kernel per (row, key head)).",
        "",
        f"Sanity check (same state, two steps, T=3, B=4): max relative output difference "
        f"{res['sanity_rel_diff']:.2e}.",
        "",
        "| T | batch | native us | ours us | speedup | ours all-accepted us | speedup all-accepted |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in res["cells"]:
        lines.append(f"| {c['T']} | {c['B']} | {c['us_native']:.1f} | {c['us_ours']:.1f} | {c['speedup']:.2f}x | "
                     f"{c['us_ours_all_accepted']:.1f} | {c['speedup_all_accepted']:.2f}x |")
    lines += [
        "",
        f"speedup at batch 256, T=8: {s['speedup_b256_t8']:.2f}x (all accepted: "
        f"{s['speedup_b256_t8_all_accepted']:.2f}x)",
        "",
        f"GDN cache bytes per request and layer at T=7 (conv + SSM state pages; ours + fp32 ring, L={L}): "
        f"native {s['gdn_cache_bytes_t7']['native']} B, ours {s['gdn_cache_bytes_t7']['ours']} B, "
        f"ratio {s['gdn_cache_bytes_ratio_t7']:.2f}x (bf16 ring: {s['gdn_cache_bytes_ratio_t7_bf16_ring']:.2f}x)",
        "",
        f"Command: `{res['command']}`",
    ]
    with open(os.path.join(out_dir, "kernel_spec.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def cache_summary():
    nat, ours = gdn_cache_bytes_per_request(7)
    _, ours16 = gdn_cache_bytes_per_request(7, torch.bfloat16)
    return {"gdn_cache_bytes_t7": {"native": nat, "ours": ours}, "gdn_cache_bytes_ratio_t7": nat / ours,
            "gdn_cache_bytes_ratio_t7_bf16_ring": nat / ours16}


def smoke(native_fn, info):
    """CPU run under TRITON_INTERPRET=1: the wiring of all arms at a tiny shape (no timing)."""
    err = sanity(native_fn, "cpu", B=4, T=3, shape=(2, 4, 32))
    print(json.dumps({"smoke": True, "native": info, "sanity_rel_diff": err, **cache_summary()}))
    # ragged acceptance over several steps, every arm finite
    gen = torch.Generator(device="cpu").manual_seed(1)
    lay = Layer(3, 2, gen, "cpu", shape=(2, 4, 32))
    for acc in acceptance_table(3, 2, 4, seed=3, mode="uniform", dev="cpu"):
        assert torch.isfinite(lay.ours(acc).float()).all()
        assert torch.isfinite(lay.native(native_fn, acc).float()).all()
    if err > 2e-2:
        raise SystemExit(f"sanity check failed: ours vs native rel diff {err}")
    return err


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-root", default=None, help="folder holding an unpacked vllm/ package")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU wiring check under TRITON_INTERPRET=1")
    ap.add_argument("--launch", default=None, metavar="BV,WARPS",
                    help="the main kernel's launch (default: VerifyLaunch())")
    ap.add_argument("--sweep", action="store_true",
                    help="time the main kernel's launches at a few cells, then stop")
    ap.add_argument("--flashinfer", action="store_true",
                    help="bf16 state: FlashInfer's ucache MTP kernel beside ours and native at windows of 4 and 8 "
                         "tokens, to kernel_spec_flashinfer.{json,md}, then stop")
    ap.add_argument("--profile", action="store_true",
                    help="device time per kernel and the memory roofline at T=8/B=256 and T=4/B=16, then stop")
    args = ap.parse_args(argv)
    global VERIFY_LAUNCH
    if args.launch:
        VERIFY_LAUNCH = VerifyLaunch(*(int(x) for x in args.launch.split(",")))
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment")
    native_fn, info = load_native(args.vllm_root)
    if args.smoke:
        smoke(native_fn, info)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke on the CPU)")
    import triton

    t0 = time.time()
    dev = "cuda"
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))
    if args.flashinfer:
        global STATE_DTYPE, RING_DTYPE
        STATE_DTYPE = RING_DTYPE = torch.bfloat16  # the only state the ucache kernels take
        flashinfer_run(native_fn, info, dev, args.out_dir, command)
        return 0
    err = sanity(native_fn, dev)
    if args.sweep:
        sweep(native_fn, dev, args.out_dir)
        return 0
    if args.profile:
        profile_cells(native_fn, dev, args.out_dir)
        return 0
    print(f"sanity: ours vs native max rel output diff {err:.2e}", flush=True)
    if err > 2e-2:
        raise SystemExit(f"sanity check failed: ours vs native rel diff {err}")
    cells = []
    for T in TS:
        for B in BATCHES:
            c = time_cell(native_fn, B, T, dev)
            cells.append(c)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in c.items()}), flush=True)
    pick = next(c for c in cells if c["B"] == 256 and c["T"] == 8)
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
        "native": info, "shape": {"H": H, "HV": HV, "K": HEAD, "V": HEAD, "L": L, "state": "fp32",
                                  "activations": "bf16", "ring": str(RING_DTYPE).replace("torch.", "")},
        "steps_per_graph": STEPS, "replays": REPLAYS, "sanity_rel_diff": err, "cells": cells,
        "launch": dataclasses.asdict(VERIFY_LAUNCH or VerifyLaunch()),
        "summary": {"speedup_b256_t8": pick["speedup"], "speedup_b256_t8_all_accepted": pick["speedup_all_accepted"],
                    **cache_summary()},
        "seconds": round(time.time() - t0, 1),
        "command": command,
    }
    write_results(res, args.out_dir)
    print(json.dumps(res["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
