"""The kernel wrappers' scaffold (ring.call): their argument binding, what they preserve of the
function they wrap (name, signature, __wrapped__), and the active ring call as a ContextVar."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from replayssm_patch.ring import call  # noqa: E402
from replayssm_patch.vllm import cpu_spec_update, cpu_update, packed_decode, sigmoid_update  # noqa: E402

WRAPPERS = [packed_decode.make_wrapper, sigmoid_update.make_wrapper, cpu_update.make_wrapper,
            cpu_spec_update.make_wrapper]


def native(q, k, v, scale=None, initial_state=None, *, use_qk_l2norm_in_kernel=False, out=None):
    return q


def test_binding_names_every_argument_as_python_would():
    bind = call.binder(native)
    want = inspect.signature(native).bind(1, 2, v=3, out=4)
    want.apply_defaults()
    assert bind((1, 2), {"v": 3, "out": 4}) == dict(want.arguments)
    assert bind((), {"q": 1, "k": 2, "v": 3}) == {"q": 1, "k": 2, "v": 3, "scale": None, "initial_state": None,
                                                  "use_qk_l2norm_in_kernel": False, "out": None}
    with pytest.raises(TypeError, match="multiple values"):
        bind((1, 2), {"q": 5})
    with pytest.raises(TypeError, match="takes 7 arguments"):
        bind(tuple(range(8)), {})


def test_a_binding_is_a_fresh_dict():
    bind = call.binder(native)
    first = bind((), {"q": 1, "k": 2, "v": 3})
    first["scale"] = "changed"
    assert bind((), {"q": 1, "k": 2, "v": 3})["scale"] is None


@pytest.mark.parametrize("make", WRAPPERS)
def test_wrappers_keep_name_signature_and_wrapped(make):
    w = make(native)
    assert w.__wrapped__ is native and w.__name__ == "native"
    assert inspect.signature(w) == inspect.signature(native)


@pytest.mark.parametrize("make", WRAPPERS)
def test_outside_a_ring_call_the_native_function_gets_the_call_as_made(make):
    """No ring layer is running (every GDN layer native, or a prefill path): the wrapper hands
    vLLM's function the call as made, positional arguments as positional, without binding."""
    calls = []

    def spy(*args, **kw):
        calls.append((args, kw))
        return "native"

    assert call.active() is None
    assert make(spy)(1, 2, v=3) == "native" and calls == [((1, 2), {"v": 3})]


def test_a_ring_call_is_active_only_inside_its_block_and_never_nested():
    state = torch.zeros(3, 2)
    c = call.RingCall(state, ring=None, ops=None, force_flush=state, start_empty=state, scale=1.0)
    with call.ring_call(c):
        assert call.active() is c and call.call_for(state) is c and call.call_for(state.t()) is c
        assert call.call_for(torch.zeros(3, 2)) is None  # another layer's state
        with pytest.raises(RuntimeError, match="nested"):
            with call.ring_call(c):
                pass
    assert call.active() is None
