"""How a ring layer binds its KV-cache pages (vllm.gdn_layer.ReplayQwenGDN.bind_kv_cache), on the
real class built without vLLM's __init__ (a CPU ring of a few slots, no model):

* the ring's tensors follow vLLM's states in the page, packed as vLLM >= 0.34 packs states
  (each at the layer's `state_alignment`), and the page the model-class hook sizes holds them;
* vLLM 0.34's extensible KV cache binds its reserved capacity, captures CUDA graphs, then
  rebinds fewer blocks at the same addresses: the cursor tensor keeps its address and contents
  (FULL graphs hold that address) and the ring's views and ops take the new block count;
* poison (a testing aid) never writes a first bind of an extensible cache, most of which has no
  memory behind it yet, and poisons the rebind over the committed blocks.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace
from math import prod
from types import SimpleNamespace

import pytest
import torch

from replayssm_patch.config import ReplayConfig
from replayssm_patch.plan import Plan, RingGeometry

if not os.environ.get("CI"):
    pytest.importorskip("vllm")

from replayssm_patch.ring import shadow  # noqa: E402
from replayssm_patch.ring.runtime import CpuRingOps  # noqa: E402
from replayssm_patch.testing.engine_runner import fresh_cursor  # noqa: E402
from replayssm_patch.vllm import model_class  # noqa: E402
from replayssm_patch.vllm.gdn_backend import state_offsets  # noqa: E402
from replayssm_patch.vllm.gdn_layer import ReplayQwenGDN  # noqa: E402

H, HV, K, V, L = 2, 4, 16, 16, 4
GEOMETRY = RingGeometry(H, HV, K, V, L, torch.float32, torch.float32)
# vLLM's own states: a conv state whose byte size (84) is a multiple of 4 but not of 16, and the SSM state
NATIVE_SHAPES = ((3, 14), GEOMETRY.gdn_state_shape)
NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _sizes() -> list[int]:
    return [prod(s) * d.itemsize for s, d in zip(NATIVE_SHAPES + GEOMETRY.shapes, NATIVE_DTYPES + GEOMETRY.dtypes)]


def _content_bytes(alignment: int) -> int:
    """vLLM 0.34's MambaSpec.state_content_size_bytes of the ring layer's spec."""
    return sum(_round_up(n, alignment) for n in _sizes())


def ring_layer(alignment: int | None = None, extensible: bool = False) -> ReplayQwenGDN:
    """The real layer class, with only what binding reads: a CPU ring plan, vLLM's state shapes,
    the cache config and (vLLM >= 0.34) the state alignment."""
    layer = ReplayQwenGDN.__new__(ReplayQwenGDN)
    torch.nn.Module.__init__(layer)
    layer.ring_plan = Plan("cpu", GEOMETRY, min_batch=1)
    layer.ring_ops = CpuRingOps(Counter())
    layer.ring_cache_config = SimpleNamespace(enable_extensible_kv_cache=extensible)
    layer.get_state_shape = lambda: NATIVE_SHAPES
    layer.get_state_dtype = lambda: NATIVE_DTYPES
    if alignment is not None:
        layer.state_alignment = alignment
    return layer


def pages(blocks: int, page_bytes: int, fill: int = 0) -> torch.Tensor:
    """A raw KV-cache page tensor as vLLM hands it to bind_kv_cache: [blocks, 1, 1, bytes] int8."""
    return torch.full((blocks, 1, 1, page_bytes), fill, dtype=torch.int8)


# -- packing ----------------------------------------------------------------------------------
def test_state_offsets_round_every_size_up_to_the_alignment():
    assert state_offsets([84, 4096, 64], 1) == [0, 84, 4180]
    assert state_offsets([84, 4096, 64], 16) == [0, 96, 4192]
    assert state_offsets([84, 4096, 64], 128) == [0, 128, 4224]
    assert state_offsets([], 16) == []


@pytest.mark.parametrize("alignment", [None, 1, 16, 128])
def test_ring_views_follow_vllms_state_packing(alignment, clean_patch_state):
    """Each ring tensor starts where vLLM >= 0.34 packs the next state (every state's size rounded
    up to the layer's state_alignment; none: vLLM < 0.34, unaligned) and the last one ends within
    the content vLLM's spec counts."""
    a = alignment or 1
    content = _content_bytes(a)
    raw = pages(5, content + 32)  # + vLLM's padding up to the attention page
    layer = ring_layer(alignment)
    layer.bind_kv_cache(raw)
    ring = layer.replay_ring
    expected, end = [], 0
    for n in _sizes():
        expected.append(end)
        end += _round_up(n, a)
    got = [t.data_ptr() - raw.data_ptr() for t in (ring.g, ring.d, ring.k)]
    assert got == expected[len(NATIVE_SHAPES):]
    assert all(start % a == 0 for start in got)
    assert got[-1] + ring.k[0].numel() * ring.k.element_size() <= content
    assert [tuple(t.shape[1:]) for t in (ring.g, ring.d, ring.k)] == list(GEOMETRY.shapes)
    assert all(t.stride(0) * t.element_size() == raw.shape[-1] for t in (ring.g, ring.d, ring.k))  # one page a slot
    assert all(t.shape[0] == 5 for t in (ring.g, ring.d, ring.k, ring.cursor))


@dataclass(frozen=True)
class MambaSpec034:
    """vLLM 0.34's MambaSpec as far as the page size goes (written from its rule: every state's
    size rounded up to state_alignment, summed; the installed vLLM may predate the field)."""

    shapes: tuple
    dtypes: tuple
    block_size: int
    state_alignment: int = 1

    @property
    def page_size_bytes(self) -> int:
        return sum(_round_up(prod(s) * d.itemsize, self.state_alignment) for s, d in zip(self.shapes, self.dtypes))


@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_the_page_hook_sizes_the_page_the_layer_binds(alignment, monkeypatch, clean_patch_state):
    """A model class without get_mamba_specs_from_config (the Qwen3.5 classes) gets the hook's
    spec, with the alignment vLLM >= 0.34 sizes the page with; a layer of that alignment binds
    its ring inside exactly that page."""
    from replayssm_patch import versions
    import vllm.model_executor.layers.mamba.mamba_utils as mamba_utils
    import vllm.v1.kv_cache_interface as kv_interface

    class Model:
        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            return NATIVE_SHAPES

        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config):
            return NATIVE_DTYPES

    caps = versions.capabilities()
    monkeypatch.setattr(versions, "capabilities", lambda: replace(caps, platform_prefers_specs=True,
                                                                  state_alignment=True))
    monkeypatch.setattr(kv_interface, "MambaSpec", MambaSpec034)
    monkeypatch.setattr(mamba_utils, "mamba_state_alignment", lambda vllm_config: alignment, raising=False)
    monkeypatch.setattr(model_class, "_model_class", lambda vllm_config: Model)
    ring_shapes = (GEOMETRY.shapes, GEOMETRY.dtypes, GEOMETRY.gdn_state_shape)
    assert model_class.ensure(object(), lambda vllm_config: ring_shapes, clean_patch_state) == (True, "")
    (spec,) = Model.get_mamba_specs_from_config(object())
    assert spec.state_alignment == alignment and spec.shapes == NATIVE_SHAPES + GEOMETRY.shapes
    assert spec.page_size_bytes == _content_bytes(alignment)

    raw = pages(3, spec.page_size_bytes)
    layer = ring_layer(alignment)
    layer.bind_kv_cache(raw)
    k = layer.replay_ring.k
    assert k.data_ptr() - raw.data_ptr() + _round_up(k[0].numel() * k.element_size(), alignment) == \
        spec.page_size_bytes


