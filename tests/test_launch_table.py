"""The kernels' launch selection (replayssm_patch.ops.launch): the table's picks, the
launch records' checks and the override block. Pure Python: nothing is launched."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from replayssm_patch.ops import launch as lt  # noqa: E402
from replayssm_patch.ops.launch import DecodeLaunch, VerifyLaunch, override_launch  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CUDA = torch.device("cuda", 0)


@pytest.fixture
def h200(monkeypatch):
    """Pick as on a 132-SM GPU (no GPU needed: nothing runs)."""
    monkeypatch.setattr(lt, "num_sms", lambda device: 132)


# (rows, HV, state, ring) -> launch on a 132-SM GPU with L = 16 and no TMA form (GPUs before
# Hopper): the Triton rows of the table in docs/kernels.md.
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


# The same where the TMA form runs (an H200): its rows come first where they apply.
EXPECTED_TMA = [
    (8, 32, F32, BF16, DecodeLaunch("fused", 32)),                       # 256 pairs: below its rows
    (16, 32, F32, BF16, DecodeLaunch("tma", 16, 2, stages=1)),           # 512 pairs, fp32 state
    (64, 32, F32, F32, DecodeLaunch("tma", 16, 2, stages=1)),            # 2048 pairs
    (511, 32, F32, F32, DecodeLaunch("tma", 16, 2, stages=1)),           # 16352 pairs
    (512, 32, F32, F32, DecodeLaunch("tma", 32, 4, stages=2)),           # 16384 pairs: two stages
    (512, 64, F32, BF16, DecodeLaunch("tma", 32, 4, stages=2)),          # fp32 state: up to any size
    (16, 32, BF16, BF16, DecodeLaunch("tma", 32, 4, pdl=True, stages=1)),  # 16-bit state, 512 pairs
    (31, 32, BF16, BF16, DecodeLaunch("tma", 32, 4, pdl=True, stages=1)),  # 992 pairs
    (32, 32, BF16, BF16, DecodeLaunch("tma", 32, 1, stages=1, matvec_tc=True)),  # 1024: tensor-core mat-vecs
    (64, 32, F16, F16, DecodeLaunch("tma", 32, 1, stages=1, matvec_tc=True)),
    (127, 32, BF16, BF16, DecodeLaunch("tma", 32, 1, stages=1, matvec_tc=True)),
    (128, 32, BF16, BF16, DecodeLaunch("tma", 64, 2, stages=1, matvec_tc=True)),  # 4096 pairs
    (256, 32, BF16, BF16, DecodeLaunch("tma", 64, 2, stages=1, matvec_tc=True)),
    (512, 64, BF16, BF16, DecodeLaunch("tma", 64, 2, stages=1, matvec_tc=True)),
    (64, 32, BF16, F32, DecodeLaunch("tma", 32, 2, stages=2, max_regs=168)),  # fp32 ring: the FMA mat-vecs
    (256, 32, BF16, F32, DecodeLaunch("replay", 16)),                    # 8192 pairs: replay wins
    (4, 32, BF16, BF16, DecodeLaunch("fused", 32)),
]


@pytest.mark.parametrize("rows,HV,state,ring,want", EXPECTED)
def test_table_picks(h200, rows, HV, state, ring, want):
    assert lt.pick_decode_launch(rows, HV, state, ring, 16, CUDA, tma=False) == want


@pytest.mark.parametrize("rows,HV,state,ring,want", EXPECTED_TMA)
def test_table_picks_with_tma(h200, rows, HV, state, ring, want):
    assert lt.pick_decode_launch(rows, HV, state, ring, 16, CUDA, tma=True) == want


def test_tma_form_only_where_it_runs(h200):
    """The interpreter (and a GPU before Hopper) never gets a TMA launch from the table, and a
    pick asked to leave it out (a checkpoint it cannot address) falls to the Triton rows."""
    assert not lt.tma_capable(torch.device("cpu"))
    for rows in (16, 64, 512):
        assert lt.pick_decode_launch(rows, 32, F32, F32, 16, "cpu").form != "tma"
    assert lt.decode_launch(64, 32, F32, F32, 16, torch.device("cpu"), tma=False) == DecodeLaunch("two_phase", 8)


def test_tma_form_only_on_the_triton_release_it_is_written_for():
    """Gluon's API moves between Triton releases: only the tested release gets the TMA form."""
    assert lt.gluon_release_ok("3.6.0") and lt.gluon_release_ok("3.6.1")
    for version in ("3.5.1", "3.7.0", "3.9.0", "3.60.0"):
        assert not lt.gluon_release_ok(version)


