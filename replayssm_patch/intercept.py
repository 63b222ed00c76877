"""Route vLLM's GDN decode recurrence through the ring while one of our layers runs.

vLLM's GDN core (`_forward_core` on GPU, `_cpu_gdn_attention_nonspec` on CPU) does the
conv, the prefill and the bookkeeping; for decode rows it calls one recurrence kernel
(`fused_recurrent_gated_delta_rule_packed_decode`, or `fused_sigmoid_gating_delta_rule_update`
for the decode rows of mixed batches; `fused_sigmoid_gating_delta_rule_update_cpu` on CPU).
With speculative decoding (MTP) the verify call (`fused_sigmoid_gating_delta_rule_update`
with `num_accepted_tokens` on GPU, `fused_sigmoid_gating_delta_rule_update_spec_cpu` on CPU)
goes to the ring's verify step, which commits the slot's previous window first.
Those module globals are replaced once (patch_points.POINTS) by wrappers that pass straight
through unless a `RingCall` is active for the very state tensor they were given; then they run
the ring kernel on the same inputs, or, on a step the dispatch leaves native
(`RingCall.native_decode`), flush the rows' rings and call vLLM's kernel. Everything else in
vLLM's path stays vLLM's, except on CUDA for a step of speculative rows alone: `verify_step`
makes vLLM's two calls for it (conv update, verify) without the Python around them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch

from . import kernels, shadow
from .ops.gdn_reference import pack_qkv
from .numerics import CPU_SPEC_NUMERICS, FLA_NUMERICS


@dataclass
class RingCall:
    state_ptr: int  # data_ptr of the layer's SSM state: the key the wrappers match on
    ring: object  # layer's RingBuffers
    force_flush: torch.Tensor
    start_empty: torch.Tensor
    scale: float
    spec_window: int = 0  # T+1 with speculative decoding on the ring, else 0
    native_decode: bool = False  # this step's plain decode rows run vLLM's kernel (dispatch)
    # FlashInfer's verify kernel serves this step (the plan chose it and every spec row has
    # exactly spec_window tokens); otherwise ours
    flashinfer_verify: bool = False


_active: RingCall | None = None


@contextlib.contextmanager
def ring_call(call: RingCall):
    global _active
    if _active is not None:
        raise RuntimeError("nested GDN ring calls")
    _active = call
    try:
        yield
    finally:
        _active = None


def _match(state: torch.Tensor) -> RingCall | None:
    call = _active
    if call is None or state.data_ptr() != call.state_ptr:
        return None
    return call


def _decode_split_qkv(call, p, state, idx, leading):
    """Ring decode (CUDA) for kernels that take q/k/v split as (1, N, heads, dim): one token per
    row. Returns the output shaped `leading + (HV, V)`, as the replaced kernel returns it."""
    q = p["q"]
    n = q.shape[1]
    hv, vdim = p["v"].shape[-2:]
    out = torch.empty((*leading, hv, vdim), dtype=q.dtype, device=q.device)
    kernels.decode(pack_qkv(q, p["k"], p["v"]), p["a"][:n], p["b"][:n], p["A_log"], p["dt_bias"],
                   call.scale, state, out.view(n, hv, vdim), idx[:n], call.ring,
                   call.force_flush[:n], call.start_empty[:n])
    return out


def _one_token_rows(cu_seqlens, n) -> bool:
    # Decode rows carry exactly one token; anything else is not ours to serve.
    return cu_seqlens is not None and cu_seqlens.shape[0] == n + 1


def _passthrough(native, call, state_vk, indices, bound, rows=None):
    """A call on a ring layer's state that vLLM's kernel serves (the ring cannot, or the step
    decodes natively): flush the rows it will read, so the kernel sees canonical states, and
    leave their rings empty. `rows`: one token per row, whose `start_empty` flags apply (a
    row whose state came without its ring drops the stale ring instead of replaying it)."""
    if call is not None:
        if rows is None:
            kernels.materialize(state_vk, call.ring, indices.reshape(-1))
        else:
            kernels.materialize(state_vk, call.ring, indices[:rows], call.start_empty[:rows])
            kernels.counters["native_decode_calls"] += 1
    return native(**bound)


def _binder(native):
    """Name every argument of a call to `native`: its defaults, then the positional arguments
    by the signature's order, then the keywords (vLLM passes them by keyword today). The
    signature is read once, here; a call costs a dict copy."""
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


def _spec_slots(idx, rows):
    """One slot per spec row: column 0 of vLLM's [rows, T+1] spec indices (the builder
    repeats the request's one slot across the row)."""
    return (idx[:, 0] if idx.ndim == 2 else idx)[:rows].contiguous()


