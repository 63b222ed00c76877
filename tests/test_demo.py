"""The README demo (`python -m replayssm_patch.demo`) runs and reports what the README says it
does: greedy agreement native vs patched, ring usage and the ring's cache bytes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from replayssm_patch.testing import cache_dir, require_vllm

pytestmark = pytest.mark.vllm


def test_demo_runs_and_agrees(tmp_path):
    require_vllm()
    env = dict(os.environ)
    env.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
    p = subprocess.run([sys.executable, "-m", "replayssm_patch.demo", "--workdir", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    out = p.stdout
    print(out[-2000:])
    agree = re.search(r"agreement \(.*\): (\d+)/(\d+) identical, (\d+) diverged at a near tie, (\d+) real", out)
    assert agree, out[-2000:]
    identical, total, _near, real = map(int, agree.groups())
    assert total == 4 and real == 0 and identical >= 4 * 0.9
    usage = re.search(r"(\d+) ring decode calls over (\d+) rows, (\d+) flushes", out)
    assert usage and int(usage.group(1)) > 0 and int(usage.group(3)) > 0, out[-2000:]
    cache = re.search(r"native (\d+), patched (\d+) \(ring \+(\d+)\)", out)
    assert cache and int(cache.group(2)) - int(cache.group(1)) == int(cache.group(3)) > 0
    assert "ring, model.layers.1.linear_attn: ring, model.layers.2.linear_attn: ring" in out


def test_demo_math_runs():
    p = subprocess.run([sys.executable, "-m", "replayssm_patch.demo", "--math"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
