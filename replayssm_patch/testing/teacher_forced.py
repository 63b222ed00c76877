"""Teacher-forced comparison: two engines decode the same tokens, their logprobs compared at
every position.

Greedy identity tells only whether a token flipped, and on near-flat logits one rounding flip
decides a token within a few steps; after that the two runs decode different text and nothing
more can be compared. Here every arm is forced to decode one fixed token sequence (the native
greedy tokens), so the two arms see identical prefixes at every position, and their full
next-token distributions are compared position by position: how far the patch moves the
numbers, however flat the logits.

`TeacherForcing` is a vLLM logits processor (V1 API, argmax-variant so it also runs for greedy
requests). For a request whose `SamplingParams.extra_args["teacher_forced"]` is
`{"key": str, "tokens": [ids] | None}` it records the log-softmax of the raw logits at every
position and, when `tokens` is given, forces that token. The records stay in this process
(`recorded()`): run the engine in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
`replayssm_patch.testing.exactness` runs the arms and compares them.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

EXTRA_ARG = "teacher_forced"
_records: dict[str, dict[int, torch.Tensor]] = {}


class TeacherForcing(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False  # it forces tokens: it must run for greedy requests too

    def new_req_logits_processor(self, params):
        spec = (params.extra_args or {}).get(EXTRA_ARG)
        if spec is None:
            return None
        store = _records.setdefault(spec["key"], {})
        tokens = spec.get("tokens")

        def record_and_force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            pos = len(output_ids)
            # a partial prefill may be sampled and discarded first: the last write per position wins
            store[pos] = torch.log_softmax(logits.float(), dim=-1).cpu()
            if tokens is None or pos >= len(tokens):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[tokens[pos]] = 0.0
            return forced

        return record_and_force


def recorded(key: str) -> torch.Tensor:
    """The logprobs recorded for request `key`: [positions, vocab], float32."""
    store = _records[key]
    return torch.stack([store[p] for p in range(len(store))])


def sampling_extra(key: str, tokens: list[int] | None) -> dict:
    """`SamplingParams.extra_args` that record request `key` and force `tokens` (None: record only)."""
    return {EXTRA_ARG: {"key": key, "tokens": tokens}}
