#!/usr/bin/env python3
"""Compile the kernels of two copies of the kernel package for a CUDA target on a machine
without a GPU and compare their machine code (SASS), kernel by kernel: proof that a change
which should not touch the kernels (a move, a rename, a helper function) did not.

    python benchmarks/sass_compare.py --base REV [--head-dir DIR] [--arch 90] [--cases TEXT] [--json FILE]

--base REV takes the kernel package of a git revision, extracted with `git archive` (the folder
of replayssm_patch/ that holds launch.py and decode.py, whatever it was called then);
--base-dir DIR a copy already on disk. The head is the working tree's replayssm_patch/ops
unless --head-dir names another copy.

What is compiled: each copy's own launchers, called on small CPU tensors with Triton's driver
replaced by one that names the target and compiles instead of launching (as
benchmarks/aot_resources.py does), so every kernel gets the constexprs and argument
specialisations its launcher gives it. The calls (`cases`): Qwen3.5-9B's GDN shape (H=16,
HV=32, K=V=128), bf16 activations, L = 16 and 32, fp32 / bf16 states and rings;

  * decode: every launch of the decode table (`launch.DECODE_TABLE`, the TMA forms included),
    for the state / ring dtypes its row applies to, with the metadata's per-row flags;
  * verify: windows of 4 and 8 tokens (MTP with 3 and 7 drafts), with num_accepted, and once
    without;
  * commit, materialize (with and without start_empty), reset: as `kernels.compile_ahead` and
    the integration call them;
  * ring_flags (align mode and not) and ucache_prepare / ucache_finish (FlashInfer's ring:
    L = 32, 16 live rows, windows 4 and 8).

Each copy compiles in a child process of its own with an empty Triton cache. Kernels are
matched by (case, kernel name) and disassembled with `cuobjdump -sass` (instructions with their
encodings: operands, registers, scheduling bits); the kernel's name is replaced by a
placeholder, and nothing else needs normalising (cuobjdump -sass prints no file paths or line
info; those live in the cubin's debug sections, which are not compared). Registers, shared
memory and stack from `cuobjdump --dump-resource-usage` are compared too.

Needs triton with its NVIDIA backend (ptxas and cuobjdump ship in the wheel); use the GPU's
Triton release for the Gluon (TMA) kernels, which other releases may not compile (those cases
are then reported as failing in both copies). Exit status 1 when any kernel differs or
compiles in one copy only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_DIR = os.path.join(ROOT, "replayssm_patch", "ops")
H, HV, K, V = 16, 32, 128, 128  # Qwen3.5-9B's GDN layer
ROWS, SLOTS = 3, 4  # slots 1..3 (slot 0 is vLLM's null block)
RING_LENS = (16, 32)
WINDOWS = (4, 8)


# --------------------------------------------------------------------------------------------
# Child: compile one copy's kernels
# --------------------------------------------------------------------------------------------

def load_tree(path: str, name: str = "sass_tree"):
    """The kernel package at `path`, imported as `name` (its modules import each other relatively)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return pkg


