"""A speculative-only step on CUDA goes straight to the ring's verify (intercept.verify_step):
it must do exactly what vLLM's `_forward_core` does for such a step with our wrapper in it.

Both paths run here on the CPU with the same conv (a stand-in for vLLM's `causal_conv1d_update`
that records its arguments) and the same verify (`kernels.spec_verify`, whose CPU form is the
torch reference): the wrapper path as vLLM 0.32 / 0.33 drive it (conv, the q/k/v split into
separate buffers, `fused_sigmoid_gating_delta_rule_update` with our wrapper active, the copy into
`core_attn_out`), and `verify_step`. Fresh random inputs: rings with committed entries and
pending windows, accepted counts 1..W, padded tokens beyond the step's, both conv-state layouts.
Outputs (poisoned first), checkpoints, rings and cursors must be equal, and the conv must get
vLLM's arguments.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from replayssm_patch import intercept  # noqa: E402
from replayssm_patch._vendored import pack_cursor  # noqa: E402

H, HV, K, V, L, T, WIDTH = 2, 4, 16, 16, 16, 3, 4
W = T + 1
DIM = 2 * H * K + HV * V


class Conv:
    """Stands in for vLLM's conv update: a fixed function of its input, recording the call."""

    def __init__(self, dim_first):
        self.dim_first = dim_first
        self.calls = []

    def is_conv_state_dim_first(self):
        return self.dim_first

    def causal_conv1d_update(self, x, conv_state, weight, bias, activation, **kw):
        self.calls.append(dict(x=x, conv_state=conv_state, weight=weight, bias=bias, activation=activation, **kw))
        return torch.tanh(1.5 * x + bias)


def _setup(seed, rows=3, slots=8):
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
        head_k_dim=K, ring_plan=SimpleNamespace(spec_window=W, verify_kernel="triton"), replay_ring=ring)
    slot = torch.randperm(slots - 1, generator=gen)[:rows].int() + 1
    pad = 2  # graph padding: rows and tokens past the step's
    idx = torch.cat([slot, torch.zeros(pad, dtype=torch.int32)])[:, None].expand(-1, W)
    md = SimpleNamespace(spec_sequence_masks=torch.ones(rows, dtype=torch.bool), num_prefills=0, num_decodes=0,
                         num_actual_tokens=n, num_spec_decodes=rows, spec_state_indices_tensor=idx,
                         num_accepted_tokens=torch.randint(1, W + 1, (rows + pad,), generator=gen).int(),
                         spec_query_start_loc=torch.arange(0, (rows + pad + 1) * W, W, dtype=torch.int32).clamp(max=n))
    tokens = n + 3
    inputs = dict(mixed_qkv=torch.randn(tokens, DIM, generator=gen), b=torch.randn(tokens, HV, generator=gen),
                  a=torch.randn(tokens, HV, generator=gen))
    return layer, md, inputs


def _via_wrapper(layer, md, mixed_qkv, b, a, core_attn_out, gdn):
    """vLLM's spec-only `_forward_core` (0.32 / 0.33) with our sigmoid-update wrapper active."""
    n, rows, idx = md.num_actual_tokens, md.num_spec_decodes, md.spec_state_indices_tensor
    conv_state = layer.kv_cache[0] if gdn.is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    w = layer.conv1d.weight
    x = gdn.causal_conv1d_update(mixed_qkv[:n], conv_state, w.view(w.size(0), w.size(2)), layer.conv1d.bias,
                                 layer.activation, conv_state_indices=idx[:, 0][:rows],
                                 num_accepted_tokens=md.num_accepted_tokens, query_start_loc=md.spec_query_start_loc,
                                 max_query_len=idx.size(-1), validate_data=False)
    q, k, v = torch.split(x, [H * K, H * K, HV * V], dim=-1)  # vLLM copies them into one buffer
    fused = torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    q, k, v = (fused[: n * H * K].view(1, n, H, K), fused[n * H * K: 2 * n * H * K].view(1, n, H, K),
               fused[2 * n * H * K:].view(1, n, HV, V))

    def vllm_kernel(**kw):
        raise AssertionError("the ring's wrapper let a speculative step through to vLLM's kernel")

    update = intercept.make_sigmoid_update_wrapper(vllm_kernel)
    state = layer.kv_cache[1]
    call = intercept.RingCall(state.data_ptr(), layer.replay_ring, torch.zeros(8, dtype=torch.int8),
                              torch.zeros(8, dtype=torch.int8), K ** -0.5, W)
    with intercept.ring_call(call):
        out, _ = update(A_log=layer.A_log, a=a[:n], b=b[:n], dt_bias=layer.dt_bias, q=q, k=k, v=v,
                        initial_state=state, inplace_final_state=True, cu_seqlens=md.spec_query_start_loc[:rows + 1],
                        ssm_state_indices=idx, num_accepted_tokens=md.num_accepted_tokens,
                        use_qk_l2norm_in_kernel=True)
    core_attn_out[:n] = out.squeeze(0)


