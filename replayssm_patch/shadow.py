"""Shadow check (testing aid, CPU): run vLLM's own decode kernel beside the ring on a private
copy of every slot's exact state, and record how far the ring's outputs are from it.

Enabled with VLLM_GDN_REPLAYSSM_SHADOW=1. The shadow copy is refreshed wherever the checkpoint
is exact by construction (after a prefill; at a row that starts a new block, whose state vLLM
copied from a flushed block), so the comparison follows the ring through every scheduling
path: flushes, prefix-cache blocks, mixed batches, preemption.
"""

from __future__ import annotations

import os

import torch

from . import kernels

ENV_SHADOW = "VLLM_GDN_REPLAYSSM_SHADOW"


def enabled() -> bool:
    return os.environ.get(ENV_SHADOW, "0") == "1"


def _shadow_for(ring, state_kv: torch.Tensor) -> torch.Tensor:
    if getattr(ring, "shadow", None) is None:
        ring.shadow = state_kv.clone()
    return ring.shadow


def sync_slots(ring, state_kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy the exact checkpoint of `slots` (> 0) into the shadow."""
    shadow = _shadow_for(ring, state_kv)
    s = slots[slots > 0].long()
    shadow[s] = state_kv[s]


def check_decode(native, params: dict, ring, ring_out: torch.Tensor, start_empty: torch.Tensor) -> None:
    """Run vLLM's CPU decode on the shadow states and record the ring's relative error."""
    src, idx = params["initial_state_source"], params["initial_state_indices"]
    n = ring_out.shape[0]
    fresh = idx[:n][start_empty[:n].bool()]
    sync_slots(ring, src, fresh)
    shadow_out = native(**{**params, "initial_state_source": _shadow_for(ring, src)})
    valid = idx[:n] > 0
    a, b = ring_out[valid].float(), shadow_out[valid].float()
    if b.numel():
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        kernels.counters["shadow_checks"] += 1
        worst = kernels.counters.get("shadow_max_rel_err_x1e6", 0)
        kernels.counters["shadow_max_rel_err_x1e6"] = max(worst, int(err * 1e6))
