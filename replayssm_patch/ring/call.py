"""The ring call in progress, and the scaffold of the wrappers around vLLM's recurrence kernels.

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
