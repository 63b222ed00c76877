#!/usr/bin/env bash
# FlashInfer's GDN kernels for the GPU host without a package index (issue 23: measured beside
# ours and vLLM's in benchmarks/kernel_decode.py --flashinfer). Python 3.12, CUDA 13.
#
#   bash benchmarks/make_flashinfer_bundle.sh [OUTDIR]      (default .bundle)
#
# OUTDIR/fi/flashinfer.tar.xz.NN: one tree, split in parts of at most 55 MB (one per transfer),
# holding flashinfer-python's .py files (not its CUDA sources or prebuilt binaries: the GDN
# decode kernels are CuTe DSL, compiled at first call), nvidia-cutlass-dsl with its CUDA 13
# libraries, and what they import that the GPU image lacks. On the GPU host
# `benchmarks/gpu_run.sh fiinstall` unpacks it to /tmp/fi-site; gpu_run.sh then puts
# /tmp/fi-site and cutlass's dsl_packages (which the wheel adds through a .pth file, read only
# from a site directory) on PYTHONPATH.
set -euo pipefail
OUT=$(mkdir -p "${1:-.bundle}" && cd "${1:-.bundle}" && pwd)
FI_VERSION=0.7.4 CUTLASS_DSL_VERSION=4.8.1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
plat="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64; do
  plat="$plat --platform $p"; done
python3 -m pip download -q --isolated --no-deps $plat -d "$tmp/whl" "flashinfer-python==$FI_VERSION" \
  "nvidia-cutlass-dsl==$CUTLASS_DSL_VERSION" "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL_VERSION" \
  "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL_VERSION" "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL_VERSION" \
  "cuda-bindings>=13,<14" cuda-pathfinder "apache-tvm-ffi>=0.1.11,<0.2" einops ninja nvidia-ml-py tabulate
mkdir -p "$tmp/site"
for w in "$tmp"/whl/*.whl; do
  case "$(basename "$w")" in
    flashinfer_python-*) unzip -q "$w" 'flashinfer/*.py' -x 'flashinfer/data/*' -d "$tmp/site" ;;
    *) unzip -q -o "$w" -d "$tmp/site" ;;
  esac
done
mkdir -p "$OUT/fi"; rm -f "$OUT"/fi/flashinfer.tar.xz.*
(cd "$tmp/site" && tar cf - .) | xz -T0 -6 | split -b 55000000 -d - "$OUT/fi/flashinfer.tar.xz."
ls -la "$OUT/fi"