def test_tma_fits_checks_the_checkpoint_layout():
    state = torch.zeros(4, 2, 128, 128)
    assert lt.tma_fits(state, 128, 128, 32, state.stride(0))
    assert not lt.tma_fits(state, 128, 128, 512, state.stride(0))  # block_v > 256
    assert not lt.tma_fits(state, 96, 128, 32, state.stride(0))    # K not a power of two
    assert not lt.tma_fits(state, 128, 80, 32, state.stride(0))    # V not a multiple of block_v
    page = torch.zeros(4, 2 * 128 * 128 + 3)                       # slot stride of 3 extra floats
    view = page[:, :2 * 128 * 128].view(4, 2, 128, 128)
    assert not lt.tma_fits(view, 128, 128, 32, page.stride(0))
    assert not lt.tma_fits(page[:, 1:1 + 2 * 128 * 128].view(4, 2, 128, 128), 128, 128, 32, 2 * 128 * 128 + 4)


def test_table_covers_every_size_with_valid_launches(h200):
    for state in (F32, BF16, F16):
        for ring in (F32, BF16, F16):
            for L, tma in ((4, False), (16, False), (32, False), (16, True), (32, True)):
                for rows in range(1, 600):
                    got = lt.pick_decode_launch(rows, 32, state, ring, L, CUDA, tma=tma)
                    assert isinstance(got, DecodeLaunch) and (tma or got.form != "tma")
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
    (dict(form="tma", block_v=32, flush_tc=True, stages=2), "flush_tc"),
    (dict(form="tma", block_v=32, stages=0), "stages"),
    (dict(form="tma", block_v=32, stages=9), "stages"),
    (dict(form="two_phase", block_v=32, stages=2), "stages"),
    (dict(form="replay", block_v=16, pdl=True), "pdl"),
    (dict(form="tma", block_v=32, stages=2, max_regs=16), "max_regs"),
    (dict(form="tma", block_v=32, stages=2, max_regs=256), "max_regs"),
    (dict(form="two_phase", block_v=8, max_regs=128), "max_regs"),
    (dict(form="two_phase", block_v=32, matvec_tc=True), "matvec_tc"),
    (dict(form="tma", block_v=32, num_warps=4, stages=2, matvec_tc=True), "16 value rows per warp"),
])
def test_decode_launch_rejects_what_no_form_has(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DecodeLaunch(**kwargs)


def test_launch_names_round_trip():
    for row in lt.DECODE_TABLE:
        assert DecodeLaunch.from_name(row.launch.name) == row.launch
    assert DecodeLaunch.from_name("two_phase_bv16_w2_pdl_tc") == DecodeLaunch("two_phase", 16, 2, True, True)
    tma = DecodeLaunch("tma", 32, 4, pdl=True, stages=3)
    assert tma.name == "tma_bv32_w4_pdl_s3" and DecodeLaunch.from_name(tma.name) == tma
    capped = DecodeLaunch("tma", 32, 2, stages=2, max_regs=128)
    assert capped.name == "tma_bv32_w2_s2_r128" and DecodeLaunch.from_name(capped.name) == capped
    mv = DecodeLaunch("tma", 64, 4, pdl=True, stages=3, max_regs=96, matvec_tc=True)
    assert mv.name == "tma_bv64_w4_pdl_s3_r96_mv" and DecodeLaunch.from_name(mv.name) == mv
    with pytest.raises(ValueError, match="stages"):
        DecodeLaunch.from_name("fused_bv16_w1_s2")
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
    import replayssm_patch.ops as lib

    for name in lib.__all__:
        assert getattr(lib, name) is not None
    with pytest.raises(AttributeError):
        lib.pick_decode_config  # noqa: B018 (the old name is gone)


def test_tma_launch_refused_with_a_reason_where_it_cannot_run():
    """An override naming the TMA form off Hopper fails with the launch's name and what the form
    needs, before anything is launched or imported from Gluon."""
    from replayssm_patch.ops import ring_decode

    H, HV, K, L, N = 1, 2, 16, 4, 2
    qkv = torch.zeros(N, 2 * H * K + HV * K)
    args = (qkv, torch.zeros(N, HV), torch.zeros(N, HV), torch.zeros(HV), torch.zeros(HV), 1.0,
            torch.zeros(3, HV, K, K), torch.empty(N, HV, K), torch.arange(1, N + 1, dtype=torch.int32),
            torch.zeros(3, HV, L, K), torch.zeros(3, H, L, K), torch.zeros(3, HV, L), torch.zeros(3, dtype=torch.int32))
    with override_launch(decode=DecodeLaunch("tma", 16, 4, stages=2)):
        with pytest.raises(ValueError, match=r"tma_bv16_w4_s2: the TMA form needs a Hopper GPU \(CUDA capability 9.x\) and Triton 3.6.x"):
            ring_decode(*args)


def test_tma_launch_refused_for_a_checkpoint_it_cannot_address(monkeypatch):
    """Where the form runs, an override naming it for a checkpoint it cannot address (V not a
    multiple of block_v) is refused with what it needs; nothing is launched."""
    from replayssm_patch.ops import decode, ring_decode

    monkeypatch.setattr(decode, "tma_capable", lambda device: True)
    H, HV, K, V, L, N = 1, 2, 16, 24, 4, 2
    args = (torch.zeros(N, 2 * H * K + HV * V), torch.zeros(N, HV), torch.zeros(N, HV), torch.zeros(HV),
            torch.zeros(HV), 1.0, torch.zeros(3, HV, V, K), torch.empty(N, HV, V),
            torch.arange(1, N + 1, dtype=torch.int32), torch.zeros(3, HV, L, V), torch.zeros(3, H, L, K),
            torch.zeros(3, HV, L), torch.zeros(3, dtype=torch.int32))
    with override_launch(decode=DecodeLaunch("tma", 16, 4, stages=2)):
        with pytest.raises(ValueError, match=r"tma_bv16_w4_s2: the TMA form needs .* V a multiple of block_v=16"):
            ring_decode(*args)


@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_tensor_core_matvec_launch_refused_for_an_fp32_state_or_small_k(monkeypatch, state_dtype):
    """The tensor-core mat-vecs take the checkpoint as 16-bit MMA operands, two MMA steps of 16
    keys at least: an override naming them for an fp32 state or K = 16 is refused with the
    launch's name and what it needs."""
    from replayssm_patch.ops import decode, ring_decode

    monkeypatch.setattr(decode, "tma_capable", lambda device: True)
    H, HV, K, L, N = 1, 2, 16, 4, 2
    args = (torch.zeros(N, 2 * H * K + HV * K), torch.zeros(N, HV), torch.zeros(N, HV), torch.zeros(HV),
            torch.zeros(HV), 1.0, torch.zeros(3, HV, K, K, dtype=state_dtype), torch.empty(N, HV, K),
            torch.arange(1, N + 1, dtype=torch.int32), torch.zeros(3, HV, L, K), torch.zeros(3, H, L, K),
            torch.zeros(3, HV, L), torch.zeros(3, dtype=torch.int32))
    with override_launch(decode=DecodeLaunch("tma", 16, 1, stages=2, matvec_tc=True)):
        with pytest.raises(ValueError, match=r"tma_bv16_w1_s2_mv: the tensor-core mat-vecs \(_mv\) need a float16 "
                                             rf"or bfloat16 state and K >= 32 \(got {state_dtype}, K=16\)"):
            ring_decode(*args)
