"""Activation: the version gate, the patch table's probes against the installed and released
vLLM, install and revert, and that the table declares every change install() makes."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from packaging.version import Version

from replayssm_patch import versions
from replayssm_patch import vllm as patch_points
from replayssm_patch.config import ReplayConfig
from replayssm_patch.testing import cache_dir

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")


# -- version gate and probes --------------------------------------------------------------------
def test_probes_pass_on_installed_vllm():
    assert patch_points.run_probes(cpu=True) == []
    assert patch_points.run_probes(cpu=True, unconditional=True) == []
    assert patch_points.runtime_signatures() == []


def test_probe_detects_a_changed_patch_point():
    src = versions.installed_source(versions.QWEN_GDN)
    changed = src.replace("def _forward_core(\n        self,\n        mixed_qkv", "def _forward_core(\n        self,\n        qkv", 1)
    assert changed != src
    failures = patch_points.run_probes(lambda p: changed if p == versions.QWEN_GDN else versions.installed_source(p))
    assert any("_forward_core" in f for f in failures), failures
    missing = patch_points.run_probes(lambda p: None if p == versions.GDN_BUILDER else versions.installed_source(p))
    assert any("gdn_attn.py missing" in f for f in missing)


RELEASES = ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


@pytest.fixture(scope="module")
def wheel_dir():
    d = cache_dir() / "wheels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _released_sources(release: str, wheel_dir):
    """A reader of the released CUDA wheel's files (downloaded once into the test cache)."""
    wheels = list(wheel_dir.glob(f"vllm-{release}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={release}",
                        "-d", str(wheel_dir)], check=True, timeout=900)
        wheels = list(wheel_dir.glob(f"vllm-{release}-*.whl"))

    def read(path: str) -> str | None:
        with zipfile.ZipFile(wheels[0]) as z:
            return z.read(path).decode() if path in z.namelist() else None

    return read


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_probes_pass_on_released_vllm_sources(release, wheel_dir):
    """The released CUDA wheels are read as zip files (never imported) and probed, each with the
    points that exist in that release."""
    read = _released_sources(release, wheel_dir)
    assert patch_points.run_probes(read, cpu=False, version=Version(release)) == []
    assert patch_points.run_probes(read, cpu=True, version=Version(release)) == []
    assert patch_points.run_probes(read, version=Version(release), unconditional=True) == []  # --use-replayssm


@pytest.mark.slow
def test_probes_see_the_cpu_kernels_move_to_cpu_ops(wheel_dir):
    """vLLM 0.34 moved the CPU GDN kernels from vllm._custom_ops to vllm._cpu_ops: 0.33's points
    fail their probes on 0.34's sources, and 0.34's on 0.33's."""
    new, old = _released_sources("0.34.0", wheel_dir), _released_sources("0.33.0", wheel_dir)
    moved = patch_points.run_probes(new, cpu=True, version=Version("0.33.0"))
    assert any("CPU decode kernel" in f for f in moved) and any("vllm._custom_ops as ops" in f for f in moved), moved
    back = patch_points.run_probes(old, cpu=True, version=Version("0.34.0"))
    assert any("_cpu_ops.py missing" in f for f in back), back


@pytest.mark.parametrize("release", RELEASES)
def test_the_cpu_kernel_points_name_the_module_of_their_release(release):
    version = Version(release)
    kernels = [p for p in patch_points.points_for("cpu", version) if p.attribute.endswith("_cpu")]
    assert sorted(p.attribute for p in kernels) == ["fused_sigmoid_gating_delta_rule_update_cpu",
                                                     "fused_sigmoid_gating_delta_rule_update_spec_cpu"]
    assert {p.module for p in kernels} == {versions.cpu_ops_module(version)}
    assert versions.cpu_ops_module(version) == ("vllm._cpu_ops" if version >= Version("0.34") else "vllm._custom_ops")
    assert not any(p.attribute.endswith("_cpu") for p in patch_points.points_for("cuda", version))


def test_installed_capabilities_name_the_cpu_ops_module():
    caps = versions.capabilities()
    assert caps.cpu_ops_module == versions.cpu_ops_module(caps.version)
    assert caps.mrv2_only == (caps.version >= Version("0.34"))


def test_version_range():
    ok = [versions.parse_version(v) for v in ("0.29.0", "0.31.0", "0.32.0+cpu", "0.33.1", "0.34.0", "0.34.2",
                                              "0.34.0+cpu")]
    bad = [versions.parse_version(v) for v in ("0.28.2", "0.35.0", "0.35.0rc1", "1.0.0")]
    assert all(versions.version_in_range(v) for v in ok)
    assert not any(versions.version_in_range(v) for v in bad)


