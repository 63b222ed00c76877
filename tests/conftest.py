"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def clean_patch_state():
    """The patch undone and the process's state forgotten before and after the test; yields the
    state object (replayssm_patch.state.STATE)."""
    from replayssm_patch.state import STATE

    STATE.reset()
    yield STATE
    STATE.reset()
