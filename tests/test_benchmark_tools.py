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


def test_summarize_trace_without_gpu_events(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]))
    assert "error" in _load("e2e_decode").summarize_trace(str(path))
