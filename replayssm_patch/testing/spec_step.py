"""A speculative-only MTP step outside vLLM: a stand-in layer, metadata and inputs, and vLLM's
own `_forward_core` for such a step (0.32 to 0.34) with our verify wrapper in it.

`vllm.spec_verify_step.verify_step` replaces that path on CUDA; tests/test_verify_step.py checks the two
agree, and `benchmarks/host_overhead.py --verify-step` times their host cost. Everything here
runs on the CPU (the verify's CPU form is the torch reference).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch

from ..ops.cursor import pack_cursor
from ..ring.call import RingCall, ring_call
from ..ring.runtime import ops_for
from ..vllm import sigmoid_update

H, HV, K, V, L, T, WIDTH = 2, 4, 16, 16, 16, 3, 4
W = T + 1
DIM = 2 * H * K + HV * V


class ConvStandIn:
    """vLLM's GDN module as `verify_step` uses it: a conv update that is a fixed function of its
    input (recording each call's arguments) and the conv-state layout flag."""

    def __init__(self, dim_first: bool, identity: bool = False):
        self.dim_first = dim_first
        self.identity = identity
        self.calls = []

    def is_conv_state_dim_first(self):
        return self.dim_first

    def causal_conv1d_update(self, x, conv_state, weight, bias, activation, **kw):
        if self.identity:
            return x
        self.calls.append(dict(x=x, conv_state=conv_state, weight=weight, bias=bias, activation=activation, **kw))
        return torch.tanh(1.5 * x + bias)


def make_step(seed: int, rows: int = 3, slots: int = 8, pad: int = 2, token_pad: int = 0, device="cpu"):
    """(layer, metadata, inputs) of one step of `rows` speculative rows of W tokens each, as
    vLLM's builder lays them out: slot repeated across the T+1 index columns, `pad` padding
    rows (no tokens) and 3 input tokens past the step's; `token_pad` of those the step counts in
    num_actual_tokens, as a batch padded for a CUDA graph does (vLLM >= 0.32). Rings hold random
    committed entries and pending windows; accepted counts are 1..W. Drawn on the CPU, then moved
    to `device`."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * W
    ring = SimpleNamespace(g=-torch.rand(slots, HV, L, generator=gen).cumsum(-1),
                           d=torch.randn(slots, HV, L, V, generator=gen) * 0.1,
                           k=torch.nn.functional.normalize(torch.randn(slots, H, L, K, generator=gen), dim=-1),
                           cursor=pack_cursor(torch.randint(0, L - 2 * W, (slots,), generator=gen),
                                              torch.randint(0, W + 1, (slots,), generator=gen)))
    layer = SimpleNamespace(
        kv_cache=(torch.randn(slots, WIDTH - 1, DIM, generator=gen), torch.randn(slots, HV, V, K, generator=gen) * 0.1),
        conv1d=SimpleNamespace(weight=torch.randn(DIM, 1, WIDTH, generator=gen), bias=torch.randn(DIM, generator=gen)),
        activation="silu", A_log=torch.randn(HV, generator=gen), dt_bias=torch.randn(HV, generator=gen),
        head_k_dim=K, ring_plan=SimpleNamespace(spec_window=W, verify_kernel="triton"), replay_ring=ring,
        ring_ops=ops_for(torch.device(device).type, Counter()))
    slot = torch.randperm(slots - 1, generator=gen)[:rows].int() + 1
    idx = torch.cat([slot, torch.zeros(pad, dtype=torch.int32)])[:, None].expand(-1, W)
    md = SimpleNamespace(spec_sequence_masks=torch.ones(rows, dtype=torch.bool), num_prefills=0, num_decodes=0,
                         num_actual_tokens=n + token_pad, num_spec_decode_tokens=n, num_spec_decodes=rows,
                         spec_state_indices_tensor=idx,
                         num_accepted_tokens=torch.randint(1, W + 1, (rows + pad,), generator=gen).int(),
                         spec_query_start_loc=torch.arange(0, (rows + pad + 1) * W, W, dtype=torch.int32).clamp(max=n))
    tokens = n + max(3, token_pad)
    inputs = dict(mixed_qkv=torch.randn(tokens, DIM, generator=gen), b=torch.randn(tokens, HV, generator=gen),
                  a=torch.randn(tokens, HV, generator=gen))
    if torch.device(device).type != "cpu":
        _move(layer, device)
        _move(md, device)
        inputs = {k: v.to(device) for k, v in inputs.items()}
    return layer, md, inputs


def _move(ns, device):
    """Every tensor of a namespace (and of the namespaces and tuples it holds) to `device`."""
    for name, value in vars(ns).items():
        if isinstance(value, torch.Tensor):
            setattr(ns, name, value.to(device))
        elif isinstance(value, tuple):
            setattr(ns, name, tuple(v.to(device) for v in value))
        elif isinstance(value, SimpleNamespace):
            _move(value, device)


def _vllm_kernel(**kw):
    raise AssertionError("the ring's wrapper let a speculative step through to vLLM's kernel")


_update = sigmoid_update.make_wrapper(_vllm_kernel)


def via_wrapper(layer, md, mixed_qkv, b, a, core_attn_out, gdn) -> None:
    """vLLM's `_forward_core` for a speculative-only step (0.32 to 0.34): conv update, q/k/v
    split and copied into one buffer, `fused_sigmoid_gating_delta_rule_update` (our wrapper,
    inside the layer's ring call) and the copy into `core_attn_out`."""
    n, rows, idx = md.num_actual_tokens, md.num_spec_decodes, md.spec_state_indices_tensor
    conv_state = layer.kv_cache[0] if gdn.is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    w = layer.conv1d.weight
    x = gdn.causal_conv1d_update(mixed_qkv[:n], conv_state, w.view(w.size(0), w.size(2)), layer.conv1d.bias,
                                 layer.activation, conv_state_indices=idx[:, 0][:rows],
                                 num_accepted_tokens=md.num_accepted_tokens, query_start_loc=md.spec_query_start_loc,
                                 max_query_len=idx.size(-1), validate_data=False)
    q, k, v = torch.split(x, [H * K, H * K, HV * V], dim=-1)
    fused = torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    q, k, v = (fused[: n * H * K].view(1, n, H, K), fused[n * H * K: 2 * n * H * K].view(1, n, H, K),
               fused[2 * n * H * K:].view(1, n, HV, V))
    state = layer.kv_cache[1]
    flags = torch.zeros(rows, dtype=torch.int8, device=state.device)
    call = RingCall(state, layer.replay_ring, layer.ring_ops, flags, flags, K ** -0.5, W)
    with ring_call(call):
        out, _ = _update(A_log=layer.A_log, a=a[:n], b=b[:n], dt_bias=layer.dt_bias, q=q, k=k, v=v,
                         initial_state=state, inplace_final_state=True, cu_seqlens=md.spec_query_start_loc[:rows + 1],
                         ssm_state_indices=idx, num_accepted_tokens=md.num_accepted_tokens,
                         use_qk_l2norm_in_kernel=True)
    core_attn_out[:n] = out.squeeze(0)
