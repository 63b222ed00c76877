"""The bookkeeping kernels around FlashInfer's verify kernel (`ops/ucache.py`) on a CUDA
GPU: the checks of tests/test_ucache_interpret.py (torch reference, fresh random inputs, paged
ring views, padding rows, rows at and past the fold threshold) with the kernels compiled for the
GPU, so they are tested there even where FlashInfer itself does not import
(tests/gpu/test_flashinfer_verify_gpu.py runs them inside its verify step). Skipped without CUDA.
"""

from __future__ import annotations

import os

import pytest

from replayssm_patch.testing.interpreted import load_checks

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

checks = load_checks(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test_ucache_interpret.py"))


@pytest.mark.parametrize("with_acc", [True, False])
def test_prepare_on_the_gpu(with_acc):
    checks._check_prepare(21 + with_acc, with_acc, device="cuda")


@pytest.mark.parametrize("window", [4, 8])
def test_finish_on_the_gpu(window):
    checks._check_finish(31 + window, window, device="cuda")
