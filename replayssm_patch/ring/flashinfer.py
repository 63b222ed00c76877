"""FlashInfer's ReplaySSM MTP kernel as the speculative verify step, on our rings.

`gated_delta_rule_mtp_ucache_flush` (flashinfer-python >= 0.7 with nvidia-cutlass-dsl; SM90+,
bf16 state and entries, K = V = 128, windows of 4 or 8 tokens) keeps the same ring content as
ours -- L2-normalised keys, the delta rule's d vectors, cumulative log-decays since the
checkpoint, at entries n..n+W-1 of a slot's ring (tests/gpu/test_flashinfer_verify_gpu.py) --
and its kernel is faster than ours (benchmarks/results/flashinfer_2026-12-04/). So it serves the
verify step on our rings, and every other ring operation (commit, decode, materialise, reset)
stays ours. What differs is bookkeeping, done around its launch by two small kernels (the ops'
`ucache`, one launch each, where torch would take dozens of small ops per call):

  * it takes the committed count per row (`hist_len`, at most 16) and leaves the commit to the
    caller: we commit the previous window first, fold any ring longer than 16 entries into its
    checkpoint (our kernels allow up to L = 32; `ring_materialize`), and mark the new window as
    pending in the cursor word afterwards, as our verify kernel does;
  * a row holding more than 16 - W entries has its ring folded into the checkpoint in the same
    launch and its window written after the folded entries: we move those W entries to the
    ring's start (a ring here never wraps: its base stays 0);
  * padding rows (slot <= 0) are pointed at the null block 0, whose state nobody reads;
  * the layer's A_log / dt_bias are parameters: they go in detached (DLPack refuses tensors
    that require grad).

Everything is graph-safe (no host sync). `why_not` says whether a config can use it.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import ops as lib

WINDOWS = (4, 8)  # its native windows (T + 1 tokens)
RING_SLOTS = 32  # its rings' length (the ring tensors must have exactly this many entries)
LIVE_ROWS = 16  # the most committed entries it accepts per row
HEAD_DIM = 128


@functools.lru_cache(maxsize=1)
def load_kernel():
    """The FlashInfer entry point, or the reason it cannot be imported."""
    # Our rings and checkpoints are views into vLLM's paged cache (block-strided): its kernel
    # addresses such pools in the static-descriptor mode, read when its module loads.
    os.environ.setdefault("SGLANG_GDN_WY_STRIDED_QKV", "1")
    try:
        from flashinfer.gdn_kernels.gdn_decode_bf16_wy_ucache_flush import gated_delta_rule_mtp_ucache_flush
    except Exception as e:  # ImportError, or the CuTe DSL failing to load
        return None, f"{type(e).__name__}: {e}"
    return gated_delta_rule_mtp_ucache_flush, ""


def why_not(state_dtype: torch.dtype, ring_dtype: torch.dtype, K: int, V: int, window: int) -> str | None:
    """None if FlashInfer's verify kernel can serve this config, else why not."""
    if state_dtype != torch.bfloat16 or ring_dtype != torch.bfloat16:
        return f"needs a bfloat16 SSM state and ring entries (got state {state_dtype}, ring {ring_dtype})"
    if K != HEAD_DIM or V != HEAD_DIM:
        return f"needs GDN head dims of {HEAD_DIM} (got key {K}, value {V})"
    if window not in WINDOWS:
        return (f"serves verify windows of {' or '.join(map(str, WINDOWS))} tokens, i.e. num_speculative_tokens "
                f"{' or '.join(str(w - 1) for w in WINDOWS)} (got {window - 1})")
    from vllm.platforms import current_platform  # NVML: asks without initialising CUDA here

    cap = current_platform.get_device_capability() if current_platform.is_cuda() else None
    if cap is None or cap.major < 9:
        return f"needs a CUDA GPU of compute capability 9.0 or newer (got {cap})"
    fn, err = load_kernel()
    if fn is None:
        return f"does not import ({err}); it needs flashinfer-python and nvidia-cutlass-dsl"
    return None


def verify(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, slots, ring, num_accepted, window: int) -> torch.Tensor:
    """One speculative step of `rows` rows of exactly `window` tokens each (rows = slots.shape[0],
    tokens = rows * window): the semantics of ring_verify for uniform windows, up to rounding."""
    fn, _ = load_kernel()
    rows = slots.shape[0]
    H, L, K = ring.k.shape[1:]
    HV, V = ring.d.shape[1], ring.d.shape[3]
    rows_slot, hist, base, fold = lib.ucache_prepare(ring.cursor, slots, num_accepted, L, LIVE_ROWS)
    # rings our kernels let grow past what it accepts (decode steps, a ragged verify step)
    lib.ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, fold)
    q, k, v = torch.split(mixed_qkv, [H * K, H * K, HV * V], dim=-1)  # views sharing one token stride
    # the layer's parameters: DLPack, which it takes them through, refuses tensors that require grad
    A_log, dt_bias = A_log.detach(), dt_bias.detach()
    # vLLM 0.34 hands Qwen3.5's a / b over as strided column blocks of one projection; the kernel
    # is given compact ones (a no-op where they already are)
    a, b = a.contiguous(), b.contiguous()
    fn(A_log, a.view(rows, window, HV), dt_bias, q=q.unflatten(0, (rows, window)).unflatten(-1, (H, K)),
       k=k.unflatten(0, (rows, window)).unflatten(-1, (H, K)), v=v.unflatten(0, (rows, window)).unflatten(-1, (HV, V)),
       b=b.view(rows, window, HV), initial_state_source=state, initial_state_indices=rows_slot,
       scale=scale, output=out.view(rows, window, HV, V), k_cache=ring.k, u_cache=ring.d, g_cache=ring.g,
       hist_len=hist, cache_base=base, restart_hist_on_flush=False)
    lib.ucache_finish(ring.d, ring.k, ring.g, ring.cursor, rows_slot, hist, window, LIVE_ROWS)
    return out