def compile_only(arch: int, captured: list) -> None:
    """Make Triton compile for sm_`arch` and never launch: `kernel[grid](...)` becomes a warmup
    whose compiled kernel is appended to `captured` with the kernel's name and module."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnly:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(CompileOnly())

    def getitem(self, grid):
        def launch(*args, **kwargs):
            kwargs.pop("launch_pdl", None)  # a launch attribute, not part of the compiled code
            k = self.run(*args, grid=grid, warmup=True, **kwargs)
            captured.append((self.__name__, self.fn.__module__.split(".", 1)[-1], k))
        return launch

    JITFunction.__getitem__ = getitem


def answer_as_hopper(pkg) -> None:
    """The launchers ask the GPU whether the TMA form, PDL and the bf16 tensor-core flush can run
    and how many persistent programs fit an SM; on CPU tensors answer as an sm_90 GPU would
    (the grid size does not change the code). Patched in every module that holds the name."""
    import importlib

    import torch

    cuda = torch.device("cuda")
    folder = pkg.__path__[0]
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".py") or file == "__init__.py":
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{file[:-3]}")
        if file[:-3] in pkg.__all__:  # the import set the package's attribute to the module
            delattr(pkg, file[:-3])  # (ring_flags): leave the name to the package's lazy export
        if hasattr(mod, "tma_capable"):
            mod.tma_capable = lambda device: True
        if hasattr(mod, "use_pdl"):
            mod.use_pdl = lambda launch, state: launch.pdl
        if hasattr(mod, "programs_per_sm"):
            mod.programs_per_sm = lambda kernel, kernel_args, constexprs, device: 1
        if hasattr(mod, "flush_tc_supported"):
            real = mod.flush_tc_supported
            mod.flush_tc_supported = lambda ring_dtype, L, device, real=real: real(ring_dtype, L, cuda)


def cases(ops):
    """(label, call) for every launch this script compiles; `ops` is the loaded package."""
    import torch

    f32, bf16, i32, i8 = torch.float32, torch.bfloat16, torch.int32, torch.int8
    names = {f32: "fp32", bf16: "bf16"}
    kinds = {"fp32": (f32,), "16-bit": (bf16,), "any": (f32, bf16)}
    width = 2 * H * K + HV * V
    idx = torch.arange(1, ROWS + 1, dtype=i32)

    def ring(sdt, rdt, L):
        return (torch.zeros(SLOTS, HV, V, K, dtype=sdt), torch.zeros(SLOTS, HV, L, V, dtype=rdt),
                torch.zeros(SLOTS, H, L, K, dtype=rdt), torch.zeros(SLOTS, HV, L, dtype=f32),
                torch.zeros(SLOTS, dtype=i32))

    def inputs(tokens):
        return (torch.zeros(tokens, width, dtype=bf16), torch.zeros(tokens, HV, dtype=bf16),
                torch.zeros(tokens, HV, dtype=bf16), torch.zeros(HV, dtype=f32), torch.zeros(HV, dtype=f32))

    def decode(launch, sdt, rdt, L):
        def call():
            state, d, k, g, cursor = ring(sdt, rdt, L)
            flags = torch.zeros(ROWS, dtype=i8)
            with ops.override_launch(decode=launch):
                ops.ring_decode(*inputs(ROWS), K ** -0.5, state, torch.empty(ROWS, 1, HV, V, dtype=bf16), idx,
                                d, k, g, cursor, force_flush=flags, start_empty=flags)
        return call

    def verify(sdt, rdt, L, T, accepted):
        def call():
            state, d, k, g, cursor = ring(sdt, rdt, L)
            cu = torch.arange(0, (ROWS + 1) * T, T, dtype=i32)
            acc = torch.ones(ROWS, dtype=i32) if accepted else None
            ops.ring_verify(*inputs(ROWS * T), K ** -0.5, state, torch.empty(ROWS * T, HV, V, dtype=bf16), idx,
                            cu, d, k, g, cursor, acc, T)
        return call

    out = []
    seen = set()
    for row in ops.DECODE_TABLE:
        for sdt in kinds[row.state]:
            for rdt in kinds[row.ring]:
                if row.launch.flush_tc and rdt == f32:
                    continue  # the table picks a tensor-core flush only for a 16-bit ring
                for L in RING_LENS:
                    label = f"decode {row.launch.name} state={names[sdt]} ring={names[rdt]} L={L}"
                    if label not in seen:
                        seen.add(label)
                        out.append((label, decode(row.launch, sdt, rdt, L)))
    for sdt in (f32, bf16):
        for rdt in (f32, bf16):
            for L in RING_LENS:
                for T in WINDOWS:
                    out.append((f"verify state={names[sdt]} ring={names[rdt]} L={L} T={T}",
                                verify(sdt, rdt, L, T, True)))
    out.append(("verify state=fp32 ring=fp32 L=16 T=4 no num_accepted", verify(f32, f32, 16, 4, False)))
    for L in RING_LENS:
        out.append((f"commit L={L}", lambda L=L: ops.ring_commit(torch.zeros(SLOTS, dtype=i32), idx,
                                                                 torch.ones(ROWS, dtype=i32), L)))
        out.append((f"commit L={L} drop", lambda L=L: ops.ring_commit(torch.zeros(SLOTS, dtype=i32), idx, None, L)))
    for sdt in (f32, bf16):
        for rdt in (f32, bf16):
            for L in RING_LENS:
                label = f"materialize state={names[sdt]} ring={names[rdt]} L={L}"
                out.append((label, lambda a=(sdt, rdt, L): ops.ring_materialize(*ring(*a), idx)))
                out.append((label + " start_empty", lambda a=(sdt, rdt, L): ops.ring_materialize(
                    *ring(*a), idx, torch.zeros(ROWS, dtype=i8))))
    out.append(("reset", lambda: ops.ring_reset(torch.zeros(SLOTS, dtype=i32), idx)))
    for block in (None, 64):
        out.append((f"ring_flags block_size={block}", lambda block=block: ops.ring_flags(
            torch.arange(ROWS + 1, dtype=i32), torch.full((ROWS,), 9, dtype=i32), torch.zeros(ROWS, dtype=i8),
            torch.zeros(ROWS, dtype=i8), ROWS, block)))
    for accepted in (True, False):
        out.append((f"ucache_prepare L=32 live=16{'' if accepted else ' drop'}", lambda accepted=accepted:
                    ops.ucache_prepare(torch.zeros(SLOTS, dtype=i32), idx,
                                       torch.ones(ROWS, dtype=i32) if accepted else None, 32, 16)))
    for W in WINDOWS:
        def finish(W=W):
            _, d, k, g, cursor = ring(bf16, bf16, 32)
            ops.ucache_finish(d, k, g, cursor, idx, torch.zeros(ROWS, dtype=i32), W, 16)
        out.append((f"ucache_finish L=32 live=16 W={W}", finish))
    return out


def cuobjdump(tools: str, cubin: bytes, *flags) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([os.path.join(tools, "cuobjdump"), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def normalise(sass: str, kernel: str) -> str:
    """cuobjdump's listing with the kernel's name replaced and blank space collapsed."""
    lines = (" ".join(line.split()).replace(kernel, "<kernel>") for line in sass.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


def collect(tree: str, arch: int, out_dir: str, only: str) -> None:
    """Compile the cases of the package at `tree` whose label holds `only`; write each kernel's
    normalised SASS and an index (case, kernel, module, resources, SASS hash; or the case's
    error) to `out_dir`."""
    import triton

    captured = []
    compile_only(arch, captured)
    ops = load_tree(tree)
    answer_as_hopper(ops)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    index, done = [], set()
    for label, call in cases(ops):
        if only not in label:
            continue
        captured.clear()
        try:
            call()
        except Exception as e:  # e.g. a Gluon kernel this Triton release cannot compile
            root = e
            while root.__cause__ is not None:  # a compile error's own text is the source excerpt
                root = root.__cause__
            index.append({"case": label, "error": f"{type(root).__name__}: {str(root).strip().splitlines()[0]}"})
            continue
        for name, module, k in captured:
            if k.hash in done:  # the same specialisation as an earlier case's: compared there
                continue
            done.add(k.hash)
            sass = normalise(cuobjdump(tools, k.asm["cubin"], "-sass"), name)
            usage = cuobjdump(tools, k.asm["cubin"], "--dump-resource-usage")
            res = {key.lower(): int(m.group(1)) for key in ("REG", "SHARED", "STACK", "LOCAL")
                   if (m := re.search(rf"\b{key}:(\d+)", usage))}
            path = os.path.join(out_dir, f"{len(index):04d}_{name}.sass")
            with open(path, "w") as f:
                f.write(sass)
            index.append({"case": label, "kernel": name, "module": module, "sass": path,
                          "sha256": hashlib.sha256(sass.encode()).hexdigest(),
                          "instructions": len(re.findall(r"^/\*[0-9a-f]{4,}\*/", sass, re.M)), **res})
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump({"triton": triton.__version__, "tree": tree, "kernels": index}, f, indent=1)


# --------------------------------------------------------------------------------------------
# Parent: extract the base, run both children, compare
# --------------------------------------------------------------------------------------------

def extract(rev: str, dest: str) -> tuple[str, str]:
    """The kernel package of git revision `rev`, extracted under `dest`: (its folder, its path)."""
    files = subprocess.run(["git", "-C", ROOT, "ls-tree", "-r", "--name-only", rev, "replayssm_patch"],
                           capture_output=True, text=True, check=True).stdout.split()
    folders = {os.path.dirname(p) for p in files if p.endswith("/launch.py")}
    folders = sorted(d for d in folders if f"{d}/decode.py" in files)
    if len(folders) != 1:
        raise SystemExit(f"{rev}: expected one kernel package under replayssm_patch/ (got {folders})")
    os.makedirs(dest)
    archive = os.path.join(dest, "base.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, rev, folders[0]], check=True)
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")
    return os.path.join(dest, folders[0]), folders[0]


def first_difference(a: str, b: str) -> str:
    la, lb = open(a).read().splitlines(), open(b).read().splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}: base `{x}` / head `{y}`"
    return f"lengths {len(la)} / {len(lb)} lines"


def compare(base: dict, head: dict) -> tuple[list, list, bool]:
    """(rows of the per-specialisation table, notes, all identical)."""
    def keyed(index):
        out = {}
        for e in index["kernels"]:
            out[(e["case"], e.get("kernel"))] = e
        return out

    kb, kh = keyed(base), keyed(head)
    rows, notes, ok = [], [], True
    for key in list(kb) + [k for k in kh if k not in kb]:
        b, h = kb.get(key), kh.get(key)
        case, kernel = key
        if kernel is None:  # the case raised
            if b and h:
                notes.append(f"not compiled in either copy: {case} ({b['error']})")
            else:
                ok = False
                notes.append(f"failed in the {'base' if b else 'head'} copy only: {case} ({(b or h)['error']})")
            continue
        if b is None or h is None:
            ok = False
            notes.append(f"compiled in the {'base' if b else 'head'} copy only: {case} {kernel}")
            continue
        same = (b["sha256"] == h["sha256"]
                and all(b.get(r) == h.get(r) for r in ("reg", "shared", "stack", "local")))
        ok &= same
        if not same:
            notes.append(f"differs: {case} {kernel}: {first_difference(b['sass'], h['sass'])}")
        moved = b["module"] if b["module"] == h["module"] else f"{b['module']} -> {h['module']}"
        rows.append((case, kernel, moved, h["instructions"], h.get("reg"), h.get("shared"), h["sha256"][:12],
                     "identical" if same else "DIFFERENT"))
    return rows, notes, ok


def report(base_label: str, head_label: str, arch: int, base: dict, head: dict) -> tuple[str, bool]:
    rows, notes, ok = compare(base, head)
    lines = [f"triton {head['triton']}, target cuda sm_{arch}; base: {base_label}; head: {head_label}", ""]
    per_kernel: dict = {}
    for case, kernel, moved, *_, verdict in rows:
        n, same, mod = per_kernel.get(kernel, (0, 0, moved))
        per_kernel[kernel] = (n + 1, same + (verdict == "identical"), mod)
    lines += ["| kernel | module (base -> head) | specialisations | identical |", "|---|---|---:|---:|"]
    lines += [f"| `{k}` | {mod} | {n} | {same} |" for k, (n, same, mod) in per_kernel.items()]
    lines += ["", "| case | kernel | instructions | regs | smem | SASS sha256 | |", "|---|---|---:|---:|---:|---|---|"]
    lines += [f"| {case} | `{kernel}` | {n} | {reg} | {smem} | {sha} | {verdict} |"
              for case, kernel, _, n, reg, smem, sha, verdict in rows]
    same = sum(r[-1] == "identical" for r in rows)
    lines += ["", f"{len(rows)} kernel specialisations of {len(per_kernel)} kernels compared: {same} identical, "
              f"{len(rows) - same} different."]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n", ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--base", metavar="REV", help="git revision whose kernel package is the base")
    src.add_argument("--base-dir", metavar="DIR", help="a copy of the kernel package as the base")
    ap.add_argument("--head-dir", metavar="DIR", default=HEAD_DIR, help="the package compared (default: this tree's)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90 = Hopper)")
    ap.add_argument("--cases", default="", metavar="TEXT", help="only the cases whose label holds TEXT")
    ap.add_argument("--json", metavar="FILE", help="also write both copies' per-kernel indexes here")
    ap.add_argument("--collect", nargs=2, metavar=("TREE", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.collect:
        collect(os.path.abspath(args.collect[0]), args.arch, args.collect[1], args.cases)
        return 0
    if not (args.base or args.base_dir):
        ap.error("name the base: --base REV or --base-dir DIR")

    with tempfile.TemporaryDirectory(prefix="sass_compare_") as tmp:
        if args.base:
            sha = subprocess.run(["git", "-C", ROOT, "rev-parse", args.base], capture_output=True, text=True,
                                 check=True).stdout.strip()
            base_dir, path = extract(args.base, os.path.join(tmp, "src"))
            base_label = f"{args.base} ({sha[:10]}) {path}"
        else:
            base_dir, base_label = os.path.abspath(args.base_dir), args.base_dir
        head_dir = os.path.abspath(args.head_dir)
        head_label = os.path.relpath(head_dir, ROOT) if head_dir.startswith(ROOT) else head_dir
        procs = {}
        for name, tree in (("base", base_dir), ("head", head_dir)):
            out = os.path.join(tmp, name)
            os.makedirs(out)
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["TRITON_CACHE_DIR"] = os.path.join(tmp, f"cache_{name}")  # every kernel compiled here
            procs[name] = (subprocess.Popen([sys.executable, os.path.abspath(__file__), "--arch", str(args.arch),
                                             "--cases", args.cases, "--collect", tree, out], env=env), out)
        indexes = {}
        for name, (proc, out) in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"compiling the {name} copy failed (exit status {proc.returncode})")
            with open(os.path.join(out, "index.json")) as f:
                indexes[name] = json.load(f)
        text, ok = report(base_label, head_label, args.arch, indexes["base"], indexes["head"])
        print(text, end="")
        if args.json:
            for index in indexes.values():
                for e in index["kernels"]:
                    e.pop("sass", None)
            with open(args.json, "w") as f:
                json.dump({"labels": {"base": base_label, "head": head_label}, **indexes}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
