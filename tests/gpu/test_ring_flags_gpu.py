"""The metadata builder's flag kernel (`_vendored/ring_flags.py`) on a CUDA GPU: the checks of
tests/test_ring_flags_interpret.py (the builder's torch ops as reference, fresh random steps,
contiguous and strided int32 / int64 metadata, padding rows, poisoned flag buffers) with the kernel compiled for the GPU. Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "ring_flags_checks",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test_ring_flags_interpret.py"))
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


@pytest.mark.parametrize("block_size,dtype,strided", [(16, "int32", False), (528, "int64", True),
                                                     (None, "int32", False), (None, "int32", True)])
def test_flags_on_the_gpu(block_size, dtype, strided):
    checks.check_flags(40 + (block_size or 0), block_size, dtype, strided, device="cuda")
