"""The kernel wrappers' argument binding (intercept._binder) and what they preserve of the
function they wrap: name, signature, __wrapped__."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torch")

from replayssm_patch import intercept  # noqa: E402


def native(q, k, v, scale=None, initial_state=None, *, use_qk_l2norm_in_kernel=False, out=None):
    return q


def test_binding_names_every_argument_as_python_would():
    bind = intercept._binder(native)
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
    bind = intercept._binder(native)
    first = bind((), {"q": 1, "k": 2, "v": 3})
    first["scale"] = "changed"
    assert bind((), {"q": 1, "k": 2, "v": 3})["scale"] is None


@pytest.mark.parametrize("make", [intercept.make_packed_decode_wrapper, intercept.make_sigmoid_update_wrapper,
                                  intercept.make_cpu_update_wrapper, intercept.make_cpu_spec_update_wrapper])
def test_wrappers_keep_name_signature_and_wrapped(make):
    w = make(native)
    assert w.__wrapped__ is native and w.__name__ == "native"
    assert inspect.signature(w) == inspect.signature(native)


@pytest.mark.parametrize("make", [intercept.make_packed_decode_wrapper, intercept.make_sigmoid_update_wrapper,
                                  intercept.make_cpu_update_wrapper, intercept.make_cpu_spec_update_wrapper])
def test_outside_a_ring_call_the_native_function_gets_the_call_as_made(make):
    """No ring layer is running (every GDN layer native, or a prefill path): the wrapper hands
    vLLM's function the call as made, positional arguments as positional, without binding."""
    calls = []

    def spy(*args, **kw):
        calls.append((args, kw))
        return "native"

    assert intercept._active is None
    assert make(spy)(1, 2, v=3) == "native" and calls == [((1, 2), {"v": 3})]
