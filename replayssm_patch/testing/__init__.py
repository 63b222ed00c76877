"""Helpers for this project's tests and demos (never imported by the patch itself).

* `tiny_models.build_tiny_model`: small random-weight Qwen3.5 / Qwen3-Next checkpoints.
* `cache_dir()`: the folder tests keep built checkpoints and downloaded wheels in.
* `require_vllm()` / `require_module(name)`: import a heavy optional dependency in a test, or
  skip with the reason; under CI (env `CI` set) a missing or broken module fails the test
  instead, so a CI run can never pass by skipping.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where tests keep built checkpoints and downloaded wheels: $REPLAYSSM_TEST_CACHE, else
    .work/test-cache in the repository (ignored by git)."""
    default = Path(__file__).resolve().parents[2] / ".work" / "test-cache"
    return Path(os.environ.get("REPLAYSSM_TEST_CACHE", default))


def in_ci() -> bool:
    """True when the environment variable CI is set to anything but '', '0' or 'false'."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def require_module(name: str):
    """Import and return module `name`, or skip (fail under CI) the calling test."""
    import pytest

    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken install (e.g. a CUDA-only torchvision)
        reason = f"{name} is not importable: {type(e).__name__}: {e}"
        if in_ci():
            pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)", pytrace=False)
        pytest.skip(f"{reason}; `bash .ci/setup.sh` installs it into .venv (use .venv/bin/python)")


def require_vllm():
    """Return the imported `vllm` module, or skip (fail under CI) the calling test."""
    return require_module("vllm")
