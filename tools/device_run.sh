#!/usr/bin/env bash
# Runs on the lent GPU machine (see the device tool): GPU tests, demo and benchmarks in one call.
# Usage: tools/device_run.sh STAGE...   stages: env diag probe tests tests-all tests-ep (tests-ep-buffer, tests-ep-stream,
#        tests-ep-rest) tests-ep-quick (the layout, stream kernel and deep_ep GPU tests: about 5 minutes)
#        stream-sweep (the streamed Buffer with the CUDA and the Triton kernels, eager and graph-replayed; CONFIGS)
#        tests-refit tests-fp8 bench-fp8 (REPEATS_FP8, SCALE_FP8) tests-fanout bench-fanout (REPEATS_FANOUT, CYCLES, INSTALL)
#        bench-first (REPEATS_FIRST: first cycles against NCCL's group creation) first-profile (where cycle 1 and export go)
#        fanout-profile (INSTALL, CYCLE: where each replica's fan-out cycle goes)
#        host-profile demo doctor
#        fresh-steps (tools/deep_ep_fresh_steps.py: a fresh dispatch step by step, BF16, padded, FP8; BUDGET)
#        fresh-trace (the same with each GPU step's start and time on the device, from torch.profiler) host-op-cost
#        widths (the deep_ep widths GPU test REPEATS times: a Buffer closed right after its last call)
#        bench-small bench-colocated contention
#        bench-full bench-lifecycle bench-reconfigure bench-ep bench-ep-pin bench-ep-life compare-ep tests-ll bench-ll
#        ll-host (tools/ll_host_profile.py: host time of eager calls, one rank, beside DeepEP V1; ROUNDS)
#        ll-eager (tools/ll_eager_loop.py: DeepEP's eager timing loop, host clock beside events; ROUNDS) tests-ll-shrink deepep-ll-tests (DeepEP's test_low_latency.py, unchanged, against warmlink)
#        deepep-ll-beside (the same test run by DeepEP V1 and by warmlink in turn; RANKS=1 on one GPU; PREV, ROUNDS)
#        ll-kernels (tools/ll_kernel_time.py: kernel times, one rank to itself, beside DeepEP V1 on the same GPU; ROUNDS;
#        PREV: a carried previous src timed in turn with this one; LL_ARGS: its flags, e.g. --one-launch)
#        nixl (install the carried .whl/nixl wheel first: tools/nixl_wheel.sh makes it) tests-nixl bench-nixl bench-nixl-threads bench-lifecycle-nixl
#        deepep (unpack DeepEP V1 from the carried .baseline/deepep-v1; the DeepEP stages do it too) deepep-tests (DeepEP's test_intranode.py, unchanged,
#        against warmlink: 2e9 bytes, then DeepEP's hint; RANKS) bench-ep-deepep (bench ep --deep-ep beside DeepEP, REPEATS_EP)
#        compare-deepep (bench ep --deep-ep of PREV and this code interleaved, PAIRS; tools/deep_ep_compare.py)
#        compare-shape (compare-deepep beside this code with the streamed default shape SHAPE, e.g. 20x128)
#        compare-ll (bench ep --low-latency of PREV and this code interleaved beside DeepEP, PAIRS; tools/ll_compare.py)
#        (env: LIFECYCLES, CYCLES, ITERATIONS, REPEATS, REPEATS_EP, ITERATIONS_EP, SWEEP, SORT;
#         SRC=other/src runs another checkout's package, e.g. the previous code beside this one;
#         TAG prefixes the bench-ep, bench-full and bench-colocated record names; EP_ARGS adds bench ep flags, e.g. --deep-ep;
#         compare-ep: PAIRS, PREV (the previous code's src, default .prev/src, carried), SHUFFLE=1 (pair i times the
#         dispatch rows in seed i's order, both codes alike; needs a previous code with --shuffle); prints min / q25 /
#         median per code, then each row's median ratio to its own run's NCCL dispatch)
# Logs go to $OUT (or ./out). Every step has its own timeout so that a hang costs minutes, not the lease.
# The device tool returns at most 8 files of $OUT per call: bench-nixl-threads alone writes 8.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF
export PYTHONPATH="${SRC:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
# Byte-compiled once, as an installed package is: first-cycle figures must not count compiling the sources.
timeout 120 python3 -m compileall -q "${SRC:-$PWD/src}" >/dev/null 2>&1
# ep's compiled host steps too (ep.kernels.host: ~20 s the first time on a lease), for the same reason
timeout 180 python3 -c "from warmlink.ep.kernels import host; host.module()" >/dev/null 2>&1
wl() { python3 -m warmlink.cli.main "$@"; }
# DeepEP V1's extension, unpacked from the carried .baseline/deepep-v1 where it is not yet: carrying the folder
# again replaces an unpacked one, and a bench without it runs without DeepEP beside warmlink, saying so only once
deepep_ready() {
  [ -f .baseline/deepep-v1/deep_ep_cpp.so.xz ] || { echo "no .baseline/deepep-v1 carried: DeepEP V1 does not run"; return 1; }
  [ -f .baseline/deepep-v1/deep_ep_cpp.cpython-312-x86_64-linux-gnu.so ] || ( cd .baseline/deepep-v1 && python3 -c \
    "import lzma; open('deep_ep_cpp.cpython-312-x86_64-linux-gnu.so','wb').write(lzma.decompress(open('deep_ep_cpp.so.xz','rb').read()))" )
}
for stage in "$@"; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case "$stage" in
    env)
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
      nvidia-smi topo -m
      python3 -c "import cuda.bindings as c, torch; print('cuda-bindings', c.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
      timeout 120 python3 -m pip list 2>/dev/null | grep -i -E "^(transformers|hypothesis|pytest|rich|matplotlib|numpy) " ;;
    diag)
      timeout 120 python3 -c "
