#!/usr/bin/env bash
# Steps of one GPU session on a host without a package index (the device tool's H200):
# the offline vLLM 0.33.0 bundle travels in three calls (.bundle/parts/vllm.tar.xz.00, .01,
# then .bundle/deps + install_bundle.sh, each copied to /tmp/bundle), then it is installed and
# the benchmarks run. Results go to $OUT (or ./gpu-out).
#
#   bash benchmarks/gpu_run.sh stage           # copy whatever of .bundle/ travelled to /tmp/bundle
#   bash benchmarks/gpu_run.sh install         # unpack vLLM into /tmp/vllm-site, install this project
#   bash benchmarks/gpu_run.sh smoke|agree|e2e # run a check or benchmark (needs install first);
#     agree: e2e_agreement.py twice (decisive checkpoint, fp32 SSM state, native control on),
#     bf16 then fp32 activations, to $OUT/e2e_agreement_decisive_{bf16act,fp32act}.json + logs
#   bash benchmarks/gpu_run.sh mtp             # MTP end to end through the ring (needs install):
#     e2e_agreement.py --mtp 3 then --mtp 7 (MTP checkpoint of tests/test_vllm_spec.py, prefix
#     caching off, fp32 SSM state, 16 requests x 128 tokens, native control on; the patched arm
#     sets the experimental VLLM_GDN_REPLAYSSM_MTP_CUDA=1), to $OUT/e2e_agreement_mtp{3,7}.json
#     + logs: agreement, acceptance per arm, GDN cache bytes per arm, ring verify counters, and
#     the checks of test_vllm_spec (a run whose checks fail exits 1, the step fails at the end)
#   bash benchmarks/gpu_run.sh rollout         # examples/grpo_rollout.py twice (needs install): CUDA
#     graphs, poisoned rings, 3 rounds, llm.sleep(level=1) then (second run) level 2, and
#     llm.wake_up() before each weight reload; summaries to $OUT/grpo_sleep1.json, grpo_sleep2.json
#
# Kernel-only steps need no install, just vLLM's .py files for the native kernel (a tarball of
# the vllm/ tree of the 0.33.0 wheel, *.py only, ~7 MB, e.g. .work/vl033.tar.xz):
#   bash benchmarks/gpu_run.sh vltree .work/vl033.tar.xz   # unpack it to /tmp/vl
#   bash benchmarks/gpu_run.sh ktest                        # tests/gpu, errors to $OUT
#   bash benchmarks/gpu_run.sh kbench [kernel_decode.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
B=/tmp/bundle; SITE=/tmp/vllm-site
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 VLLM_CACHE_ROOT=/tmp/vllm-cache
case "${1:?step}" in
  stage)
    mkdir -p $B/parts $B/deps
    cp -n .bundle/parts/* $B/parts/ 2>/dev/null || true
    cp -n .bundle/deps/* $B/deps/ 2>/dev/null || true
    cp -n .bundle/install_bundle.sh $B/ 2>/dev/null || true
    ls -la $B/parts; ls $B/deps | wc -l ;;
  install)
    bash $B/install_bundle.sh $B/parts $B/deps $SITE
    python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    python3 -c "import vllm, replayssm_patch, importlib.metadata as m; print('vllm', vllm.__version__); print([e.name for e in m.entry_points(group='vllm.general_plugins')])" ;;
  smoke)
    python3 benchmarks/e2e_agreement.py --out "$OUT/smoke.json" --requests 4 --tokens 48 --states float32 --no-control --workdir /tmp/smoke 2>&1 | tail -20 ;;
  agree)  # decisive checkpoint, fp32 SSM state, with the native-vs-native control: bf16 then fp32 activations
    rc=0  # a failed run does not stop the next one; the step fails at the end
    for run in "decisive_bf16act bfloat16" "decisive_fp32act float32"; do
      read -r tag dtype <<< "$run"
      python3 benchmarks/e2e_agreement.py --tag "$tag" --out "$OUT/e2e_agreement_$tag.json" --workdir /tmp/agree \
        --checkpoint decisive --states float32 --model-dtype "$dtype" 2>&1 | tail -20 || rc=1
    done
    cp /tmp/agree/*.log "$OUT/" 2>/dev/null || true
    exit $rc ;;
  mtp)  # MTP through the ring on CUDA (experimental opt-in), T=3 then T=7
    rc=0  # a failed run does not stop the next one; the step fails at the end
    for T in 3 7; do
      python3 benchmarks/e2e_agreement.py --mtp "$T" --tag "mtp$T" --out "$OUT/e2e_agreement_mtp$T.json" \
        --workdir /tmp/mtp --states float32 --requests 16 --tokens 128 2>&1 | tail -20 || rc=1
    done
    cp /tmp/mtp/*.log "$OUT/" 2>/dev/null || true
    exit $rc ;;
  e2e)
    shift; python3 benchmarks/e2e_decode.py --out "$OUT/e2e_decode.json" --kernel-json benchmarks/results/kernel_decode.json "$@" 2>&1 | tail -40 ;;
  rollout)
    rc=0  # a failed run does not stop the next one; the step fails at the end
    for level in 1 2; do
      python3 examples/grpo_rollout.py --sleep-level $level --graphs --poison --rounds 3 \
        --out "$OUT/grpo_sleep$level.json" 2>&1 | tail -20 || rc=1
    done
    exit $rc ;;
  vltree)
    mkdir -p /tmp/vl && tar xJf "${2:?tarball}" -C /tmp/vl && ls /tmp/vl ;;
  ktest)
    RING_KERNEL_GPU_REPORT="$OUT/gpu_test_errors.jsonl" python3 -m pytest -q -n 8 ${KTESTS:-tests/gpu/test_ring_kernel_gpu.py} 2>&1 | tail -15 ;;
  kbench)
    shift; python3 benchmarks/kernel_decode.py --vllm-root /tmp/vl --out-dir "$OUT" "$@" 2>&1 | tail -80 ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
