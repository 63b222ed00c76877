"""The kernels' launch selection (replayssm_patch._vendored.launch): the table's picks, the
launch records' checks and the override block. Pure Python: nothing is launched."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from replayssm_patch._vendored import launch as lt  # noqa: E402
from replayssm_patch._vendored.launch import DecodeLaunch, VerifyLaunch, override_launch  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CUDA = torch.device("cuda", 0)


@pytest.fixture
def h200(monkeypatch):
    """Pick as on a 132-SM GPU (no GPU needed: nothing runs)."""
    monkeypatch.setattr(lt, "num_sms", lambda device: 132)


# (rows, HV, state, ring) -> launch on a 132-SM GPU with L = 16: the table of docs/kernels.md.
EXPECTED = [
    (1, 32, BF16, BF16, DecodeLaunch("fused", 16, flush_tc=True)),
    (2, 32, F32, BF16, DecodeLaunch("fused", 16, flush_tc=True)),
    (4, 32, F32, BF16, DecodeLaunch("fused", 16, flush_tc=True)),      # 128 pairs, fp32 state
    (4, 32, BF16, BF16, DecodeLaunch("fused", 32)),                    # 128 pairs, 16-bit state
    (8, 32, BF16, BF16, DecodeLaunch("two_phase", 32, pdl=True, flush_tc=True)),
    (8, 32, F32, BF16, DecodeLaunch("fused", 32)),
    (16, 32, F32, BF16, DecodeLaunch("two_phase", 16, pdl=True, flush_tc=True)),
    (32, 32, F32, BF16, DecodeLaunch("two_phase", 8)),
    (256, 32, BF16, BF16, DecodeLaunch("replay", 16)),
    (256, 32, F32, BF16, DecodeLaunch("replay", 8)),
    (256, 32, F32, F32, DecodeLaunch("two_phase", 8)),
    (1, 32, F32, F32, DecodeLaunch("fused", 8)),
    (2, 32, F32, F32, DecodeLaunch("fused", 16)),
    (4, 32, F32, F32, DecodeLaunch("fused", 32)),
    (16, 32, F32, F32, DecodeLaunch("two_phase", 8)),
]


@pytest.mark.parametrize("rows,HV,state,ring,want", EXPECTED)
def test_table_picks(h200, rows, HV, state, ring, want):
    assert lt.pick_decode_launch(rows, HV, state, ring, 16, CUDA) == want


def test_table_covers_every_size_with_valid_launches(h200):
    for state in (F32, BF16, F16):
        for ring in (F32, BF16, F16):
            for L in (4, 16, 32):
                for rows in range(1, 600):
                    got = lt.pick_decode_launch(rows, 32, state, ring, L, CUDA)
                    assert isinstance(got, DecodeLaunch)
                    # The tensor-core flush only where it can run.
                    assert not got.flush_tc or lt.flush_tc_supported(ring, L, CUDA)


def test_table_scales_by_sm_count(monkeypatch):
    monkeypatch.setattr(lt, "num_sms", lambda device: 66)  # half the SMs: half the rows per form
    assert lt.pick_decode_launch(8, 32, F32, F32, 16, CUDA) == DecodeLaunch("two_phase", 8)


def test_no_tensor_core_flush_with_bf16_ring_in_the_interpreter():
    for rows in (1, 4, 40):
        assert not lt.pick_decode_launch(rows, 32, BF16, BF16, 16, "cpu").flush_tc
    assert lt.pick_decode_launch(1, 32, BF16, F16, 16, "cpu").flush_tc


@pytest.mark.parametrize("kwargs,field", [
    (dict(form="serial", block_v=16), "form"),
    (dict(form="fused", block_v=12), "block_v"),
    (dict(form="fused", block_v=4), "block_v"),
    (dict(form="fused", block_v=16, num_warps=3), "num_warps"),
    (dict(form="fused", block_v=16, pdl=True), "pdl"),
    (dict(form="replay", block_v=16, flush_tc=True), "flush_tc"),
])
def test_decode_launch_rejects_what_no_form_has(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DecodeLaunch(**kwargs)


def test_launch_names_round_trip():
    for row in lt.DECODE_TABLE:
        assert DecodeLaunch.from_name(row.launch.name) == row.launch
    assert DecodeLaunch.from_name("two_phase_bv16_w2_pdl_tc") == DecodeLaunch("two_phase", 16, 2, True, True)
    with pytest.raises(ValueError, match="form_bvN_wM"):
        DecodeLaunch.from_name("16,1,1,0")
    with pytest.raises(ValueError, match="pdl"):
        DecodeLaunch.from_name("replay_bv16_w1_pdl")


def test_verify_launch_checks_and_default():
    assert VerifyLaunch() == VerifyLaunch(32, 1)
    with pytest.raises(ValueError, match="block_v"):
        VerifyLaunch(block_v=4)
    with pytest.raises(ValueError, match="num_warps"):
        VerifyLaunch(num_warps=5)


def test_override_is_scoped_and_nests(h200):
    table = lt.decode_launch(1, 32, F32, F32, 16, CUDA)
    a, b = DecodeLaunch("replay", 32), DecodeLaunch("two_phase", 16)
    with override_launch(decode=a):
        assert lt.decode_launch(1, 32, F32, F32, 16, CUDA) == a
        assert lt.verify_launch() == VerifyLaunch()
        with override_launch(decode=b, verify=VerifyLaunch(16, 4)):
            assert lt.decode_launch(1, 32, F32, F32, 16, CUDA) == b
            assert lt.verify_launch() == VerifyLaunch(16, 4)
        assert lt.decode_launch(1, 32, F32, F32, 16, CUDA) == a
        assert lt.verify_launch() == VerifyLaunch()
    assert lt.decode_launch(1, 32, F32, F32, 16, CUDA) == table
    with override_launch(decode=a):  # an inner block naming only verify keeps the outer decode
        with override_launch(verify=VerifyLaunch(16, 2)):
            assert lt.decode_launch(1, 32, F32, F32, 16, CUDA) == a
            assert lt.verify_launch() == VerifyLaunch(16, 2)
    with pytest.raises(RuntimeError):
        with override_launch(decode=a):
            raise RuntimeError("the block fails")
    assert lt.decode_launch(1, 32, F32, F32, 16, CUDA) == table  # restored after an exception


def test_override_rejects_other_types():
    with pytest.raises(TypeError, match="DecodeLaunch"):
        with override_launch(decode=(16, 1, True)):
            pass
    with pytest.raises(TypeError, match="VerifyLaunch"):
        with override_launch(verify=DecodeLaunch("fused", 16)):
            pass


def test_override_stays_in_its_thread(h200):
    seen = []
    with override_launch(decode=DecodeLaunch("replay", 32)):
        t = threading.Thread(target=lambda: seen.append(lt.decode_launch(1, 32, F32, F32, 16, CUDA)))
        t.start()
        t.join()
    assert seen == [DecodeLaunch("fused", 8)]


def test_package_exports_load_lazily():
    import replayssm_patch._vendored as lib

    for name in lib.__all__:
        assert getattr(lib, name) is not None
    with pytest.raises(AttributeError):
        lib.pick_decode_config  # noqa: B018 (the old name is gone)
