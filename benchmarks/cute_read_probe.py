"""How close to copy bandwidth can a TMA-pipelined CuTe DSL kernel read a batch of state tiles?

The question this probe answers: our Triton GDN decode kernels reach 64-80% of a
bytes / copy-bandwidth roofline at batch 64-512 on an H200. Would a CuTe DSL ring-decode kernel,
with a TMA producer warp feeding an mbarrier pipeline, get to 80-90%? Before writing that
kernel, this probe measures the ceiling of its memory side: it reads recurrent-state tiles with
the same access pattern and does only the minimal work a decode step needs per tile, one
mat-vec:

    S: [N, 128, 128] (bf16 or fp32, contiguous; one [128, 128] tile = one (request, value head)
       state h[v, k]),  q: [N, 128] fp32,  o: [N, 128] fp32,
    o[n, v] = sum_k S[n, v, k] * q[n, k]   (fp32 accumulation),   N = B * 32.

The kernel is persistent (grid = SMs x CTAs-per-SM; CTA c takes tiles c, c + grid, ...). Its
last warp is a TMA producer: it copies [BV, 128] row blocks of each tile into a `stages`-deep
shared-memory ring guarded by full/empty mbarriers (`cutlass.pipeline.PipelineTmaAsync`).
Four consumer warps wait on a block, compute the dot products on CUDA cores in fp32 (a warp
covers one (fp32) or two (bf16) rows per 16-byte load; a butterfly shuffle finishes each row),
release the block and write o. Variants sweep BV, stages and CTAs per SM.

Run:

    # anywhere, no GPU and no torch needed: compile every variant for sm_90a and check that the
    # PTX holds the TMA copies (cp.async.bulk.tensor) and the mbarrier waits
    python benchmarks/cute_read_probe.py --compile-only

    # on the GPU (torch + nvidia-cutlass-dsl): check every variant against a float64 reference,
    # time it, and write DIR/cute_read_probe.json and DIR/cute_read_probe.md
    python benchmarks/cute_read_probe.py --out DIR

Timing: each (variant, batch) is a CUDA graph of back-to-back launches that cycles over enough
copies of (S, q, o) (>= 256 MiB together) that a launch never finds its tiles in L2 from the
previous one; the time per launch is the median over graph replays (CUDA events) / launches.
The same is done for a torch.bmm reference. Copy bandwidth is kernel_decode.py's (a 4 GiB
`dst.copy_(src)`, read + write bytes counted), the measure its roofline fractions use. fraction = (bytes read + written by the kernel / copy bandwidth) /
kernel time: 1.0 would be a kernel as fast as a copy of its bytes.
"""

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass

HEADS = 32  # value heads per request: N = B * HEADS tiles
DIM = 128  # tile is [DIM (v), DIM (k)]
BATCHES = (16, 32, 64, 128, 256, 512)
CONSUMER_WARPS = 4
SMEM_PER_SM = 228 * 1024  # H100/H200 shared memory per SM (227 KiB at most per CTA)
SMEM_RESERVED_PER_CTA = 1024  # the system's share of each CTA's shared memory
L2_SAFE_BYTES = 256 << 20  # (S, q, o) copies a timing graph cycles through, so L2 never holds them
LAUNCHES_PER_GRAPH = 20
REPS = 30


@dataclass(frozen=True)
class Variant:
    dtype: str  # "bf16" or "fp32": the state dtype
    bv: int  # rows of a tile per TMA copy / pipeline stage
    stages: int  # depth of the shared-memory ring
    ctas_per_sm: int  # grid = SMs x this

    @property
    def elem_bytes(self):
        return 2 if self.dtype == "bf16" else 4

    @property
    def stage_bytes(self):
        return self.bv * DIM * self.elem_bytes

    @property
    def name(self):
        return f"{self.dtype}_bv{self.bv}_s{self.stages}_c{self.ctas_per_sm}"


