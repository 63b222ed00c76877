"""`CudaRingOps.compile_ahead` on a CUDA GPU: after it, the ring's maintenance kernels compile nothing
more, whatever the slot count and however vLLM's index slices are aligned (the calls a prefill,
a native decode step and an MTP commit make), so vLLM's JIT monitor sees no compile mid-step.

Compiles are counted with Triton's post-compile hook (the one vLLM's JIT monitor uses) in a
fresh Python process: this file run as a script, so that no earlier test has compiled a variant
already. Skipped without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

if __name__ != "__main__":
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    pytest.importorskip("triton")
    pytestmark = pytest.mark.gpu

MAINTENANCE = {"_ring_reset_kernel", "_ring_materialize_kernel", "_ring_commit_kernel"}


def count_compiles() -> dict:
    """The kernels compiled by compile_ahead, then by the calls after it (names)."""
    import torch
    from triton import knobs

    from collections import Counter

    from replayssm_patch.ops import ring_commit, ring_materialize, ring_reset
    from replayssm_patch.ring.runtime import CudaRingOps, RingBuffers

    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(getattr(kw.get("fn"), "name", "?"))
    dev = "cuda"
    slots, H, HV, K, V, L = 40, 16, 32, 128, 128, 16
    state = torch.randn(slots, HV, V, K, device=dev) * 0.1
    ring = RingBuffers(g=torch.zeros(slots, HV, L, device=dev), d=torch.zeros(slots, HV, L, V, device=dev),
                       k=torch.zeros(slots, H, L, K, device=dev), cursor=torch.zeros(slots, dtype=torch.int32, device=dev))
    CudaRingOps(Counter()).compile_ahead(state, ring, speculative=True)
    torch.cuda.synchronize()
    ahead = list(compiled)
    compiled.clear()
    index = torch.arange(1, 40, dtype=torch.int32, device=dev)  # as vLLM's int32 state indices
    flags = torch.zeros(40, dtype=torch.int8, device=dev)
    accepted = torch.ones(40, dtype=torch.int32, device=dev)
    for off in range(4):  # every 4-byte alignment of a slice's start
        for n in (1, 2, 3, 16, 17, 32):  # Triton's integer specialisations: == 1, % 16 == 0, other
            sel = index[off:off + n]
            ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, sel)
            ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, sel, flags[off:off + n])
            ring_reset(ring.cursor, sel)
            ring_commit(ring.cursor, sel, accepted[off:off + n], L)
            ring_commit(ring.cursor, sel, None, L)
    torch.cuda.synchronize()
    return {"ahead": ahead, "after": compiled}


def test_nothing_compiles_after_compile_ahead():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert MAINTENANCE <= set(got["ahead"]), got  # the hook saw compile_ahead's compiles
    assert got["after"] == [], got


if __name__ == "__main__":
    print(json.dumps(count_compiles()))
