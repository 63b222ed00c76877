"""The launchers' ring checks (`ops.ring_checks.ring_geometry`): the answer is remembered
per layout, and a remembered layout never lets another one through unchecked."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from replayssm_patch.ops import ring_checks  # noqa: E402
from replayssm_patch.ops.ring_checks import ring_geometry  # noqa: E402

SLOTS, H, HV, K, V, L = 6, 2, 4, 16, 32, 8


def _ring(dtype=torch.bfloat16):
    """A page-strided ring, as a layer's views into vLLM's cache."""
    def paged(shape, dt):
        inner = 1
        for s in shape:
            inner *= s
        return torch.zeros(SLOTS, inner + 16, dtype=dt)[:, :inner].view(SLOTS, *shape)

    return (paged((HV, V, K), dtype), paged((HV, L, V), dtype), paged((H, L, K), dtype),
            paged((HV, L), torch.float32), torch.zeros(SLOTS, dtype=torch.int32))


def test_answer_is_the_same_from_memory():
    ring = _ring()
    first = ring_geometry(*ring, 255)
    assert first[:5] == (H, HV, K, V, L)
    assert first[5] == tuple(t.stride(0) for t in ring[:4])
    assert ring_geometry(*ring, 255) == first
    assert ring_geometry(*_ring(), 255) == first  # other tensors, same layout


@pytest.mark.parametrize("which,bad,match", [
    (3, lambda g: g.to(torch.bfloat16), "ring_g must be float32"),  # same shape and strides
    (4, lambda c: torch.zeros(2 * SLOTS, dtype=torch.int32)[::2], "cursor"),  # same shape
    (4, lambda c: c.long(), "cursor"),
    (1, lambda d: d.transpose(2, 3).contiguous().transpose(2, 3), "ring_d must be contiguous"),
    (0, lambda s: s.to(torch.int8), "state must be float32, bfloat16 or float16"),
])
def test_a_remembered_layout_lets_no_other_through(which, bad, match):
    ring = _ring()
    ring_geometry(*ring, 255)  # remembered
    broken = list(ring)
    broken[which] = bad(ring[which])
    assert broken[which].shape == ring[which].shape
    for _ in range(2):  # refused every time, not remembered
        with pytest.raises(ValueError, match=match):
            ring_geometry(*broken, 255)
    with pytest.raises(ValueError, match="ring length"):
        ring_geometry(*ring, L - 1)  # the bound is part of the layout too


@pytest.mark.slow
def test_memory_stays_bounded():
    for slots in range(1, ring_checks._GEOMETRY_MAX + 20):
        ring_geometry(torch.zeros(slots, HV, V, K), torch.zeros(slots, HV, L, V), torch.zeros(slots, H, L, K),
                      torch.zeros(slots, HV, L), torch.zeros(slots, dtype=torch.int32), 255)
        assert len(ring_checks._GEOMETRY) <= ring_checks._GEOMETRY_MAX
