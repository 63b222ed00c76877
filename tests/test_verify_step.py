"""A speculative-only step on CUDA goes straight to the ring's verify (vllm.spec_verify_step):
it must do exactly what vLLM's `_forward_core` does for such a step with our wrapper in it.

Both paths run here on the CPU (replayssm_patch.testing.spec_step) with the same conv (a
stand-in for vLLM's `causal_conv1d_update` that records its arguments) and the same verify
(the ring's verify, on CPU `ring.cpu.ring_verify`): the wrapper path as vLLM 0.32-0.34 drive it (conv, the q/k/v split into
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

from replayssm_patch.vllm import spec_verify_step  # noqa: E402
from replayssm_patch.testing.spec_step import DIM, HV, V, W, WIDTH, ConvStandIn, make_step, via_wrapper  # noqa: E402


@pytest.mark.parametrize("dim_first", [False, True])
def test_verify_step_does_what_vllm_does_with_the_wrapper(dim_first):
    layer, md, inputs = make_step(seed=11 + dim_first)
    twin = copy.deepcopy(layer)
    gdn_a, gdn_b = ConvStandIn(dim_first), ConvStandIn(dim_first)
    tokens = inputs["mixed_qkv"].shape[0]
    out_a = torch.zeros(tokens, HV, V)
    out_b = torch.zeros(tokens, HV, V)
    out_a[: md.num_actual_tokens] = float("nan")  # every token of the step must be written
    out_b[: md.num_actual_tokens] = float("nan")
    via_wrapper(layer, md, **inputs, core_attn_out=out_a, gdn=gdn_a)
    spec_verify_step.verify_step(twin, md, **inputs, core_attn_out=out_b, gdn=gdn_b)

    assert not out_b.isnan().any()
    assert torch.equal(out_b, out_a)
    assert torch.equal(twin.kv_cache[1], layer.kv_cache[1])
    for name in ("d", "k", "g", "cursor"):
        assert torch.equal(getattr(twin.replay_ring, name), getattr(layer.replay_ring, name)), name
    assert not torch.equal(twin.replay_ring.cursor, make_step(seed=11 + dim_first)[0].replay_ring.cursor)

    (ca,), (cb,) = gdn_a.calls, gdn_b.calls
    assert cb["conv_state"].data_ptr() == twin.kv_cache[0].data_ptr()
    assert cb["conv_state"].shape == ca["conv_state"].shape
    assert cb["weight"].shape == (DIM, WIDTH) and cb["activation"] == "silu"
    assert torch.equal(cb["x"], inputs["mixed_qkv"][: md.num_actual_tokens])
    assert torch.equal(cb["conv_state_indices"], md.spec_state_indices_tensor[: md.num_spec_decodes, 0])
    assert cb["num_accepted_tokens"] is md.num_accepted_tokens and cb["query_start_loc"] is md.spec_query_start_loc
    assert cb["max_query_len"] == W and cb["validate_data"] is False


def test_verify_step_writes_every_row_of_a_padded_step():
    """A batch padded for a CUDA graph counts its padding tokens in num_actual_tokens (no verify
    row owns them); vLLM 0.34 hands `core_attn_out` over uninitialised (torch.empty): every row
    below num_actual_tokens gets written, the rows' tokens as vLLM's path writes them, the
    padding zero."""
    layer, md, inputs = make_step(seed=5, token_pad=4)
    twin = copy.deepcopy(layer)
    real, n = md.num_spec_decode_tokens, md.num_actual_tokens
    assert n == real + 4 and int(md.spec_query_start_loc[md.num_spec_decodes]) == real
    tokens = inputs["mixed_qkv"].shape[0]
    out_a, out_b = torch.zeros(tokens, HV, V), torch.full((tokens, HV, V), float("nan"))
    via_wrapper(layer, md, **inputs, core_attn_out=out_a, gdn=ConvStandIn(False))
    spec_verify_step.verify_step(twin, md, **inputs, core_attn_out=out_b, gdn=ConvStandIn(False))
    assert not out_b[:n].isnan().any(), "a row below num_actual_tokens was left unwritten"
    assert torch.equal(out_b[:real], out_a[:real]) and not out_b[real:n].any()
    assert out_b[n:].isnan().all(), "a row past num_actual_tokens was written"
    assert torch.equal(twin.kv_cache[1], layer.kv_cache[1])


def test_only_steps_of_speculative_rows_alone_take_it():
    md = SimpleNamespace(spec_sequence_masks=torch.ones(2, dtype=torch.bool), num_prefills=0, num_decodes=0,
                         num_accepted_tokens=torch.ones(2, dtype=torch.int32))
    assert spec_verify_step.applies(md)
    assert not spec_verify_step.applies(SimpleNamespace(**{**vars(md), "num_accepted_tokens": None}))
    assert not spec_verify_step.applies(SimpleNamespace(**{**vars(md), "num_prefills": 1}))
    assert not spec_verify_step.applies(SimpleNamespace(**{**vars(md), "num_decodes": 1}))
    assert not spec_verify_step.applies(SimpleNamespace(**{**vars(md), "spec_sequence_masks": None}))


def test_installed_vllm_has_what_verify_step_calls():
    """verify_step calls two globals of vLLM's GDN layer module (vLLM 0.32 to 0.34 have both)."""
    pytest.importorskip("vllm")
    from replayssm_patch import versions
    from replayssm_patch.vllm.gdn_layer import vllm_gdn

    caps = versions.capabilities()
    if caps is None or not caps.mtp_cuda:
        pytest.skip("MTP on CUDA is not served with this vLLM")
    assert callable(vllm_gdn.causal_conv1d_update) and callable(vllm_gdn.is_conv_state_dim_first)
