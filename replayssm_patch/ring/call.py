"""The ring call in progress: how a ring layer runs vLLM's GDN core (`run_with_ring`), and the
scaffold of the wrappers around vLLM's recurrence kernels.

While a ring layer runs vLLM's GDN core, `active()` holds a `RingCall` (a ContextVar): the
layer's ring, this step's flags and the operations to run. vLLM's recurrence kernels are
replaced by wrappers (one per patch point, replayssm_patch.vllm) that pass straight through when
no call is active or when the state they were handed is not that layer's; otherwise they serve
the call from the ring.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from . import shadow


@dataclass
class RingCall:
    state: torch.Tensor  # the layer's SSM state: a kernel handed another state is not ours to serve
    ring: object  # the layer's RingBuffers
    ops: object  # runtime.CudaRingOps | CpuRingOps
    force_flush: torch.Tensor
    start_empty: torch.Tensor
    scale: float
    spec_window: int = 0  # T+1 with MTP on the ring, else 0
    native_decode: bool = False  # this step's plain decode rows run vLLM's kernel (the plan's min_batch)
    flashinfer_verify: bool = False  # FlashInfer's verify kernel serves this step's verify

    def owns(self, state: torch.Tensor) -> bool:
        return state.data_ptr() == self.state.data_ptr()


_ACTIVE: ContextVar[RingCall | None] = ContextVar("replayssm_ring_call", default=None)


def active() -> RingCall | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def ring_call(call: RingCall):
    if _ACTIVE.get() is not None:
        raise RuntimeError("nested GDN ring calls")
    token = _ACTIVE.set(call)
    try:
        yield call
    finally:
        _ACTIVE.reset(token)


def call_for(state: torch.Tensor) -> RingCall | None:
    """The active call if `state` is its layer's SSM state (either view of its bytes)."""
    call = _ACTIVE.get()
    return call if call is not None and call.owns(state) else None


def binder(native):
    """Name every argument of a call to `native`: its defaults, then the positional arguments by
    the signature's order, then the keywords. The signature is read once, here."""
    params = inspect.signature(native).parameters
    names = tuple(params)
    defaults = {k: v.default for k, v in params.items() if v.default is not inspect.Parameter.empty}

    def bind(args, kw):
        p = dict(defaults)
        if args:
            if len(args) > len(names):
                raise TypeError(f"{native.__name__}() takes {len(names)} arguments ({len(args)} given)")
            twice = set(names[:len(args)]) & kw.keys()
            if twice:
                raise TypeError(f"{native.__name__}() got multiple values for {sorted(twice)}")
            p.update(zip(names, args))
        p.update(kw)
        return p

    return bind


def ring_aware(native, serve):
    """vLLM's `native` wrapped: outside a ring call the call goes to it as made (no binding: every
    call of a native layer takes this path); inside one, `serve` gets every argument by name. The
    wrapper keeps native's name, doc and signature (`__wrapped__`)."""
    bind = binder(native)

    def wrapper(*args, **kw):
        if _ACTIVE.get() is None:
            return native(*args, **kw)
        return serve(bind(args, kw))

    return functools.update_wrapper(wrapper, native)


def passthrough(native, call: RingCall | None, state_vk, indices, bound: dict, rows=None):
    """A call on a ring layer's state that vLLM's kernel serves (the ring cannot, or the step
    decodes natively): flush the rows it will read, so the kernel sees canonical states, and leave
    their rings empty. `rows`: one token per row, whose `start_empty` flags apply (a row whose
    state came without its ring drops the stale ring instead of replaying it)."""
    if call is not None:
        if rows is None:
            call.ops.materialize(state_vk, call.ring, indices.reshape(-1))
        else:
            call.ops.materialize(state_vk, call.ring, indices[:rows], call.start_empty[:rows])
            call.ops.stats["native_decode_calls"] += 1
    return native(**bound)


def one_token_rows(cu_seqlens, n) -> bool:
    """Decode rows carry exactly one token; anything else is not the ring's to serve."""
    return cu_seqlens is not None and cu_seqlens.shape[0] == n + 1


def spec_slots(idx, rows):
    """One slot per verify row: column 0 of vLLM's [rows, T+1] spec indices (the builder repeats
    the request's one slot across the row)."""
    return (idx[:, 0] if idx.ndim == 2 else idx)[:rows].contiguous()


def run_with_ring(layer, md, state_for_kernels, native_call):
    """Run vLLM's GDN core for a ring `layer` (vllm.gdn_layer.ReplayQwenGDN) with its decode rows
    on the ring: `native_call()` runs the core, `state_for_kernels` is the layer's state as the
    ring's kernels index it on this platform.

    With MTP, the non-spec rows' slots first commit the verify window a previous step left there
    (the spec rows' verify commits its own). Prefill rows read and write the checkpoint directly:
    the rings they carry are flushed first, and emptied after the prefill wrote a fresh state.
    """
    ring, ops, plan = layer.replay_ring, layer.ring_ops, layer.ring_plan
    if md.ring_commit_slots is not None:
        ops.commit(ring, md.ring_commit_slots, md.ring_commit_accepted)
    if md.ring_prefill_flush_slots is not None:
        ops.materialize(state_for_kernels, ring, md.ring_prefill_flush_slots)
    call = RingCall(layer.kv_cache[1], ring, ops, md.ring_force_flush, md.ring_start_empty, layer.head_k_dim ** -0.5,
                    plan.spec_window, native_decode=not md.ring_decode,
                    flashinfer_verify=flashinfer_serves(plan, md))
    with ring_call(call):
        result = native_call()
    if md.ring_prefill_slots is not None:
        ops.reset(ring, md.ring_prefill_slots)
        if ring.shadow is not None:
            shadow.sync_slots(ring, cpu_kv_view(layer), md.ring_prefill_slots)
    return result


def flashinfer_serves(plan, md) -> bool:
    """FlashInfer's verify kernel serves this step: the plan chose it and every verify row has
    exactly the plan's window (else ours runs, on the same rings)."""
    return plan.verify_kernel == "flashinfer" and _uniform_windows(md, plan.spec_window)


def _uniform_windows(md, window: int) -> bool:
    """Whether every verify row of this step has exactly `window` tokens (host metadata: vLLM
    >= 0.33 records it, 0.32 has the token and row counts)."""
    if hasattr(md, "uniform_spec_sequence_length"):
        return md.uniform_spec_sequence_length == window
    return bool(md.num_spec_decodes) and md.num_spec_decode_tokens == md.num_spec_decodes * window


def cpu_kv_view(layer) -> torch.Tensor:
    """The SSM state as vLLM's CPU kernels see it: [slot, HV, K, V]."""
    s = layer.kv_cache[1]
    n, hv, v, k = s.shape
    return s.view(n, hv, k, v)


def cpu_state_view(layer) -> torch.Tensor:
    """vLLM's CPU GDN kernels read each head as [K][V]; as [V, K] that is the transpose."""
    return cpu_kv_view(layer).transpose(-1, -2)
