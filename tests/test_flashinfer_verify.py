"""What of the FlashInfer verify path runs without a GPU: its refusals and the step test.

The kernel itself runs in tests/gpu/test_flashinfer_verify_gpu.py (Hopper + FlashInfer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from collections import Counter

from replayssm_patch.ring import call
from replayssm_patch.ring import flashinfer as flashinfer_verify
from replayssm_patch.ring.runtime import CpuRingOps

BF16 = torch.bfloat16


@pytest.mark.parametrize("args,why", [
    ((torch.float32, BF16, 128, 128, 4), "bfloat16 SSM state"),
    ((torch.float16, torch.float16, 128, 128, 4), "bfloat16 SSM state"),
    ((BF16, torch.float32, 128, 128, 8), "ring entries"),
    ((BF16, BF16, 64, 64, 4), "head dims of 128"),
    ((BF16, BF16, 128, 128, 6), "num_speculative_tokens 3 or 7 (got 5)"),
])
def test_why_not_names_what_it_cannot_serve(args, why):
    assert why in flashinfer_verify.why_not(*args)


def test_the_cpu_verify_refuses_flashinfer_before_counting():
    stats = Counter()
    ring = SimpleNamespace(d=torch.zeros(3, 4, 32, 128, dtype=BF16), k=torch.zeros(3, 2, 32, 128, dtype=BF16),
                           g=torch.zeros(3, 4, 32), cursor=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="FlashInfer's verify kernel runs on CUDA only"):
        CpuRingOps(stats).verify(torch.zeros(8, 2 * 2 * 128 + 4 * 128, dtype=BF16), torch.zeros(8, 4, dtype=BF16),
                                     torch.zeros(8, 4, dtype=BF16), torch.zeros(4), torch.zeros(4), 128 ** -0.5,
                                 torch.zeros(3, 4, 128, 128, dtype=BF16), torch.empty(8, 4, 128, dtype=BF16),
                                 torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32),
                                 ring, torch.ones(2, dtype=torch.int32), 4, flashinfer=True)
    assert not stats


def test_uniform_windows_from_host_metadata():
    # vLLM >= 0.33 records the common length of the speculative rows (None when ragged)
    assert call._uniform_windows(SimpleNamespace(uniform_spec_sequence_length=4), 4)
    assert not call._uniform_windows(SimpleNamespace(uniform_spec_sequence_length=4), 8)
    assert not call._uniform_windows(SimpleNamespace(uniform_spec_sequence_length=None), 4)
    # vLLM 0.32: from the speculative rows' and tokens' counts
    assert call._uniform_windows(SimpleNamespace(num_spec_decodes=3, num_spec_decode_tokens=12), 4)
    assert not call._uniform_windows(SimpleNamespace(num_spec_decodes=3, num_spec_decode_tokens=11), 4)
    assert not call._uniform_windows(SimpleNamespace(num_spec_decodes=0, num_spec_decode_tokens=0), 4)


def test_flashinfer_gets_compact_gates_from_strided_ones(monkeypatch):
    """vLLM 0.34's Qwen3.5 layer hands a / b over as column blocks of one [tokens, 2*HV]
    projection (row stride 2*HV): FlashInfer's kernel is given compact copies of the same values;
    our bookkeeping around it is stubbed (it runs on CUDA only)."""
    rows, window, HV, H, K, V, L = 2, 4, 4, 2, 128, 128, 32
    n = rows * window
    seen = {}

    def kernel(A_log, a, dt_bias, **kw):
        seen.update(a=a, b=kw["b"])

    slots = torch.tensor([1, 2], dtype=torch.int32)
    monkeypatch.setattr(flashinfer_verify, "load_kernel", lambda: (kernel, ""))
    monkeypatch.setattr(flashinfer_verify, "lib", SimpleNamespace(
        ucache_prepare=lambda cursor, slots, acc, L, live: (slots, slots, slots, slots),
        ring_materialize=lambda *args: None, ucache_finish=lambda *args: None))
    ba = torch.randn(n, 2 * HV, dtype=BF16)
    b, a = ba[:, :HV], ba[:, HV:]
    assert not a.is_contiguous() and a.stride(0) == 2 * HV
    ring = SimpleNamespace(d=torch.zeros(3, HV, L, V, dtype=BF16), k=torch.zeros(3, H, L, K, dtype=BF16),
                           g=torch.zeros(3, HV, L), cursor=torch.zeros(3, dtype=torch.int32))
    flashinfer_verify.verify(torch.zeros(n, 2 * H * K + HV * V, dtype=BF16), a, b, torch.zeros(HV), torch.zeros(HV),
                             K ** -0.5, torch.zeros(3, HV, V, K, dtype=BF16), torch.empty(n, HV, V, dtype=BF16), slots,
                             ring, torch.ones(2, dtype=torch.int32), window)
    assert seen["a"].is_contiguous() and seen["b"].is_contiguous()
    assert torch.equal(seen["a"].reshape(n, HV), a) and torch.equal(seen["b"].reshape(n, HV), b)
