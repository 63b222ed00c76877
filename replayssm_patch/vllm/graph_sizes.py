"""Patch point: `VllmConfig._set_cudagraph_sizes`, so that the verify steps of the requests the
ring lets fit run in CUDA graphs.

With MTP at T drafts a verify step of n requests is n*(1+T) tokens. vLLM captures graphs only up
to a platform ceiling unless the user configures wider sizes; a step above it runs eagerly. Native
vLLM seldom holds enough requests to reach that ceiling, since each request needs 1+T state slots.
The ring holds several times more in the same memory, so its extra requests ran eagerly: the ring
engine's step time grew faster than its batch (benchmarks/results/capacity_moe_h100_2026-12-06/).

Where the plan puts MTP on the ring and the user set none of the capture-size fields
(`USER_SIZE_FIELDS`), the sizes vLLM chose are kept and the uniform verify sizes n*(1+T)
are added for a request grid (1, 2, 4, then every 8 to 256, then every 16) within
`max_num_batched_tokens`, up to `max_num_seqs` or, where fewer requests fit the engine's memory,
to the plan's estimate of those with a margin (`FIT_MARGIN`). vLLM's profiler counts the memory of
the graphs it captures, and takes it from the KV cache: graphs for batches the engine can never
hold would cost requests.

From vLLM 0.34 the decode (verify) graphs are resolved by request count, from fields of their own
(`decode_cudagraph_capture_request_sizes` ...) that vLLM derives while it sets the sizes; a list
widened afterwards would not reach them. There the sizes are resolved a second time by vLLM itself,
from the user's (unset) fields and `max_decode_cudagraph_capture_requests` set to the requests
above, as for a user who asked for that many.
"""

from __future__ import annotations

import copy
import functools
import logging
import math

# payoff's estimate of the requests that fit is rough (it ignores vLLM's page padding); a quarter
# more keeps the batches of an engine that holds more than estimated in graphs
FIT_MARGIN = 1.25

# vLLM 0.34+: the most requests whose decode batches get a graph (the user's knob for it)
DECODE_REQUESTS = "max_decode_cudagraph_capture_requests"
# the fields of CompilationConfig a user sets to choose the capture sizes (those vLLM has)
USER_SIZE_FIELDS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size",
                    "prefill_cudagraph_capture_token_sizes", "max_prefill_cudagraph_capture_tokens",
                    "decode_cudagraph_capture_request_sizes", DECODE_REQUESTS,
                    "max_decode_cudagraph_capture_tokens")
# and every field vLLM's _set_cudagraph_sizes writes, kept as they were to resolve them again
RESOLVED_FIELDS = USER_SIZE_FIELDS + ("compile_sizes", "cudagraph_mode")


def graphed_requests(max_num_seqs: int, fit: float | None) -> int:
    """The most requests whose verify batches get a graph: `max_num_seqs`, or fewer where about
    `fit` requests fit the engine's memory."""
    return max_num_seqs if fit is None else max(1, min(max_num_seqs, math.ceil(fit * FIT_MARGIN)))


def request_grid(max_requests: int) -> list[int]:
    """Request counts whose verify batches get a graph: 1, 2, 4, every 8 below 256, every 16 from
    256, and `max_requests` itself."""
    counts = [n for n in (1, 2, 4) if n <= max_requests]
    counts += range(8, min(max_requests + 1, 256), 8)
    counts += range(256, max_requests + 1, 16)
    return sorted(set(counts) | {max_requests})


def widened_sizes(sizes: list[int], query_len: int, max_requests: int, max_tokens: int) -> list[int]:
    """`sizes` (vLLM's capture sizes, in tokens) with the uniform verify batches of `query_len`
    tokens per request added, up to `max_requests` requests and `max_tokens` tokens."""
    verify = {n * query_len for n in request_grid(max_requests) if n * query_len <= max_tokens}
    return sorted(set(sizes) | verify)


def make_wrapper(native):
    @functools.wraps(native)
    def _set_cudagraph_sizes(self):
        from ..plan import front_end_memory, front_end_plan, ring_requests_that_fit
        from ..state import STATE

        cc = self.compilation_config
        user_sized = any(getattr(cc, field, None) is not None for field in USER_SIZE_FIELDS)
        unresolved = {field: copy.copy(getattr(cc, field)) for field in RESOLVED_FIELDS if hasattr(cc, field)}
        native(self)
        query_len = self.uniform_decode_query_len  # 1 + the drafts per verify step
        if user_sized or not cc.cudagraph_capture_sizes or query_len == 1:
            return  # the user's sizes stand; or no graphs at all; or no MTP
        try:
            plan = front_end_plan(self, STATE.config)
            fit = None if plan is None else ring_requests_that_fit(self, plan, front_end_memory())
        except Exception as e:  # sizing graphs must never stop an engine from starting
            STATE.log_once(logging.WARNING, f"replayssm_patch: vLLM's CUDA graph sizes kept, no plan drawn "
                                            f"({type(e).__name__}: {e})")
            return
        if plan is None or plan.geometry is None:
            return  # MTP stays native: vLLM's sizes fit the requests native holds
        before = cc.max_cudagraph_capture_size
        requests = graphed_requests(self.scheduler_config.max_num_seqs, fit)
        max_tokens = self.scheduler_config.max_num_batched_tokens
        split = hasattr(cc, DECODE_REQUESTS)
        if split:
            if min(requests * query_len, max_tokens) <= before:
                return
            for field, value in unresolved.items():
                setattr(cc, field, value)
            setattr(cc, DECODE_REQUESTS, requests)
            native(self)
        else:
            sizes = widened_sizes(cc.cudagraph_capture_sizes, query_len, requests, max_tokens)
            if sizes[-1] <= before:
                return
            cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = sizes, sizes[-1]
            cc.post_init_cudagraph_sizes()  # vLLM's own finishing step, again with the wider list
        sizes = cc.cudagraph_capture_sizes
        fits = "" if fit is None else f", about {math.floor(fit)} requests fit its memory"
        STATE.log_once(logging.INFO, f"replayssm_patch: CUDA graphs for MTP verify steps of up to "
                                     f"{sizes[-1] // query_len} requests ({sizes[-1]} tokens; vLLM's default stops at {before}; max_num_seqs "
                                     f"{self.scheduler_config.max_num_seqs}{fits}): the ring holds more requests "
                                     f"than native (set {DECODE_REQUESTS if split else 'cudagraph_capture_sizes'} "
                                     f"to choose the sizes yourself)")

    return _set_cudagraph_sizes