import torch
from warmlink import _cuda
for d in range(torch.cuda.device_count()):
    t = torch.empty(1 << 20, device=d)
    print('device', d, 'torch tensor: attrs.device', _cuda.pointer_device(t.data_ptr()), 'DEVICE_ORDINAL', _cuda._pointer_attribute('CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL', t.data_ptr()))
    p = _cuda.malloc(1 << 21, d)
    print('device', d, 'malloc on', _cuda.pointer_device(p), 'batch', _cuda.batch_supported())
    _cuda.free(p, d)
" 2>&1 | tail -8 ;;
    probe)
      timeout 200 python3 tools/ipc_open_probe.py 2>&1 | tail -20 ;;
    tests)
      timeout 420 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
    tests-all)
      timeout 560 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/all_tests.log" | tail -40 ;;
    demo)
      timeout 240 python3 -m warmlink.cli.main demo 2>&1 | tee "$OUT/demo.log" | tail -25 ;;
    doctor)
      timeout 120 python3 -m warmlink.cli.main doctor 2>&1 | tee "$OUT/doctor.log" ;;
    bench-small)
      timeout 420 python3 -m warmlink.cli.main bench refit --scale 0.1 --cycles 3 --json "$OUT/refit_small.json" 2>&1 | tee "$OUT/refit_small.log" | tail -70 ;;
    bench-full)
      timeout 560 python3 -m warmlink.cli.main bench refit --scale 1 --cycles ${CYCLES:-8} --timeout 150 --json "$OUT/refit_full${TAG:-}.json" --plot "$OUT/refit_full${TAG:-}.png" 2>&1 | tee "$OUT/refit_full${TAG:-}.log" | tail -90 ;;
    tests-refit)
      timeout 400 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests/refit tests/transport tests/pool tests/bench 2>&1 | tee "$OUT/gpu_tests_refit.log" | tail -40 ;;
    tests-fp8)  # the FP8 kernel: Triton's interpreter, the GPU against torch and vLLM's formula, a CUDA publisher, the bench
      timeout 400 python3 -m pytest -q -rA -p no:cacheprovider tests/refit/test_fp8_triton.py 2>&1 | tee "$OUT/gpu_tests_fp8.log" | tail -30 ;;
    tests-fanout)  # fan-out on GPUs: 1 trainer -> 3 engines over CUDA IPC, bit-exact, sources per GPU
      timeout 400 python3 -m pytest -q -rA -p no:cacheprovider tests/refit/test_fanout_gpu.py 2>&1 | tee "$OUT/gpu_tests_fanout.log" | tail -30 ;;
    bench-fanout)  # pull beside fan-out into 1 and 3 engines on GPUs 0 and 1; REPEATS_FANOUT runs for medians
      for i in $(seq 1 ${REPEATS_FANOUT:-3}); do
        timeout 400 python3 -m warmlink.cli.main bench refit --engines 1,3 --devices 0,1 --cycles ${CYCLES:-6} \
          --install ${INSTALL:-copy,swap} --json "$OUT/refit_engines_${TAG:-}$i.json" 2>&1 | tee "$OUT/refit_engines_${TAG:-}$i.log" | tail -20
      done ;;
    bench-first)  # the first cycle (export + receiver, and a joining engine's) against NCCL's group creation + first broadcast
      for i in $(seq 1 ${REPEATS_FIRST:-3}); do
        timeout 200 python3 -m warmlink.cli.main bench refit --scale 1 --cycles 3 --scenarios warm,nccl --timeout 150 \
          --json "$OUT/refit_first_${TAG:-}$i.json" 2>&1 | tee "$OUT/refit_first_${TAG:-}$i.log" | tail -4
      done ;;
    fanout-profile)  # cProfile of each replica's cycle 2 (swap, 3 engines on GPUs 1, 0, 1), both threads
      timeout 300 python3 tools/fanout_cycle_profile.py --install ${INSTALL:-swap} --cycle ${CYCLE:-2} --out "$OUT" 2>&1 | tail -8 ;;
    first-profile)
      timeout 200 python3 tools/refit_first_cycle_profile.py --export --top 30 2>&1 | tee "$OUT/refit_first_profile.log" | head -120 ;;
    bench-fp8)
      for i in $(seq 1 ${REPEATS_FP8:-3}); do
        timeout 300 python3 -m warmlink.cli.main bench fp8 --scale ${SCALE_FP8:-1} --json "$OUT/fp8_$i.json" 2>&1 | tee "$OUT/fp8_$i.log" | tail -12
      done ;;
    bench-colocated)
      # trainer and engine on one GPU (Note [Copy kernel]); REPEATS runs for medians across runs
      for i in $(seq 1 ${REPEATS:-1}); do
        timeout 420 python3 -m warmlink.cli.main bench refit --devices 0,0 --scale 1 --cycles ${CYCLES:-8} --timeout 150 \
          --json "$OUT/colocated_${TAG:-}$i.json" 2>&1 | tee "$OUT/colocated_${TAG:-}$i.log" | tail -${TAIL:-45}
      done ;;
    contention)
      # two processes copying on one GPU at once vs one process (what limits the colocated TP 1 -> 2)
      timeout 300 python3 tools/colocated_contention.py --repeats ${REPEATS:-10} 2>&1 | tee "$OUT/contention.log" | tail -8 ;;
    bench-lifecycle)
      timeout 150 python3 -m warmlink.cli.main bench lifecycle --iterations ${ITERATIONS:-100} --json "$OUT/lifecycle.json" 2>&1 | tee "$OUT/lifecycle.log" | tail -40 ;;
    bench-reconfigure)
      timeout 200 python3 -m warmlink.cli.main bench reconfigure --repeats ${REPEATS:-3} --timeout 120 --json "$OUT/reconfigure.json" 2>&1 | tee "$OUT/reconfigure.log" | tail -45 ;;
    tests-ll)
      timeout 400 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests/ep/test_low_latency_gpu.py tests/ep/test_deep_ep_low_latency.py tests/bench/test_bench_ep_low_latency.py 2>&1 | tee "$OUT/gpu_tests_ll.log" | tail -30 ;;
    bench-ll)  # beside DeepEP V1 where .baseline/deepep-v1 is carried (one GPU per rank)
      deepep_ready
      for i in $(seq 1 ${REPEATS_EP:-3}); do
        PYTHONPATH="${SRC:-$PWD/src}:$PWD/.baseline/deepep-v1" timeout 240 python3 -m warmlink.cli.main bench ep --low-latency \
          --iterations ${ITERATIONS_EP:-50} ${EP_ARGS:-} --json "$OUT/ll_${TAG:-}$i.json" 2>&1 | grep -v IBGDA \
          | tee "$OUT/ll_${TAG:-}$i.log" | head -20
      done ;;
    ll-kernels)  # kernel times of graph replays, one rank to itself, beside DeepEP V1 where .baseline/deepep-v1 is carried;
      # with PREV (a carried src), this code and that one in turn, a round a process, ROUNDS times
      deepep_ready
      if [ -z "${PREV:-}" ]; then
        PYTHONPATH="${SRC:-$PWD/src}:$PWD/.baseline/deepep-v1" timeout 240 python3 tools/ll_kernel_time.py \
          --rounds ${ROUNDS:-3} ${LL_ARGS:-} 2>&1 | grep -v IBGDA | tee "$OUT/ll_kernels.log" | tail -20
      else
        for i in $(seq 1 ${ROUNDS:-3}); do
          for side in this previous; do
            [ "$side" = this ] && path="${SRC:-$PWD/src}" || path="$PWD/$PREV"
            echo "== $side, round $i"
            PYTHONPATH="$path:$PWD/.baseline/deepep-v1" timeout 120 python3 tools/ll_kernel_time.py --rounds 1 ${LL_ARGS:-} 2>&1 \
              | grep -E "warmlink |DeepEP V1 "
          done
        done 2>&1 | tee "$OUT/ll_kernels.log"
      fi ;;
    ll-host)  # host time of eager low-latency calls, one rank, beside DeepEP V1 where .baseline/deepep-v1 is carried
      deepep_ready
      PYTHONPATH="${SRC:-$PWD/src}:$PWD/.baseline/deepep-v1" timeout 200 python3 tools/ll_host_profile.py \
        --rounds ${ROUNDS:-3} 2>&1 | grep -v IBGDA | tee "$OUT/ll_host.log" | head -40 ;;
    ll-eager)  # DeepEP's eager "Dispatch + combine" loop, host clock beside its events, one rank, beside DeepEP V1; ROUNDS
      deepep_ready
      PYTHONPATH="${SRC:-$PWD/src}:$PWD/.baseline/deepep-v1" timeout 200 python3 tools/ll_eager_loop.py \
        --rounds ${ROUNDS:-3} 2>&1 | grep -v IBGDA | tee "$OUT/ll_eager.log" | tail -20 ;;
    tests-ll-shrink)  # the enable_shrink GPU test, REPEATS times
      for i in $(seq 1 ${REPEATS:-5}); do
        timeout 110 python3 -m pytest -q -p no:cacheprovider tests/ep/test_low_latency_gpu.py -k shrink 2>&1 \
          | tee "$OUT/shrink_$i.log" | tail -1
      done ;;
    deepep-ll-tests)  # DeepEP's test_low_latency.py, unchanged, against warmlink (one GPU per rank; RANKS); with RANKS >= 6
      # also its --shrink-test, which fails ranks 1, 3 and 5 and cannot pass with fewer (DeepEP's own neither)
      deepep_ready
      shrink=""; [ "${RANKS:-2}" -ge 6 ] && shrink=--shrink-test
      for extra in "" $shrink; do
        ( cd .baseline/deepep-v1/tests && PYTHONPATH="$OLDPWD/tools/as_deep_ep:$OLDPWD/src" \
          timeout ${DEEPEP_TIMEOUT:-300} python3 test_low_latency.py --num-processes ${RANKS:-2} $extra ) 2>&1 \
          | tee "$OUT/deepep_low_latency${extra:+_shrink}.log" | grep -v IBGDA | tail -${TAIL:-25}; echo "rc ${PIPESTATUS[0]}"
      done ;;
    deepep-ll-beside)  # DeepEP's test_low_latency.py, unchanged, run by DeepEP V1 itself, then against warmlink (and
      # against PREV's code where PREV names a carried src), RANKS (default 1: one GPU suffices), ROUNDS times
      deepep_ready
      for i in $(seq 1 ${ROUNDS:-1}); do
        for side in "DeepEP V1" warmlink ${PREV:+previous}; do
          case "$side" in
            "DeepEP V1") path="$PWD/.baseline/deepep-v1" ;;
            warmlink) path="$PWD/tools/as_deep_ep:${SRC:-$PWD/src}" ;;
            previous) path="$PWD/tools/as_deep_ep:$PWD/$PREV" ;;
          esac
          echo "== $side"
          ( cd .baseline/deepep-v1/tests && PYTHONPATH="$path" timeout ${DEEPEP_TIMEOUT:-300} python3 test_low_latency.py \
            --num-processes ${RANKS:-1} ) 2>&1 | grep -v IBGDA | tail -3
        done
      done 2>&1 | tee "$OUT/deepep_ll_beside.log" ;;
    tests-ep)  # over 560 s where ranks share one GPU: there, run tests-ep-buffer, tests-ep-stream and tests-ep-rest apart
      timeout 560 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests/ep 2>&1 | tee "$OUT/gpu_tests_ep.log" | tail -40 ;;
    tests-ep-buffer)
      timeout 560 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests/ep/test_ep_gpu.py 2>&1 | tee "$OUT/gpu_tests_ep_buffer.log" | tail -40 ;;
    tests-ep-stream)  # the streamed kernels and Buffer: about 4 minutes where two ranks share one GPU
      timeout 560 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests/ep/test_stream_gpu.py tests/ep/test_streamed_gpu.py 2>&1 | tee "$OUT/gpu_tests_ep_stream.log" | tail -40 ;;
    tests-ep-quick)  # what a kernel or host-path change of ep touches first: the layout, the streamed kernels, deep_ep
      timeout 560 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests/ep/test_kernels.py \
        tests/ep/test_stream_gpu.py tests/ep/test_deep_ep.py tests/ep/test_deep_ep_widths.py 2>&1 \
        | tee "$OUT/gpu_tests_ep_quick.log" | tail -40 ;;
    tests-ep-rest)
      timeout 560 python3 -m pytest -m "gpu or multigpu" -q -rA -p no:cacheprovider tests/ep --ignore=tests/ep/test_ep_gpu.py --ignore=tests/ep/test_stream_gpu.py --ignore=tests/ep/test_streamed_gpu.py 2>&1 | tee "$OUT/gpu_tests_ep_rest.log" | tail -40 ;;
    stream-sweep)
      for kernel in cuda triton; do
        echo "-- $kernel kernels"
        WARMLINK_EP_STREAM_KERNEL=$kernel timeout 200 python3 tools/stream_sweep.py --configs ${CONFIGS:-20x128} \
          --iterations 15 --graph 2>&1 | tee "$OUT/stream_sweep_$kernel.log" | tail -4
      done ;;
    fresh-steps)
      for extra in "" --padded --fp8; do
        timeout 150 python3 tools/deep_ep_fresh_steps.py --calls 40 --budget ${BUDGET:-hint} $extra 2>&1 | grep -v Warning \
          | tee "$OUT/fresh_steps${extra}.log" | grep "==="
      done ;;
    fresh-trace)  # the fresh dispatch's GPU steps on the device (torch.profiler), BF16, FP8 and padded; traces tarred
      mkdir -p "$OUT/traces"
      for extra in "" --fp8 --padded; do
        timeout 200 python3 tools/deep_ep_fresh_steps.py --calls 20 --budget ${BUDGET:-hint} $extra \
          --trace "$OUT/traces/fresh${extra}" 2>&1 | grep -v Warning | tee "$OUT/fresh_trace${extra}.log" \
          | grep -A30 "device timeline"
      done
      tar czf "$OUT/fresh_traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces" ;;
    host-op-cost)
      timeout 150 python3 tools/host_op_cost.py 2>&1 | grep -v Warning | tee "$OUT/host_op_cost.log" ;;
    widths)
      for i in $(seq 1 ${REPEATS:-5}); do
        timeout 100 python3 -m pytest -q -p no:cacheprovider \
          "tests/ep/test_deep_ep_widths.py::test_calls_of_several_widths_share_one_buffer_and_equal_buffers_built_for_each[gpu]" \
          2>&1 | tee "$OUT/widths_$i.log" | tail -1
      done ;;
    host-profile)
      CUDA_VISIBLE_DEVICES=0 timeout 200 python3 tools/ep_host_profile.py --calls 200 --sort ${SORT:-tottime} 2>&1 | tee "$OUT/ep_host_profile.log" | tail -5 ;;
    bench-ep)
      for i in $(seq 1 ${REPEATS_EP:-3}); do
        timeout 240 python3 -m warmlink.cli.main bench ep --iterations ${ITERATIONS_EP:-30} ${EP_ARGS:-} --json "$OUT/ep_${TAG:-}$i.json" 2>&1 | tee "$OUT/ep_${TAG:-}$i.log" | tail -22
      done ;;
    bench-ep-pin)
      # unpinned and pinned rank processes in turn, so that both see the same machine
      for i in $(seq 1 ${REPEATS_EP:-2}); do
        for pin in "" "--pin"; do
          tag="ep_$i${pin:+_pin}"
          timeout 200 python3 -m warmlink.cli.main bench ep --iterations ${ITERATIONS_EP:-30} $pin --json "$OUT/$tag.json" 2>&1 | tee "$OUT/$tag.log" | sed -n 6,17p
        done
      done ;;
    compare-ep)
      # PAIRS runs of the previous code (PREV, default .prev/src: carry it) and this one, interleaved,
      # rotating which goes first; then min / q25 / median per code (tools/ep_compare.py --quantiles)
      mkdir -p "$OUT/compare"
      for i in $(seq 1 ${PAIRS:-10}); do
        order="previous this"; [ $((i % 2)) = 0 ] && order="this previous"
        for code in $order; do
          src="$PWD/src"; [ $code = previous ] && src="${PREV:-$PWD/.prev/src}"
          PYTHONPATH="$src" timeout 60 python3 -m warmlink.cli.main bench ep --iterations ${ITERATIONS_EP:-30} --pin \
            ${SHUFFLE:+--shuffle $i} ${EP_ARGS:-} \
            --json "$OUT/compare/ep_${code}_$i.json" > "$OUT/compare/ep_${code}_$i.log" 2>&1
        done
      done
      python3 tools/ep_compare.py --quantiles --code previous="$OUT/compare/ep_previous_*.json" --code this="$OUT/compare/ep_this_*.json" \
        | tee "$OUT/compare.txt"
      # and each row over its own run's NCCL dispatch: the machines swing between runs
      python3 tools/ep_compare.py --baseline "torch+NCCL dispatch (bf16)" --code previous="$OUT/compare/ep_previous_*.json" \
        --code this="$OUT/compare/ep_this_*.json" | tee -a "$OUT/compare.txt"
      tar czf "$OUT/compare.tgz" -C "$OUT" compare && rm -rf "$OUT/compare" ;;
    bench-ep-life)
      for i in $(seq 1 ${REPEATS_EP:-2}); do
        timeout 280 python3 -m warmlink.cli.main bench ep --lifecycles ${LIFECYCLES:-30} --json "$OUT/ep_life_$i.json" 2>&1 | tee "$OUT/ep_life_$i.log" | tail -12
      done ;;
    nixl)
      timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/nixl*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site" && python3 -c "import nixl_cu13; print('nixl-cu13 loads')" ;;
    tests-nixl)
      timeout 300 python3 -m pytest -q -rA -p no:cacheprovider -s tests/transport/test_nixl_gpu.py tests/refit/test_refit_nixl.py \
        tests/transport/test_nixl_probe.py 2>&1 | grep -v "UCX  WARN" | tee "$OUT/nixl_tests.log" | tail -30 ;;
    bench-nixl)
      timeout 400 python3 -m warmlink.cli.main bench refit --scale 1 --cycles ${CYCLES:-6} --backend nixl --scenarios ${SCENARIOS:-peak,warm} \
        --timeout 150 --json "$OUT/refit_nixl.json" 2>&1 | grep -v "UCX  WARN" | tee "$OUT/refit_nixl.log" | tail -60 ;;
    bench-nixl-threads)
      # NIXL READ/WRITE per UCX thread count (Note [UCX threads]), then REPEATS refit runs at the default.
      timeout 300 python3 -m warmlink.cli.main bench refit --scale 1 --cycles 6 --scenarios peak,warm,nixl_rw \
        --nixl-sweep ${SWEEP:-0,1,2,4,8} --timeout 150 --json "$OUT/nixl_sweep.json" 2>&1 | grep -v "UCX  WARN" | tee "$OUT/nixl_sweep.log" | tail -14
      for i in $(seq 1 ${REPEATS:-3}); do
        timeout 300 python3 -m warmlink.cli.main bench refit --scale 1 --cycles ${CYCLES:-6} --scenarios peak,warm,nixl,nixl_rw \
          --timeout 150 --json "$OUT/refit_nixl_$i.json" 2>&1 | grep -v "UCX  WARN" | tee "$OUT/refit_nixl_$i.log" | tail -12
      done ;;
    bench-lifecycle-nixl)
      for i in $(seq 1 ${REPEATS:-2}); do
        timeout 200 python3 -m warmlink.cli.main bench lifecycle --backend nixl --iterations ${ITERATIONS:-20} \
          --json "$OUT/lifecycle_nixl_$i.json" 2>&1 | grep -v "UCX  WARN" | tee "$OUT/lifecycle_nixl_$i.log" | tail -30
      done ;;
    deepep)
      deepep_ready && PYTHONPATH="$PWD/.baseline/deepep-v1" python3 -c "import deep_ep, deep_ep_cpp; print('DeepEP V1 loads:', deep_ep.__file__)" ;;
    deepep-tests)
      deepep_ready
      for budget in 2e9 hint; do
        ( cd .baseline/deepep-v1/tests && WARMLINK_DEEP_EP_BUDGET=$budget PYTHONPATH="$OLDPWD/tools/as_deep_ep:$OLDPWD/src" \
          timeout ${DEEPEP_TIMEOUT:-240} python3 test_intranode.py --num-processes ${RANKS:-2} ) 2>&1 | tee "$OUT/deepep_intranode_$budget.log" | tail -25
      done ;;
    compare-deepep)
      # PAIRS runs of bench ep --deep-ep for the previous code (PREV, default .prev/src: carry it) and
      # this one, interleaved, rotating which goes first; then tools/deep_ep_compare.py's table and record
      deepep_ready
      mkdir -p "$OUT/compare_deepep"
      for i in $(seq 1 ${PAIRS:-4}); do
        order="previous this"; [ $((i % 2)) = 0 ] && order="this previous"
        for code in $order; do
          src="$PWD/src"; [ $code = previous ] && src="${PREV:-$PWD/.prev/src}"
          PYTHONPATH="$src:$PWD/.baseline/deepep-v1" timeout 100 python3 -m warmlink.cli.main bench ep --deep-ep \
            --iterations ${ITERATIONS_EP:-20} --gemm 0 ${EP_ARGS:-} --json "$OUT/compare_deepep/${code}_$i.json" \
            > "$OUT/compare_deepep/${code}_$i.log" 2>&1
        done
      done
      python3 tools/deep_ep_compare.py --code previous="$OUT/compare_deepep/previous_*.json" \
        --code this="$OUT/compare_deepep/this_*.json" --json "$OUT/compare_deepep.json" | tee "$OUT/compare_deepep.txt"
      tar czf "$OUT/compare_deepep.tgz" -C "$OUT" compare_deepep && rm -rf "$OUT/compare_deepep" ;;
    compare-ll)
      # PAIRS runs of bench ep --low-latency for the previous code (PREV, default .prev/src: carry it) and
      # this one, interleaved, rotating which goes first, DeepEP V1 beside each; then tools/ll_compare.py's
      # table; the records tarred (the device tool returns 8 files)
      deepep_ready
      rm -rf "$OUT/compare_ll" && mkdir -p "$OUT/compare_ll"
      for i in $(seq 1 ${PAIRS:-3}); do
        order="previous this"; [ $((i % 2)) = 0 ] && order="this previous"
        for code in $order; do
          src="$PWD/src"; [ $code = previous ] && src="${PREV:-$PWD/.prev/src}"
          PYTHONPATH="$src:$PWD/.baseline/deepep-v1" timeout 120 python3 -m warmlink.cli.main bench ep --low-latency \
            --iterations ${ITERATIONS_EP:-100} ${EP_ARGS:-} --json "$OUT/compare_ll/${code}_$i.json" \
            > "$OUT/compare_ll/${code}_$i.log" 2>&1 || echo "compare-ll: $code run $i failed (its log is in the tar)"
        done
      done
      python3 tools/ll_compare.py --code previous="$OUT/compare_ll/previous_*.json" \
        --code this="$OUT/compare_ll/this_*.json" --json "$OUT/compare_ll/medians.json" | tee "$OUT/compare_ll.txt"
      tar czf "$OUT/compare_ll.tgz" -C "$OUT" compare_ll && rm -rf "$OUT/compare_ll" ;;
    compare-shape)
      # compare-deepep of this code beside itself with every streamed Buffer's default shape SHAPE
      # (CHANNELSxRING_ROWS, e.g. 20x128: ep.api.options.stream_defaults patched in a copy of src)
      rm -rf /tmp/shape && mkdir -p /tmp/shape && cp -r src /tmp/shape/
      python3 - "${SHAPE:-20x128}" <<'PY' || { echo "compare-shape: stream_defaults not as expected"; continue; }
import pathlib, sys
channels, rows = (int(v) for v in sys.argv[1].split("x"))
p = pathlib.Path("/tmp/shape/src/warmlink/ep/api/options.py")
s = p.read_text()
old = "    return (20, 128) if num_ranks <= 2 else (10, 256)"
assert old in s
p.write_text(s.replace(old, f"    return ({channels}, {rows})"))
PY
      PREV=/tmp/shape/src "$0" compare-deepep ;;
    bench-ep-deepep)
      deepep_ready
      for i in $(seq 1 ${REPEATS_EP:-3}); do
        PYTHONPATH="$PWD/src:$PWD/.baseline/deepep-v1" timeout 280 python3 -m warmlink.cli.main bench ep --deep-ep \
          --iterations ${ITERATIONS_EP:-20} --gemm 0 ${EP_ARGS:-} --json "$OUT/ep_deepep_${TAG:-}$i.json" 2>&1 \
          | tee "$OUT/ep_deepep_${TAG:-}$i.log" | tail -16
      done ;;
    *) echo "unknown stage $stage" ;;
  esac
done
