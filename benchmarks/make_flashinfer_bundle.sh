#!/usr/bin/env bash
# FlashInfer for the GPU host without a package index (Python 3.12, CUDA 13): its GDN kernels
# (issue 23: measured beside ours and vLLM's in benchmarks/kernel_decode.py --flashinfer), and the
# norms vLLM 0.34's Qwen3.5 model imports on CUDA (Qwen3_5RMSNorm.forward: flashinfer.norm's
# gemma_rmsnorm and gemma_fused_add_rmsnorm; without FlashInfer the engine stops at that import),
# and quack-kernels, which vLLM 0.34 requires (its kernel warmup imports quack on CUDA, through the
# MiniMax-M3 kernels, whatever the model: without it no 0.34 engine starts).
#
#   bash benchmarks/make_flashinfer_bundle.sh [OUTDIR [FI_VERSION]]   (default .bundle, 0.7.4)
#     e.g. bash benchmarks/make_flashinfer_bundle.sh .bundle034 0.7.4   (for vLLM 0.34)
#   CUTLASS_DSL_VERSION=X.Y.Z (default 4.8.1, the one run on the host with 0.7.4)
#   QUACK_VERSION=X.Y.Z (default 0.6.5, vLLM 0.34's pin)
#
# OUTDIR/fi/flashinfer.tar.xz.NN: one tree, split in parts of at most 45 MB (one per transfer, beside the tree),
# holding flashinfer-python's .py files, nvidia-cutlass-dsl with its CUDA 13 libraries, and what
# they import that the GPU image lacks. No CUDA sources (flashinfer/data), prebuilt binaries or
# nvcc: in FlashInfer 0.7.x the GDN decode kernels and these norms are CuTe DSL, compiled at first
# call by cutlass's own compiler. flashinfer.norm builds its CUDA JIT module instead (nvcc, ninja
# and flashinfer/data, none carried) only where cutlass fails to import (it says nothing then) or
# FLASHINFER_USE_CUDA_NORM=1. vLLM 0.34 pins flashinfer-python 0.7.3, which the index does not
# serve (0.7.2.post1 and 0.7.4 are there; both have the same gemma norm API as CuTe DSL kernels).
# The wheels that would spare the compile are no use here: flashinfer-cubin (trtllm-gen cubins,
# no norm; newest on the index 0.6.13, 458 MB) and flashinfer-jit-cache (not on the index).
# On the GPU host `benchmarks/gpu_run.sh fiinstall` unpacks it to /tmp/fi-site; gpu_run.sh then
# puts /tmp/fi-site and cutlass's dsl_packages (which the wheel adds through a .pth file, read
# only from a site directory) on PYTHONPATH.
set -euo pipefail
OUT=$(mkdir -p "${1:-.bundle}" && cd "${1:-.bundle}" && pwd)
FI_VERSION=${2:-0.7.4} CUTLASS_DSL_VERSION=${CUTLASS_DSL_VERSION:-4.8.1} QUACK_VERSION=${QUACK_VERSION:-0.6.5}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
plat="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64; do
  plat="$plat --platform $p"; done
python3 -m pip download -q --isolated --no-deps $plat -d "$tmp/whl" "flashinfer-python==$FI_VERSION" \
  "nvidia-cutlass-dsl==$CUTLASS_DSL_VERSION" "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL_VERSION" \
  "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL_VERSION" "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL_VERSION" \
  "quack-kernels==$QUACK_VERSION" "cuda-bindings>=13,<14" cuda-pathfinder "apache-tvm-ffi>=0.1.11,<0.2" einops ninja nvidia-ml-py tabulate ||
  { echo "pip download failed: is flashinfer-python==$FI_VERSION on the index? (0.7.3 is not)" >&2; exit 1; }
mkdir -p "$tmp/site"
for w in "$tmp"/whl/*.whl; do
  case "$(basename "$w")" in
    flashinfer_python-*) unzip -q "$w" 'flashinfer/*.py' -x 'flashinfer/data/*' -d "$tmp/site" ;;
    *) unzip -q -o "$w" -d "$tmp/site" ;;
  esac
done
mkdir -p "$OUT/fi"; rm -f "$OUT"/fi/flashinfer.tar.xz.*
(cd "$tmp/site" && tar cf - .) | xz -T0 -6 | split -b 45000000 -d - "$OUT/fi/flashinfer.tar.xz."
echo "flashinfer-python $FI_VERSION, nvidia-cutlass-dsl $CUTLASS_DSL_VERSION, quack-kernels $QUACK_VERSION"
ls -la "$OUT/fi"