def _verify_split_qkv(call, p, state, slots, cu, num_accepted, q, leading, numerics=FLA_NUMERICS):
    """Ring verify for kernels that take q/k/v split: q/k (..., N, H, K), v (..., N, HV, V)."""
    hv, vdim = p["v"].shape[-2:]
    n = q.shape[-3]
    out = torch.empty((*leading, hv, vdim), dtype=q.dtype, device=q.device)
    kernels.spec_verify(pack_qkv(q, p["k"], p["v"]), p["a"][:n].contiguous(), p["b"][:n].contiguous(),
                        p["A_log"], p["dt_bias"], call.scale, state, out.view(n, hv, vdim), slots,
                        cu.contiguous(), call.ring, num_accepted, call.spec_window, numerics=numerics,
                        flashinfer=call.flashinfer_verify)
    return out


def _ring_aware(native, serve):
    """vLLM's `native` wrapped: outside a ring layer's call the call goes to it as made (no
    binding: every eager call of a native layer takes this path); inside one, `serve` gets every
    argument by name. The wrapper keeps native's name, doc and signature (`__wrapped__`)."""
    bind = _binder(native)

    def wrapper(*args, **kw):
        if _active is None:
            return native(*args, **kw)
        return serve(bind(args, kw))

    return functools.update_wrapper(wrapper, native)


def make_packed_decode_wrapper(native):
    def packed_decode(p):
        state, idx = p["initial_state"], p["ssm_state_indices"]
        call = _match(state)
        if call is None or not p["use_qk_l2norm_in_kernel"]:
            return _passthrough(native, call, state, idx, p)
        x, out = p["mixed_qkv"], p["out"]
        n = x.shape[0]
        if call.native_decode:
            return _passthrough(native, call, state, idx, p, rows=n)
        kernels.decode(x, p["a"], p["b"], p["A_log"], p["dt_bias"], p["scale"], state,
                       out.view(n, -1, out.shape[-1]), idx[:n], call.ring,
                       call.force_flush[:n], call.start_empty[:n])
        return out, state

    return _ring_aware(native, packed_decode)


def make_sigmoid_update_wrapper(native):
    def sigmoid_update(p):
        state, idx, q = p["initial_state"], p["ssm_state_indices"], p["q"]
        call = _match(state)
        if call is None:
            return native(**p)
        n = q.shape[1]
        acc = p.get("num_accepted_tokens")
        if (acc is not None and call.spec_window and p["cu_seqlens"] is not None
                and p["use_qk_l2norm_in_kernel"] and p["inplace_final_state"]):
            cu = p["cu_seqlens"]
            rows = cu.shape[0] - 1
            out = _verify_split_qkv(call, p, state, _spec_slots(idx, rows), cu, acc, q, leading=(1, n))
            return out, state
        if (acc is not None or not _one_token_rows(p["cu_seqlens"], n)
                or not p["use_qk_l2norm_in_kernel"] or not p["inplace_final_state"]):
            return _passthrough(native, call, state, idx, p)
        if call.native_decode:
            return _passthrough(native, call, state, idx, p, rows=n)
        out = _decode_split_qkv(call, p, state, idx, leading=(1, n))
        return out, state

    return _ring_aware(native, sigmoid_update)


def make_cpu_update_wrapper(native):
    def cpu_update(p):
        src, idx, q = p["initial_state_source"], p["initial_state_indices"], p["q"]
        call = _match(src)
        if call is None:
            return native(**p)
        # vLLM's CPU kernels view each head of the [slot, HV, V, K] state as [K][V]; the same
        # bytes read as [V, K] are the transpose of that view.
        state = src.transpose(-1, -2)
        n = q.shape[1]
        if not _one_token_rows(p["cu_seqlens"], n) or not p["use_qk_l2norm_in_kernel"]:
            return _passthrough(native, call, state, idx, p)
        if call.native_decode:
            out = _passthrough(native, call, state, idx, p, rows=n)
            if shadow.enabled():  # native advanced the canonical states: the shadow follows
                shadow.sync_slots(call.ring, src, idx[:n])
            return out
        # The step itself is this kernel's, taken from the replayed state: exact on empty rings.
        out = kernels.decode_with_cpu_kernel(native, p, call.ring, call.force_flush, call.start_empty)
        if shadow.enabled():
            shadow.check_decode(native, p, call.ring, out, call.start_empty)
        return out

    return _ring_aware(native, cpu_update)


def make_cpu_spec_update_wrapper(native):
    """Wrap `fused_sigmoid_gating_delta_rule_update_spec_cpu` (vLLM's CPU MTP recurrence:
    resume from slot [i, num_accepted-1], write the state after token t to slot [i, t])."""
    def cpu_spec_update(p):
        src = p["initial_state_source"]
        call = _match(src)
        if call is None:
            return native(**p)
        if not call.spec_window or not p["use_qk_l2norm_in_kernel"]:
            raise RuntimeError("GDN ring: a speculative step reached a ring layer that cannot serve it")
        cu, q = p["cu_seqlens"], p["q"]
        rows = cu.shape[0] - 1
        # vLLM's CPU kernels view each head of the [slot, HV, V, K] state as [K][V] (see above).
        return _verify_split_qkv(call, p, src.transpose(-1, -2), _spec_slots(p["spec_state_indices"], rows),
                                 cu, p["num_accepted_tokens"], q, leading=(q.shape[-3],),
                                 numerics=CPU_SPEC_NUMERICS)

    return _ring_aware(native, cpu_spec_update)


