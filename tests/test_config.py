"""The options: one ReplayConfig, read from patch() keywords, the environment and doctor's flags."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from replayssm_patch import config
from replayssm_patch.config import OptionError, ReplayConfig

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")

ON = {"VLLM_GDN_REPLAYSSM": "1"}


@pytest.mark.parametrize("var,value", [
    ("VLLM_GDN_REPLAYSSM", "maybe"),
    ("VLLM_GDN_REPLAYSSM_RING", "0"),
    ("VLLM_GDN_REPLAYSSM_RING", "65"),
    ("VLLM_GDN_REPLAYSSM_RING", "sixteen"),
    ("VLLM_GDN_REPLAYSSM_STRICT", "2"),
    ("VLLM_GDN_REPLAYSSM_RING_DTYPE", "int8"),
    ("VLLM_GDN_REPLAYSSM_MTP", "2"),
    ("VLLM_GDN_REPLAYSSM_MTP_KERNEL", "cutlass"),
    ("VLLM_GDN_REPLAYSSM_MIN_BATCH", "0"),
])
def test_invalid_environment_values_name_the_variable(var, value):
    with pytest.raises(OptionError) as e:
        config.from_env({**ON, var: value})
    assert f"{var}={value!r}" in str(e.value) and "accepted values" in str(e.value)


def test_environment_defaults_values_and_round_trip():
    assert config.from_env({}) == ReplayConfig()
    c = config.from_env({**ON, "VLLM_GDN_REPLAYSSM_RING": "32", "VLLM_GDN_REPLAYSSM_STRICT": "true",
                         "VLLM_GDN_REPLAYSSM_RING_DTYPE": "float32", "VLLM_GDN_REPLAYSSM_MIN_BATCH": " 64 ",
                         "VLLM_GDN_REPLAYSSM_MTP": "1", "VLLM_GDN_REPLAYSSM_MTP_KERNEL": " FlashInfer "})
    assert c == ReplayConfig(enable=True, ring_len=32, strict=True, ring_dtype="float32", min_batch=64,
                             allow_mtp="ring", mtp_kernel="flashinfer")
    assert config.from_env(c.to_env()) == c  # what vLLM's other processes read back
    # a blank variable (VAR= in a shell or an env file) means its default
    assert config.from_env({**{v: " " for v in ReplayConfig().to_env()}, **ON}) == ReplayConfig(enable=True)
    for value, mtp in (("0", "native"), ("off", "native"), ("auto", "auto"), ("ring", "ring"), ("yes", "ring")):
        assert config.from_env({**ON, "VLLM_GDN_REPLAYSSM_MTP": value}).allow_mtp == mtp


def test_with_the_switch_off_nothing_else_is_read():
    """The README promises it: a bad value in another variable does not matter while the patch is off."""
    env = {"VLLM_GDN_REPLAYSSM_RING": "abc", "VLLM_GDN_REPLAYSSM_MTP_CUDA": "1"}
    assert config.from_env(env) == ReplayConfig()
    assert config.from_env({**env, "VLLM_GDN_REPLAYSSM": "0"}) == ReplayConfig()


@pytest.mark.parametrize("var", ["VLLM_GDN_REPLAYSSM_MTP_CUDA", "VLLM_GDN_REPLAYSSM_16BIT_STATE"])
def test_retired_variables_are_refused_with_what_to_do(var):
    """Ignoring a variable a user set would silently change what the engine serves."""
    with pytest.raises(OptionError) as e:
        config.from_env({**ON, var: "1"})
    assert var in str(e.value) and ("VLLM_GDN_REPLAYSSM_MTP=1" in str(e.value) or "MIN_BATCH" in str(e.value))


@pytest.mark.parametrize("kwargs,name", [
    ({"ring_len": 0}, "ring_len"), ({"ring_len": 100}, "ring_len"), ({"ring_len": 2.5}, "ring_len"),
    ({"ring_len": True}, "ring_len"), ({"enable": "yes"}, "enable"), ({"strict": 1}, "strict"),
    ({"ring_dtype": "fp8"}, "ring_dtype"), ({"allow_mtp": 1}, "allow_mtp"), ({"mtp_kernel": "fi"}, "mtp_kernel"),
    ({"min_batch": 1.5}, "min_batch"), ({"min_batch": 0}, "min_batch"), ({"ring_lenght": 8}, "ring_lenght"),
    ({"shadow": True}, "shadow"),  # a testing aid: environment only
])
def test_patch_rejects_bad_arguments_without_touching_anything(kwargs, name, monkeypatch, clean_patch_state):
    import replayssm_patch

    monkeypatch.delenv("VLLM_GDN_REPLAYSSM", raising=False)
    with pytest.raises(OptionError) as e:
        replayssm_patch.patch(**kwargs)
    assert name in str(e.value)
    assert "VLLM_GDN_REPLAYSSM" not in os.environ
    assert replayssm_patch.status()["applied"] is False


def test_patch_keywords_reach_the_environment_and_status(monkeypatch, clean_patch_state):
    """patch()'s config goes to the environment vLLM's processes start with, and to status()."""
    import replayssm_patch

    for var in ReplayConfig().to_env():
        monkeypatch.setenv(var, "")  # recorded, so the test's writes are undone
    report = replayssm_patch.patch(allow_mtp=True, min_batch=8, ring_len=12)
    assert report["applied"], report
    assert report["options"]["allow_mtp"] == "ring" and report["options"]["min_batch"] == 8
    assert config.from_env() == ReplayConfig(enable=True, allow_mtp="ring", min_batch=8, ring_len=12)
    replayssm_patch.patch()
    assert config.from_env() == ReplayConfig(enable=True)
    assert replayssm_patch.status()["options"]["allow_mtp"] == "auto"
    replayssm_patch.unpatch()
    assert config.from_env() == ReplayConfig() and not replayssm_patch.status()["applied"]


def test_vllms_flag_gives_the_ring_everywhere_with_its_length():
    """vLLM's --use-replayssm --replayssm-buffer-len N (replayssm_patch.vllm.replayssm_flag):
    enabled, ring_len N, the ring at every batch and for MTP; the environment's options still
    apply where they are not their defaults (VLLM_GDN_REPLAYSSM itself and its ring length do
    not: the flag says them)."""
    assert config.from_vllm_flag(8, {}) == ReplayConfig(enable=True, ring_len=8, min_batch=1, allow_mtp="ring")
    env = {"VLLM_GDN_REPLAYSSM": "0", "VLLM_GDN_REPLAYSSM_RING": "32", "VLLM_GDN_REPLAYSSM_MIN_BATCH": "64",
           "VLLM_GDN_REPLAYSSM_RING_DTYPE": "activation", "VLLM_GDN_REPLAYSSM_SHADOW": "1"}
    assert config.from_vllm_flag(4, env) == ReplayConfig(enable=True, ring_len=4, min_batch=64, allow_mtp="ring",
                                                         ring_dtype="activation", shadow=True)
    with pytest.raises(OptionError, match="VLLM_GDN_REPLAYSSM_MIN_BATCH='0'"):
        config.from_vllm_flag(8, {"VLLM_GDN_REPLAYSSM_MIN_BATCH": "0"})
    # the defaults patch() and unpatch() write into the environment are no choice
    assert config.from_vllm_flag(8, ReplayConfig().to_env()) == config.from_vllm_flag(8, {})


@pytest.mark.parametrize("value", [0, 65, 100, -1, "x", 2.5, True])
def test_vllms_flag_length_outside_the_ring_range_names_the_flag(value):
    with pytest.raises(OptionError) as e:
        config.from_vllm_flag(value, {})
    assert f"--replayssm-buffer-len={value!r}" in str(e.value) and "1..64" in str(e.value)


def test_every_option_has_a_variable_and_a_doctor_flag():
    envs = [opt.env for _, opt in config.options()]
    assert len(set(envs)) == len(envs) and all(e.startswith("VLLM_GDN_REPLAYSSM") for e in envs)
    out = subprocess.run([sys.executable, "-m", "replayssm_patch", "doctor", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for f, opt in config.options():
        flag = "--" + f.name.replace("_", "-")
        assert (flag in out.stdout) == (opt.user and f.name != "enable"), flag