def test_the_hook_passes_no_alignment_to_a_vllm_without_it(monkeypatch, clean_patch_state):
    from replayssm_patch import versions

    caps = versions.capabilities()
    monkeypatch.setattr(versions, "capabilities", lambda: replace(caps, state_alignment=False))
    assert model_class._alignment(object()) == {}


# -- the extensible cache's rebind -------------------------------------------------------------
CAPACITY, COMMITTED = 12, 5
PAGE = _content_bytes(1)


def _rebind(layer):
    """Bind the reserved capacity, let the ring run (cursor words set), then rebind a prefix of
    fewer blocks at the same address, as vLLM 0.34's extend_kv_cache does after capture.
    Returns (the capacity's pages, the cursor's address and contents before the rebind)."""
    full = pages(CAPACITY, PAGE)
    layer.bind_kv_cache(full)
    cursor = layer.replay_ring.cursor
    cursor.copy_(torch.arange(CAPACITY, dtype=torch.int32) % L)  # committed entries, no pending window
    before = (cursor.data_ptr(), cursor[:COMMITTED].clone())
    layer.bind_kv_cache(full[:COMMITTED])
    return full, before


def _check_rebind_keeps_what_graphs_hold(layer, full, before):
    ptr, contents = before
    ring = layer.replay_ring
    assert ring.cursor.data_ptr() == ptr, "the cursor moved: CUDA graphs captured before the rebind hold its address"
    assert ring.cursor.shape == (COMMITTED,), "the cursor has more slots than the rebound state (ring ops refuse it)"
    assert torch.equal(ring.cursor, contents), "the cursor lost the slots' ring counts"
    starts = state_offsets(_sizes())[len(NATIVE_SHAPES):]
    for t, start in zip((ring.g, ring.d, ring.k), starts):  # views into the rebound pages, committed blocks only
        assert t.data_ptr() == full.data_ptr() + start and t.shape[0] == COMMITTED
    assert layer.kv_cache[1].shape[0] == COMMITTED
    # the ring's operations take the rebound shapes: the CUDA kernels' checks and the CPU ops
    from replayssm_patch.ops.ring_checks import ring_geometry

    state = layer.ring_state()
    assert ring_geometry(state, ring.d, ring.k, ring.g, ring.cursor, 64)[:5] == (H, HV, K, V, L)
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([1, 3], dtype=torch.int32)
    flags = torch.zeros(2, dtype=torch.int8)
    out = torch.empty(2, HV, V)
    layer.ring_ops.decode(torch.randn(2, 2 * H * K + HV * V, generator=gen), torch.randn(2, HV, generator=gen),
                          torch.randn(2, HV, generator=gen), torch.zeros(HV), torch.zeros(HV), K ** -0.5, state, out,
                          slots, ring, flags, flags)
    layer.ring_ops.materialize(state, ring, slots)
    layer.ring_ops.reset(ring, slots)
    assert torch.isfinite(out).all() and int(ring.cursor[slots].abs().sum()) == 0