def run_with_ring(layer, md, state_for_kernels, native_call):
    """Run vLLM's GDN core for `layer` with its decode rows on the ring.

    With speculative decoding, the non-spec rows' slots first commit the verify window a
    previous step left there (the spec rows' verify commits its own). Prefill rows read and
    write the checkpoint directly: flush the rings they carry first, and mark their rings
    empty after the prefill wrote a fresh state.
    """
    ring = layer.replay_ring
    if md.ring_commit_slots is not None:
        kernels.commit(ring, md.ring_commit_slots, md.ring_commit_accepted)
    if md.ring_prefill_flush_slots is not None:
        kernels.materialize(state_for_kernels, ring, md.ring_prefill_flush_slots)
    plan = layer.ring_plan
    call = RingCall(layer.kv_cache[1].data_ptr(), ring, md.ring_force_flush, md.ring_start_empty,
                    layer.head_k_dim ** -0.5, plan.spec_window, native_decode=not md.ring_decode,
                    flashinfer_verify=_flashinfer_serves(plan, md))
    with ring_call(call):
        result = native_call()
    if md.ring_prefill_slots is not None:
        kernels.reset(ring, md.ring_prefill_slots)
        if shadow.enabled():
            shadow.sync_slots(ring, _cpu_kv_view(layer), md.ring_prefill_slots)
    return result


def speculative_only(md) -> bool:
    """A step whose rows are all speculative (MTP verify steps once every request decodes),
    with the accepted counts its verify commits by (else the wrapper path decides)."""
    return (md.spec_sequence_masks is not None and md.num_prefills == 0 and md.num_decodes == 0
            and md.num_accepted_tokens is not None)


def verify_step(layer, md, mixed_qkv, b, a, core_attn_out, gdn) -> None:
    """A speculative-only step on CUDA: vLLM's conv update, then the ring's verify on the conv
    output, written straight into `core_attn_out`. `gdn`: vLLM's GDN layer module, whose conv
    op and conv-state layout its own `_forward_core` uses.

    The same calls, arguments and order as vLLM's own `_forward_core` makes for such a step
    (vLLM 0.32 and 0.33), without its unfused Python around them: the q/k/v split and `cat`
    that our wrapper would undo with another `cat`, the argument binding and the final copy.
    Under the profiler that path cost the host 0.8-1.3 ms per layer call in a step too large for
    a CUDA graph, against 0.3 ms for native's fused MTP op (2026-12-04, batch 256, T=3). Nothing
    else of the ring is due in such a step: no row is a prefill or a plain decode.
    """
    n, rows = md.num_actual_tokens, md.num_spec_decodes
    idx = md.spec_state_indices_tensor
    conv_state = layer.kv_cache[0] if gdn.is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    weight = layer.conv1d.weight
    x = gdn.causal_conv1d_update(
        mixed_qkv[:n], conv_state, weight.view(weight.size(0), weight.size(2)), layer.conv1d.bias,
        layer.activation, conv_state_indices=idx[:, 0][:rows], num_accepted_tokens=md.num_accepted_tokens,
        query_start_loc=md.spec_query_start_loc, max_query_len=idx.size(-1), validate_data=False)
    plan = layer.ring_plan
    kernels.spec_verify(x, a[:n], b[:n], layer.A_log, layer.dt_bias, layer.head_k_dim ** -0.5, layer.kv_cache[1],
                        core_attn_out[:n], idx[:rows, 0], md.spec_query_start_loc[:rows + 1],
                        layer.replay_ring, md.num_accepted_tokens, plan.spec_window,
                        flashinfer=_flashinfer_serves(plan, md))


def _flashinfer_serves(plan, md) -> bool:
    """FlashInfer's verify kernel serves this step: the plan chose it and every speculative row
    has exactly the plan's window (else ours runs on the same rings)."""
    return plan.verify_kernel == "flashinfer" and _uniform_windows(md, plan.spec_window)


def _uniform_windows(md, window: int) -> bool:
    """Whether every speculative row of this step has exactly `window` tokens (host metadata:
    vLLM >= 0.33 records it, 0.32 has the token and row counts)."""
    if hasattr(md, "uniform_spec_sequence_length"):
        return md.uniform_spec_sequence_length == window
    return bool(md.num_spec_decodes) and md.num_spec_decode_tokens == md.num_spec_decodes * window


def _cpu_kv_view(layer) -> torch.Tensor:
    """The SSM state as vLLM's CPU kernels see it: [slot, HV, K, V]."""
    s = layer.kv_cache[1]
    n, hv, v, k = s.shape
    return s.view(n, hv, k, v)
