#!/usr/bin/env python3
"""What a GPU machine offers for Hopper kernel work, as JSON: the device, torch / triton versions,
and whether Gluon (with its Hopper TMA and mbarrier modules), CuTe DSL (`cutlass.cute`) and
FlashInfer's GDN kernels import -- and if not, the error. Imports only; nothing is launched.

    python benchmarks/gpu_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys


def try_import(name: str, attrs: tuple[str, ...] = ()) -> dict:
    try:
        mod = importlib.import_module(name)
        missing = [a for a in attrs if not hasattr(mod, a)]
        return {"ok": not missing, "missing": missing} if attrs else {"ok": True}
    except Exception as e:  # ImportError, or a package failing to initialise
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    import triton

    res = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        res["device"] = {"name": p.name, "capability": list(torch.cuda.get_device_capability(0)),
                         "sms": p.multi_processor_count, "memory_GiB": round(p.total_memory / 2**30, 1)}
    res["imports"] = {
        "triton.experimental.gluon": try_import("triton.experimental.gluon", ("jit",)),
        "triton.experimental.gluon.language": try_import("triton.experimental.gluon.language"),
        "gluon hopper tma": try_import("triton.experimental.gluon.language.nvidia.hopper.tma",
                                       ("async_copy_global_to_shared",)),
        "gluon hopper mbarrier": try_import("triton.experimental.gluon.language.nvidia.hopper.mbarrier",
                                            ("init", "expect", "wait")),
        "gluon nvidia TensorDescriptor": try_import("triton.experimental.gluon.nvidia.hopper", ("TensorDescriptor",)),
        "cutlass.cute": try_import("cutlass.cute"),
        "flashinfer": try_import("flashinfer"),
        "flashinfer.gdn_decode": try_import("flashinfer.gdn_decode"),
    }
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