@pytest.mark.parametrize("dim_first", [False, True])
def test_verify_step_does_what_vllm_does_with_the_wrapper(dim_first):
    layer, md, inputs = _setup(seed=11 + dim_first)
    twin = copy.deepcopy(layer)
    gdn_a, gdn_b = Conv(dim_first), Conv(dim_first)
    tokens = inputs["mixed_qkv"].shape[0]
    out_a = torch.zeros(tokens, HV, V)
    out_b = torch.zeros(tokens, HV, V)
    out_a[: md.num_actual_tokens] = float("nan")  # every token of the step must be written
    out_b[: md.num_actual_tokens] = float("nan")
    _via_wrapper(layer, md, **inputs, core_attn_out=out_a, gdn=gdn_a)
    intercept.verify_step(twin, md, **inputs, core_attn_out=out_b, gdn=gdn_b)

    assert not out_b.isnan().any()
    assert torch.equal(out_b, out_a)
    assert torch.equal(twin.kv_cache[1], layer.kv_cache[1])
    for name in ("d", "k", "g", "cursor"):
        assert torch.equal(getattr(twin.replay_ring, name), getattr(layer.replay_ring, name)), name
    assert not torch.equal(twin.replay_ring.cursor, _setup(seed=11 + dim_first)[0].replay_ring.cursor)

    (ca,), (cb,) = gdn_a.calls, gdn_b.calls
    assert cb["conv_state"].data_ptr() == twin.kv_cache[0].data_ptr()
    assert cb["conv_state"].shape == ca["conv_state"].shape
    assert cb["weight"].shape == (DIM, WIDTH) and cb["activation"] == "silu"
    assert torch.equal(cb["x"], inputs["mixed_qkv"][: md.num_actual_tokens])
    assert torch.equal(cb["conv_state_indices"], md.spec_state_indices_tensor[: md.num_spec_decodes, 0])
    assert cb["num_accepted_tokens"] is md.num_accepted_tokens and cb["query_start_loc"] is md.spec_query_start_loc
    assert cb["max_query_len"] == W and cb["validate_data"] is False


def test_only_steps_of_speculative_rows_alone_take_it():
    md = SimpleNamespace(spec_sequence_masks=torch.ones(2, dtype=torch.bool), num_prefills=0, num_decodes=0,
                         num_accepted_tokens=torch.ones(2, dtype=torch.int32))
    assert intercept.speculative_only(md)
    assert not intercept.speculative_only(SimpleNamespace(**{**vars(md), "num_accepted_tokens": None}))
    assert not intercept.speculative_only(SimpleNamespace(**{**vars(md), "num_prefills": 1}))
    assert not intercept.speculative_only(SimpleNamespace(**{**vars(md), "num_decodes": 1}))
    assert not intercept.speculative_only(SimpleNamespace(**{**vars(md), "spec_sequence_masks": None}))


def test_installed_vllm_has_what_verify_step_calls():
    """verify_step calls two globals of vLLM's GDN layer module (vLLM 0.32 and 0.33 have both)."""
    pytest.importorskip("vllm")
    from replayssm_patch import versions
    from replayssm_patch.layer import vllm_gdn

    caps = versions.capabilities()
    if caps is None or not caps.mtp_cuda:
        pytest.skip("MTP on CUDA is not served with this vLLM")
    assert callable(vllm_gdn.causal_conv1d_update) and callable(vllm_gdn.is_conv_state_dim_first)
