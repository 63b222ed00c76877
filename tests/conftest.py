"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def clean_patch_state():
    """The patch reverted before and after the test, with no engine start on record."""
    from replayssm_patch import options, patching

    patching.revert()
    patching._engine_started.clear()
    yield patching
    patching.revert()
    patching._engine_started.clear()
    patching.apply(options.Options(enabled=False))