@pytest.mark.parametrize("version,accepted", [("0.34.0", True), ("0.34.3", True), ("0.35.0", False)])
def test_the_version_gate_accepts_034_and_refuses_035(version, accepted, clean_patch_state, monkeypatch):
    """The gate itself (the probes that follow read the installed vLLM's files, whatever
    version it is said to be here)."""
    from replayssm_patch import activation

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: version)
    reasons = activation.refusal_reasons(versions.platform_name())
    assert any("outside the supported range" in r for r in reasons) != accepted, reasons
    assert versions.SUPPORTED_RANGE == ">=0.29, <0.35"


def test_out_of_range_version_is_refused_cleanly(clean_patch_state, monkeypatch):
    from replayssm_patch import activation
    from replayssm_patch.state import PatchRefused

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.28.0")
    report = activation.apply(ReplayConfig(enable=True))
    assert report["applied"] is False and report["patched"] == []
    assert "outside the supported range" in report["reasons"][0]
    with pytest.raises(PatchRefused, match="outside the supported range"):
        activation.apply(ReplayConfig(enable=True, ring_len=8, strict=True))


def test_unsloth_backport_is_not_doubled(clean_patch_state, monkeypatch):
    from replayssm_patch import activation

    monkeypatch.setenv("UNSLOTH_VLLM_REPLAYSSM", "1")
    report = activation.apply(ReplayConfig(enable=True))
    assert report["applied"] is False and "unsloth" in report["reasons"][0]


def test_layer_already_replaced_by_someone_else(clean_patch_state):
    from vllm.model_executor.custom_op import op_registry_oot

    class Other:
        pass

    from replayssm_patch import activation

    op_registry_oot["QwenGatedDeltaNetAttention"] = Other
    try:
        report = activation.apply(ReplayConfig(enable=True))
    finally:
        op_registry_oot.pop("QwenGatedDeltaNetAttention", None)
    assert report["applied"] is False and "already replaced" in report["reasons"][0]


def test_apply_and_revert_restore_vllm(clean_patch_state):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as mod

    from replayssm_patch import activation

    native = mod.fused_recurrent_gated_delta_rule_packed_decode
    report = activation.apply(ReplayConfig(enable=True))
    assert report["applied"], report
    assert op_registry_oot["QwenGatedDeltaNetAttention"].__name__ == "ReplayQwenGDN"
    assert mod.fused_recurrent_gated_delta_rule_packed_decode is not native
    assert activation.apply(ReplayConfig(enable=True))["applied"]  # idempotent
    activation.revert()
    assert "QwenGatedDeltaNetAttention" not in op_registry_oot
    assert mod.fused_recurrent_gated_delta_rule_packed_decode is native


def _vllm_surface() -> dict:
    """Every attribute of every loaded vLLM module and of the classes they define, by identity."""
    import inspect

    from vllm.model_executor.custom_op import op_registry_oot

    seen = {f"op_registry_oot[{k}]": id(v) for k, v in op_registry_oot.items()}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            seen[f"{name}.{attr}"] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    seen[f"{name}.{attr}.{cattr}"] = id(cvalue)
    return seen


def test_the_table_declares_everything_install_changes(clean_patch_state):
    """install() touches only what the table's "process start" points name: the vLLM modules'
    and classes' attributes before and after it, compared."""
    import importlib

    from replayssm_patch import activation

    platform = versions.platform_name()
    points = patch_points.points_for(platform, versions.capabilities().version)
    for p in points:  # loaded first, so that their import is not taken for a change
        if p.applies == "process start":
            importlib.import_module(p.module)
    before = _vllm_surface()
    assert activation.apply(ReplayConfig(enable=True))["applied"]
    after = _vllm_surface()
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    declared = {p.name for p in points if p.applies == "process start"}
    declared |= {f"op_registry_oot[{p.attribute}]" for p in patch_points.POINTS if p.kind == "register_oot"}
    # an attribute of a module that re-exports another module's (vllm._custom_ops in both)
    assert changed and changed <= declared, sorted(changed - declared)
    activation.revert()
    reverted = _vllm_surface()
    assert {k for k in before if before[k] != reverted.get(k)} == set()


def test_every_point_says_what_why_how_and_when_it_goes():
    for p in patch_points.POINTS:
        assert p.kind in ("register_oot", "wrap", "class hooks", "attribute", "call", "environment"), p
        assert p.applies in ("process start", "first ring layer", "ring layer", "ring backend"), p
        assert all((p.what, p.why, p.how, p.upstream, p.remove_when)), p
        assert p.required is False or p.probes or p.applies != "process start", p
        assert not p.unconditional or (p.probes and p.applies == "process start" and p.kind == "wrap"), p