# 64-192 KiB of ring per SM. Little's law wants only ~30-40 KiB in flight per SM at H200 bandwidth
# and DRAM latency; the sweep asks whether more depth, bigger copies or more CTAs (independent
# rings, overlapping one CTA's consumer tail with another's loads) buy anything beyond that.
_SWEEP = {
    "bf16": [(32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 6, 2), (128, 3, 2), (64, 8, 1), (128, 6, 1),
             (32, 8, 3)],
    "fp32": [(32, 4, 2), (32, 6, 2), (64, 2, 2), (64, 3, 2), (32, 8, 1), (64, 6, 1), (128, 3, 1),
             (32, 4, 3)],
}
VARIANTS = [Variant(dt, bv, st, c) for dt, rows in _SWEEP.items() for bv, st, c in rows]
for _v in VARIANTS:  # the rings of all CTAs of an SM must fit at once, or the CTAs serialise
    # + 128: the mbarriers and the ring's alignment
    assert _v.ctas_per_sm * (_v.stages * _v.stage_bytes + 128 + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM, _v


# ---------------------------------------------------------------------------------------------
# Kernel (CuTe DSL). Imported lazily so that --help works without the DSL.
# ---------------------------------------------------------------------------------------------

def make_kernel(v: Variant):
    """The @cute.jit host function of variant v: (S, q, o, num_ctas, stream) -> launch."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass.cute.nvgpu import cpasync
    import cuda.bindings.driver as cuda

    dtype = cutlass.BFloat16 if v.dtype == "bf16" else cutlass.Float32
    bv, stages = v.bv, v.stages
    vec = 16 // v.elem_bytes  # elements per 16-byte shared-memory load
    lanes_per_row = DIM // vec  # 32 (fp32) or 16 (bf16): lanes that share one row
    consumer_threads = CONSUMER_WARPS * 32
    row_groups = consumer_threads // lanes_per_row  # rows the consumers load in one step
    assert bv % row_groups == 0 and DIM % bv == 0
    rows_per_thread = bv // row_groups
    blocks_per_tile = DIM // bv
    shuffle_offsets = tuple(lanes_per_row >> i for i in range(1, lanes_per_row.bit_length()))
    producer_warp = CONSUMER_WARPS  # the warp after the consumers

    @cute.struct
    class SharedStorage:
        barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]  # full + empty per stage
        ring: cute.struct.Align[cute.struct.MemRange[dtype, stages * bv * DIM], 128]

    @cute.kernel
    def kernel(tma_atom: cute.CopyAtom, mS_tma: cute.Tensor, mQ: cute.Tensor, mO: cute.Tensor,
               ring_layout: cute.Layout):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        n_tiles = mQ.shape[0]

        if warp == producer_warp:
            cpasync.prefetch_descriptor(tma_atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # Full barrier: one arrive (the producer's expect-tx) plus the TMA bytes. Empty barrier:
        # one arrive per consumer warp (PipelineTmaAsync lets lane 0 of each warp signal).
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_WARPS),
            tx_count=bv * DIM * v.elem_bytes,
        )
        sS = storage.ring.get_tensor(ring_layout)  # (bv, DIM, stages)

        if warp == producer_warp:
            # (bv, DIM, row blocks of all tiles): row block n * blocks_per_tile + b is block b of tile n
            gS = cute.local_tile(mS_tma, (bv, DIM), (None, 0))
            tSs, tSg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                             cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            for n in cutlass.range(cta, n_tiles, num_ctas, unroll=1):
                for b in cutlass.range_constexpr(blocks_per_tile):
                    pipe.producer_acquire(state)  # wait for an empty slot, arm its expect-tx
                    cute.copy(tma_atom, tSg[(None, n * blocks_per_tile + b)], tSs[(None, state.index)],
                              tma_bar_ptr=pipe.producer_get_barrier(state))
                    state.advance()
            pipe.producer_tail(state)  # do not exit with copies the consumers still hold
        else:
            # Thread t reads 16-byte chunk `col` of rows row0, row0 + row_groups, ...: a warp reads
            # whole contiguous rows, so the shared-memory loads are free of bank conflicts.
            col = tidx % lanes_per_row
            row0 = tidx // lanes_per_row
            sS_vec = cute.zipped_divide(sS, (1, vec))  # ((1, vec), (bv, DIM / vec, stages))
            q_vec = cute.zipped_divide(mQ, (1, vec))  # ((1, vec), (N, DIM / vec))
            q_frag = cute.make_rmem_tensor((1, vec), cutlass.Float32)
            s_frag = cute.make_rmem_tensor((1, vec), dtype)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            for n in cutlass.range(cta, n_tiles, num_ctas, unroll=1):
                cute.autovec_copy(q_vec[(None, (n, col))], q_frag)
                qk = q_frag.load()
                for b in cutlass.range_constexpr(blocks_per_tile):
                    pipe.consumer_wait(state)
                    for i in cutlass.range_constexpr(rows_per_thread):
                        row = row0 + i * row_groups
                        cute.autovec_copy(sS_vec[(None, (row, col, state.index))], s_frag)
                        acc = (s_frag.load().to(cutlass.Float32) * qk).reduce(
                            cute.ReductionOp.ADD, cutlass.Float32(0.0), reduction_profile=0)
                        for k in cutlass.range_constexpr(len(shuffle_offsets)):  # butterfly over the row
                            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=shuffle_offsets[k])
                        if col == 0:
                            mO[n, b * bv + row] = acc
                    cute.arch.sync_warp()  # every lane is done with the slot before lane 0 frees it
                    pipe.consumer_release(state)
                    state.advance()

    @cute.jit
    def launch(mS: cute.Tensor, mQ: cute.Tensor, mO: cute.Tensor, num_ctas: cutlass.Int32,
               stream: cuda.CUstream):
        # The TMA sees S as one [N * 128, 128] row-major matrix; contiguity is the host's contract.
        rows = mQ.shape[0] * DIM
        s2d = cute.make_tensor(mS.iterator, cute.make_layout((rows, DIM), stride=(DIM, 1)))
        ring_layout = cute.make_layout((bv, DIM, stages), stride=(DIM, 1, bv * DIM))
        tma_atom, mS_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), s2d, cute.select(ring_layout, mode=[0, 1]), (bv, DIM))
        kernel(tma_atom, mS_tma, mQ, mO, ring_layout).launch(
            grid=[num_ctas, 1, 1], block=[consumer_threads + 32, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream)

    return launch


def _fake_args(v: Variant):
    """Fake tensors with a dynamic tile count, as from_dlpack(...).mark_compact_shape_dynamic(0)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor, make_fake_stream

    dtype = cutlass.BFloat16 if v.dtype == "bf16" else cutlass.Float32
    n = cute.sym_int()
    s = make_fake_tensor(dtype, (n, DIM, DIM), stride=(DIM * DIM, DIM, 1), assumed_align=16)
    q = make_fake_tensor(cutlass.Float32, (n, DIM), stride=(DIM, 1), assumed_align=16)
    o = make_fake_tensor(cutlass.Float32, (n, DIM), stride=(DIM, 1), assumed_align=16)
    return s, q, o, cutlass.Int32(1), make_fake_stream()


def compile_variant(v: Variant, args, options=None):
    import cutlass.cute as cute

    fn = make_kernel(v)
    return cute.compile(fn, *args, options=options) if options else cute.compile(fn, *args)


# ---------------------------------------------------------------------------------------------
# --compile-only
# ---------------------------------------------------------------------------------------------

def compile_only() -> int:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="cute_read_probe_") as dump:
        for v in VARIANTS:
            vdir = os.path.join(dump, v.name)
            os.makedirs(vdir)
            try:
                compile_variant(v, _fake_args(v), options=f"--keep-ptx --dump-dir {vdir}")
            except Exception as e:  # report every variant, then fail as a whole
                failed += 1
                print(f"{v.name:<22} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                      flush=True)
                continue
            ptx = "".join(open(os.path.join(r, f)).read() for r, _, fs in os.walk(vdir)
                          for f in fs if f.endswith(".ptx"))
            tma = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
            waits = len(re.findall(r"mbarrier\.try_wait", ptx))
            ok = tma > 0 and waits > 0
            failed += not ok
            print(f"{v.name:<22} compiled  smem/CTA {v.stages * v.stage_bytes // 1024:>3} KiB  "
                  f"ptx: cp.async.bulk.tensor x{tma}, mbarrier.try_wait x{waits}"
                  + ("" if ok else "  FAILED: no TMA copy or mbarrier wait in the PTX"), flush=True)
    print(f"{len(VARIANTS) - failed}/{len(VARIANTS)} variants compiled for "
          f"{os.environ['CUTE_DSL_ARCH']}", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# GPU run
# ---------------------------------------------------------------------------------------------

def _kernel_decode():
    """benchmarks/kernel_decode.py, whose timing and copy-bandwidth helpers the GPU run shares
    (imported here only: it needs torch, which --compile-only does not)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import kernel_decode

    return kernel_decode


def _graph_time_us(torch, launches, reps=REPS):
    """Capture `launches` (callables) in one CUDA graph; median us per launch over replays
    (kernel_decode.time_graphs: CUDA events, warm-up replays first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in launches:  # warm up outside the capture (module load, descriptor creation)
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in launches:
            f()
    ms = _kernel_decode().time_graphs({"probe": graph}, reps)["probe"]
    return statistics.median(ms) * 1e3 / len(launches)


@dataclass
class Operands:
    """One copy of a batch's operands: torch tensors, their CuTe views, the bmm reference's."""
    s: object
    q: object
    o: object
    cute_args: tuple  # (S, q, o) from_dlpack views, made once so launches do not rebuild them
    q_bmm: object  # q in the state dtype as [N, 128, 1]: torch.bmm wants one dtype
    o_bmm: object


def _make_operands(torch, from_dlpack, n, tdt, gen):
    def as_cute(t):
        # 16-byte alignment is what the TMA and the vector loads assume; only N is dynamic.
        return from_dlpack(t, assumed_align=16).mark_compact_shape_dynamic(
            mode=0, stride_order=t.dim_order())

    s = torch.randn(n, DIM, DIM, device="cuda", generator=gen).to(tdt)
    q = torch.randn(n, DIM, device="cuda", generator=gen)
    o = torch.empty(n, DIM, device="cuda")
    q_bmm = q.to(tdt)[..., None]
    return Operands(s, q, o, (as_cute(s), as_cute(q), as_cute(o)), q_bmm, torch.empty_like(q_bmm))


def gpu_run(out_dir: str) -> int:
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device; use --compile-only on a machine without a GPU")
    import cutlass
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import from_dlpack

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    copy_bw = _kernel_decode().copy_bandwidth()  # the same measure as the kernel benchmark's roofline
    print(f"{props.name}: {sms} SMs, copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)

    def current_stream():  # inside graph capture this is the capturing stream
        return cuda.CUstream(torch.cuda.current_stream().cuda_stream)

    compiled = {}  # Variant -> compiled launch; N is dynamic, so one compile serves every batch
    rows = []
    for dt_name, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        tol = 1e-2 if dt_name == "bf16" else 1e-3
        for batch in BATCHES:
            n = batch * HEADS
            nbytes = n * DIM * DIM * tdt.itemsize + 2 * n * DIM * 4  # S + q read, o written
            copies = max(1, min(64, math.ceil(L2_SAFE_BYTES / nbytes)))
            gen = torch.Generator(device="cuda").manual_seed(1000 + batch)
            ops = [_make_operands(torch, from_dlpack, n, tdt, gen) for _ in range(copies)]
            order = [ops[i % copies] for i in range(copies * math.ceil(LAUNCHES_PER_GRAPH / copies))]
            ref = torch.bmm(ops[0].s.double(), ops[0].q.double()[..., None])[..., 0]

            times, errs = {}, {}
            for v in (v for v in VARIANTS if v.dtype == dt_name):
                ctas = sms * v.ctas_per_sm
                if v not in compiled:
                    compiled[v] = compile_variant(v, (*ops[0].cute_args, cutlass.Int32(ctas), current_stream()))
                fn = compiled[v]
                ops[0].o.fill_(float("nan"))  # an output the kernel does not write stays NaN
                fn(*ops[0].cute_args, ctas, current_stream())
                torch.cuda.synchronize()
                errs[v] = ((ops[0].o.double() - ref).abs().max() / ref.abs().max()).item()
                if not errs[v] < tol:  # also catches NaN
                    sys.exit(f"error: {v.name} B={batch}: max |o - ref| / max |ref| = {errs[v]:.3g} "
                             f"(limit {tol:g}); the kernel is wrong, stopping without timings")
                times[v] = _graph_time_us(
                    torch, [lambda op=op, fn=fn, ctas=ctas: fn(*op.cute_args, ctas, current_stream())
                            for op in order])
            bmm_us = _graph_time_us(torch, [lambda op=op: torch.bmm(op.s, op.q_bmm, out=op.o_bmm)
                                            for op in order])

            ideal_us = nbytes / copy_bw * 1e6
            best = min(times, key=times.get)
            row = {
                "dtype": dt_name, "batch": batch, "tiles": n, "bytes": nbytes, "copies_cycled": copies,
                "best_variant": best.name, "us": times[best], "gbps": nbytes / times[best] / 1e3,
                "fraction": ideal_us / times[best], "max_rel_err": errs[best],
                "torch_bmm_us": bmm_us, "torch_bmm_fraction": ideal_us / bmm_us,
                "variants": {v.name: {"us": t, "fraction": ideal_us / t, "max_rel_err": errs[v]}
                             for v, t in times.items()},
            }
            rows.append(row)
            print(f"{dt_name} B={batch:<4} best {best.name:<18} {row['us']:8.2f} us {row['gbps']:7.1f} GB/s "
                  f"fraction {row['fraction']:.3f} | torch.bmm {bmm_us:8.2f} us fraction "
                  f"{row['torch_bmm_fraction']:.3f}", flush=True)
            del ops, order, ref
            torch.cuda.empty_cache()

    meta = {
        "gpu": props.name, "sms": sms, "torch": torch.__version__, "cutlass_dsl": _dsl_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable] + sys.argv),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "method": f"CUDA graph of >= {LAUNCHES_PER_GRAPH} back-to-back launches cycling over >= "
                  f"{L2_SAFE_BYTES >> 20} MiB of operand copies (or one copy when larger), CUDA events, "
                  f"median of {REPS} replays / launches; bytes = S + q read + o written (fp32); "
                  "fraction = bytes / copy bandwidth / time; torch.bmm writes o in the state dtype",
        "variants": [v.name for v in VARIANTS],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cute_read_probe.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "cute_read_probe.md"), "w") as f:
        f.write(f"# CuTe DSL TMA read probe: {props.name}, {sms} SMs\n\n"
                f"Copy bandwidth {copy_bw / 1e12:.3f} TB/s (kernel_decode.copy_bandwidth: 4 GiB copy, read + write). "
                f"torch {torch.__version__}, nvidia-cutlass-dsl {meta['cutlass_dsl']}, {meta['date']}.\n"
                f"Method: {meta['method']}.\n\n`{meta['command']}`\n\n"
                "| state | B | MiB | best variant | us | GB/s | fraction | torch.bmm us | bmm fraction |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['dtype']} | {r['batch']} | {r['bytes'] / 2**20:.1f} | {r['best_variant']} | "
                    f"{r['us']:.2f} | {r['gbps']:.0f} | {r['fraction']:.3f} | {r['torch_bmm_us']:.2f} | "
                    f"{r['torch_bmm_fraction']:.3f} |\n")
        f.write("\nFraction of every variant:\n")
        for dt_name in ("bf16", "fp32"):
            names = [v.name for v in VARIANTS if v.dtype == dt_name]
            f.write(f"\n| state | B | {' | '.join(names)} |\n|---|---|{'---|' * len(names)}\n")
            for r in (r for r in rows if r["dtype"] == dt_name):
                f.write(f"| {dt_name} | {r['batch']} | "
                        + " | ".join(f"{r['variants'][k]['fraction']:.3f}" for k in names) + " |\n")
    print(f"wrote {out_dir}/cute_read_probe.json and {out_dir}/cute_read_probe.md", flush=True)
    return 0


def _dsl_version():
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compile-only", action="store_true",
                      help="compile every variant for sm_90a (no GPU, no torch) and check the PTX")
    mode.add_argument("--out", metavar="DIR", help="GPU run: check, time, write DIR/cute_read_probe.{json,md}")
    args = ap.parse_args()
    sys.exit(compile_only() if args.compile_only else gpu_run(args.out))


if __name__ == "__main__":
    main()
