"""Make a CUDA-built torchvision importable next to a CPU-only torch.

The torchvision wheels on PyPI are CUDA builds. Next to torch+cpu their C extension does not
load, which torchvision tolerates everywhere except in ``torchvision/_meta_registrations.py``:
two fake-kernel registrations there (``torchvision::nms`` and ``torchvision::qnms``) run
unconditionally at import time and raise ``operator torchvision::nms does not exist``.

This script rewrites those two decorators so they only register when the C ops are loaded
(``torchvision.extension._has_ops()``), leaving the pure-Python parts of torchvision usable
(transformers' Qwen image processors import ``torchvision.transforms.v2``). It never imports
torchvision itself before patching, is idempotent, and exits 0 when nothing needs doing.

Usage: python .ci/fix_torchvision.py   (with the target environment's interpreter)
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

OPS = ("nms", "qnms")
MARK = "# replayssm-ci: guarded"


def import_ok() -> tuple[bool, str]:
    proc = subprocess.run(
        [sys.executable, "-c", "import torchvision, torchvision.transforms.v2"],
        capture_output=True,
        text=True,
    )
    lines = proc.stderr.strip().splitlines()
    return proc.returncode == 0, lines[-1] if lines else ""


def patch_file(path: Path) -> int:
    text = path.read_text()
    count = 0
    for op in OPS:
        pattern = re.compile(
            r'^(?P<indent>[ \t]*)@torch\.library\.register_fake\("torchvision::' + op + r'"\)[ \t]*$',
            re.MULTILINE,
        )

        def guarded(m: re.Match) -> str:
            return (
                f'{m["indent"]}@(torch.library.register_fake("torchvision::{op}") '
                f"if torchvision.extension._has_ops() else (lambda fn: fn))  {MARK}"
            )

        text, n = pattern.subn(guarded, text)
        count += n
    if count:
        path.write_text(text)
    return count


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("fix_torchvision: torchvision is not installed; nothing to do")
        return 0
    ok, _ = import_ok()
    if ok:
        print("fix_torchvision: torchvision imports fine; nothing to do")
        return 0
    target = Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"
    if not target.is_file():
        print(f"fix_torchvision: {target} not found; cannot fix", file=sys.stderr)
        return 1
    n = patch_file(target)
    print(f"fix_torchvision: guarded {n} registration(s) in {target}")
    ok, err = import_ok()
    if not ok:
        print(f"fix_torchvision: torchvision still does not import: {err}", file=sys.stderr)
        return 1
    print("fix_torchvision: torchvision imports now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
