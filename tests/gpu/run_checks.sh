#!/usr/bin/env bash
# Every check cuttle can only run on a CUDA GPU, in one call sized for a short lease (docs/gpu.md).
#
#   bash tests/gpu/run_checks.sh [all|correctness|timing|moe|host]   # default all; logs under $OUT (or /tmp/cuttle-gpu)
#
# `moe` is the short form after a change to moe/: its kernel tests, the engine test, the host CPU's
# native kernel tests, the MoE timing. `host` runs the host CPU's native kernel tests alone.
#
# Runs from the repository root with the machine's own python3 (torch + triton; nothing to install):
# the cuttle package is linked from the source folders (setup.py maps each folder to cuttle.<folder>).
# Correctness: the Triton attention / MoE / NSA / top-k kernels compiled for the GPU against their
# references, and the engine on the GPU against the CPU engine (tests/engine/test_cuda_engine.py),
# in parallel (compiles are CPU-bound). Timing, alone afterwards: benchmarks/moe.py's GPU tables.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
what="${1:-all}"
out="${OUT:-/tmp/cuttle-gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
pkg="$(mktemp -d)"
mkdir "$pkg/cuttle"
for folder in engine attention moe rl sandbox; do ln -s "$PWD/$folder" "$pkg/cuttle/$folder"; done
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"
py=python3

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/env.txt"
$py -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
"capability", torch.cuda.get_device_capability())' 2>&1 | tee -a "$out/env.txt"

# The lent machine's own CPU (16 cores; CI machines and the development machine may lack AVX512 or
# AMX): the native CPU kernel tests, whose variants for features the CPU lacks skip elsewhere. In
# `all`, `moe` and `host` modes, beside the GPU correctness checks; done before any timing starts.
host_tests="tests/attention/test_packed_gemm.py tests/attention/test_kernel_set.py tests/attention/test_cpu_fused.py
    tests/attention/test_attention_cpu_native.py tests/attention/test_kernel_build_targets.py
    tests/attention/test_batch_invariance.py tests/attention/test_topk.py tests/attention/test_nsa_kernels.py
    tests/moe/test_moe_mxfp8_cpu.py tests/moe/test_moe_mxfp8_experts_cpu.py tests/moe/test_moe_native.py
    tests/moe/test_moe_packing.py tests/attention/test_hugepages.py"
host_checks() {
    { lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket"; grep -o -w -E "avx512f|avx512_bf16|avx512_vbmi|gfni|amx_tile|amx_bf16" \
        /proc/cpuinfo | sort | uniq -c; } > "$out/host_cpu.txt" 2>&1
    # one torch thread per worker: 8 workers share the 16 cores
    OMP_NUM_THREADS=2 timeout 300 $py -m pytest -q -rs -n 8 $host_tests > "$out/host.log" 2>&1
}
status=0
h=""
if [ "$what" = all ] || [ "$what" = moe ] || [ "$what" = host ]; then
    host_checks & h=$!
fi
if [ "$what" = host ]; then
    :
elif [ "$what" = moe ]; then
    t0=$SECONDS
    timeout 200 $py -m pytest -q -rfEs tests/moe/test_moe_triton.py > "$out/kernels.log" 2>&1 & b=$!
    timeout 200 $py -m pytest -q -rfEs tests/engine/test_cuda_engine.py > "$out/engine.log" 2>&1 & c=$!
    for p in $b $c; do wait $p || status=1; done
    (cd tests/moe && timeout 60 $py triton_worker.py > "$out/moe_rows.jsonl" 2>&1)
    echo "moe correctness: $((SECONDS - t0)) s"
    for f in kernels engine; do echo "== $f"; tail -n 25 "$out/$f.log"; done
elif [ "$what" != timing ]; then
    t0=$SECONDS
    timeout 240 $py -m pytest -q -rfEs tests/attention/test_attention_triton.py -k "not interpreted" \
        > "$out/attention.log" 2>&1 & a=$!
    timeout 240 $py -m pytest -q -rfEs tests/moe/test_moe_triton.py \
        tests/attention/test_nsa_kernels.py tests/attention/test_topk.py -k "not interpreted" > "$out/kernels.log" 2>&1 & b=$!
    timeout 240 $py -m pytest -q -rfEs tests/engine/test_cuda_engine.py > "$out/engine.log" 2>&1 & c=$!
    for p in $a $b $c; do wait $p || status=1; done
    (cd tests/moe && timeout 60 $py triton_worker.py > "$out/moe_rows.jsonl" 2>&1)  # every case's error, pass or fail
    echo "correctness: $((SECONDS - t0)) s"
    for f in attention kernels engine; do echo "== $f"; tail -n 25 "$out/$f.log"; done
fi
if [ -n "$h" ]; then
    wait $h || status=1
    echo "== host CPU"; cat "$out/host_cpu.txt"; tail -n 40 "$out/host.log"
fi
if [ "$what" != correctness ] && [ "$what" != host ]; then
    t0=$SECONDS
    timeout 180 $py benchmarks/moe.py --no-cpu --gpu-batches 1 16 256 4096 --iters 20 2>&1 | tee "$out/moe_bench.md" || status=1
    echo "moe timing: $((SECONDS - t0)) s"
fi
exit $status