def test_an_extensible_rebind_keeps_the_cursor_and_takes_the_new_pages(clean_patch_state):
    from replayssm_patch.state import STATE

    layer = ring_layer(extensible=True)
    full, before = _rebind(layer)
    _check_rebind_keeps_what_graphs_hold(layer, full, before)
    assert STATE.stats["cursor_rebinds"] == 1  # the counter the GPU rebind test reads


def _whole_kept_cursor(self, pages):
    """Keeping the cursor without taking its prefix (capacity-many slots after the rebind, where
    every ring operation checks `cursor.shape == (slots,)`)."""
    if "_ring_cursor" not in self.__dict__:
        self.__dict__["_ring_cursor"] = torch.zeros(pages.shape[0], dtype=torch.int32)
    return self.__dict__["_ring_cursor"], True


@pytest.mark.parametrize("old,fails_with", [(fresh_cursor, "the cursor moved"),
                                            (_whole_kept_cursor, "more slots than the rebound state")])
def test_the_rebind_check_fails_for_the_old_behaviours(old, fails_with, monkeypatch, clean_patch_state):
    """The check above has teeth: a fresh cursor per bind moves the address FULL graphs hold; the
    whole kept cursor has more slots than the rebound state."""
    monkeypatch.setattr(ReplayQwenGDN, "_cursor_for", old)
    layer = ring_layer(extensible=True)
    full, before = _rebind(layer)
    with pytest.raises(AssertionError, match=fails_with):
        _check_rebind_keeps_what_graphs_hold(layer, full, before)


def test_a_larger_rebind_gets_a_new_empty_cursor(clean_patch_state):
    layer = ring_layer()
    layer.bind_kv_cache(pages(4, PAGE))
    layer.replay_ring.cursor.fill_(2)
    layer.bind_kv_cache(pages(6, PAGE))
    assert layer.replay_ring.cursor.shape == (6,) and not layer.replay_ring.cursor.any()


def test_releasing_the_cache_drops_the_ring(clean_patch_state):
    """vLLM releases a layer's cache by assigning kv_cache (clear_layer_kv_caches): the ring's
    views into those pages go with it."""
    layer = ring_layer()
    layer.bind_kv_cache(pages(4, PAGE))
    layer.kv_cache = ()
    assert layer.replay_ring is None


# -- poison -----------------------------------------------------------------------------------
SENTINEL = 0x5A


def test_poison_never_writes_the_first_bind_of_an_extensible_cache(clean_patch_state):
    """That bind spans the reserved capacity, mostly without memory behind it on CUDA: nothing of
    it is written (here: every byte keeps its sentinel), the rings start empty. The rebind over
    the committed blocks is poisoned, and still writes nothing beyond them."""
    clean_patch_state.config = ReplayConfig(poison=True)
    layer = ring_layer(extensible=True)
    full = pages(CAPACITY, PAGE, fill=SENTINEL)
    layer.bind_kv_cache(full)
    assert bool((full == SENTINEL).all()), "the first bind of an extensible cache was written"
    assert not layer.replay_ring.cursor.any() and clean_patch_state.stats["poisoned_slots"] == 0
    layer.bind_kv_cache(full[:COMMITTED])
    ring = layer.replay_ring
    assert bool((ring.d == shadow.POISON_D).all()) and bool((ring.k == shadow.POISON_K).all())
    assert bool(((ring.cursor >= 1) & (ring.cursor < L)).all())
    assert clean_patch_state.stats["poisoned_slots"] == COMMITTED
    assert bool((full[COMMITTED:] == SENTINEL).all()), "the rebind wrote beyond the committed blocks"


def test_poison_fills_every_ring_at_the_first_bind_of_a_plain_cache(clean_patch_state):
    """Without an extensible cache (CPU, or CUDA with it off) the first bind is poisoned, as the
    CPU engine tests rely on."""
    clean_patch_state.config = ReplayConfig(poison=True)
    layer = ring_layer(extensible=False)
    layer.bind_kv_cache(pages(CAPACITY, PAGE))
    ring = layer.replay_ring
    assert bool((ring.d == shadow.POISON_D).all()) and bool(((ring.cursor >= 1) & (ring.cursor < L)).all())
    assert clean_patch_state.stats["poisoned_slots"] == CAPACITY
