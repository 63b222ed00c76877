"""Compile-only check that the kernel split changed no machine code (the record of how
sass_compare.txt was made; it needs the layout before the split as its baseline).

Every launch the table picks is built for sm_90 twice -- from this package (an override_launch
block) and from a copy of the package before the split (its config tuple) -- with Triton's
driver replaced by benchmarks/aot_resources.py's compile-only one, and the SASS of each kernel
is compared after register numbers and constants are blanked out.

    PYTHONPATH=<triton 3.6.0 unpacked> python benchmarks/results/kernel_split_2026-12-01/sass_compare.py BASELINE_DIR
"""

import difflib
import importlib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]

import aot_resources  # noqa: E402

compiled, _ = aot_resources.install_compile_only_driver(90)

import kernel_decode  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from replayssm_patch._vendored import DecodeLaunch as D  # noqa: E402
from replayssm_patch._vendored import override_launch, ring_decode  # noqa: E402

H, HV, K, V, L, N, SLOTS = 16, 32, 128, 128, 16, 4, 8
# each table launch and the config tuple that meant it before the split
CASES = [
    (D("fused", 8), (8, 1, True, False)), (D("fused", 16), (16, 1, True, False)),
    (D("fused", 32), (32, 1, True, False)), (D("fused", 16, flush_tc=True), (16, 1, True, False, 0, True)),
    (D("two_phase", 8), (8, 1, False, False, 1)),
    (D("two_phase", 16, pdl=True, flush_tc=True), (16, 1, False, False, 2, 0, True)),
    (D("two_phase", 32, pdl=True, flush_tc=True), (32, 1, False, False, 2, 0, True)),
    (D("replay", 8), (8, 1, False, False, 3, 1)), (D("replay", 16), (16, 1, False, False, 3, 1)),
]
RENAMED = {"_ring_decode_kernel": "_fused_decode_kernel"}


def decode_args(sdt, rdt):
    bf16 = torch.bfloat16
    return (torch.randn(N, 2 * H * K + HV * V).to(bf16), torch.randn(N, HV).to(bf16), torch.randn(N, HV).to(bf16),
            torch.zeros(HV), torch.zeros(HV), K ** -0.5, torch.zeros(SLOTS, HV, V, K, dtype=sdt),
            torch.empty(N, 1, HV, V, dtype=bf16), torch.arange(1, N + 1, dtype=torch.int32),
            torch.zeros(SLOTS, HV, L, V, dtype=rdt), torch.zeros(SLOTS, H, L, K, dtype=rdt),
            torch.zeros(SLOTS, HV, L), torch.zeros(SLOTS, dtype=torch.int32))


def sass(kernel) -> list[str]:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    text = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            out.append(re.sub(r"\bU?R\d+\b|\bU?P\d+\b|0x[0-9a-f]+", "X", m.group(1)))
    return out


def built(fn):
    compiled.clear()
    fn()
    return {name: k for name, _, k in compiled}


def main(baseline_dir):
    kernel_decode.load_baseline(baseline_dir)
    old_decode = importlib.import_module("baseline_kernels.ring_decode").ring_decode
    for sdt, rdt in ((torch.float32, torch.float32), (torch.float32, torch.float16),
                     (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)):
        for launch, config in CASES:
            if launch.flush_tc and rdt != torch.float16:  # bf16 tensor-core flushes need a GPU
                continue
            old = built(lambda: old_decode(*decode_args(sdt, rdt), config=config))

            def run_new():
                with override_launch(decode=launch):
                    ring_decode(*decode_args(sdt, rdt))

            new = built(run_new)
            for name, k_old in old.items():
                a, b = sass(k_old), sass(new[RENAMED.get(name, name)])
                sim = difflib.SequenceMatcher(a=a, b=b, autojunk=False).ratio()
                print(f"{str(sdt)[6:]:8s} {str(rdt)[6:]:8s} {launch.name:26s} {name:22s} old {len(a)} new {len(b)} "
                      f"same {a == b} sim {sim:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
