"""The metadata builder's flag kernel (`ops/ring_flags.py`) on a CUDA GPU: the checks of
tests/test_ring_flags_interpret.py (the builder's torch ops as reference, fresh random steps,
contiguous and strided int32 / int64 metadata, padding rows, poisoned flag buffers) with the
kernel compiled for the GPU. Skipped without CUDA.
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

checks = load_checks(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test_ring_flags_interpret.py"))


@pytest.mark.parametrize("block_size,dtype,strided", [(16, "int32", False), (528, "int64", True),
                                                     (None, "int32", False), (None, "int32", True)])
def test_flags_on_the_gpu(block_size, dtype, strided):
    checks.check_flags(40 + (block_size or 0), block_size, dtype, strided, device="cuda")
