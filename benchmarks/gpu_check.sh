#!/usr/bin/env bash
# The accelerator checks of issue 16, on one CUDA GPU, in a few minutes. From the repository root:
#
#     bash benchmarks/gpu_check.sh            # results in $OUT (default /tmp/fpipe-gpu)
#
# 1. tests/test_cuda.py: every schedule of the conformance list on the GPU equals
#    torch.func.grad_and_value of the unsplit model (float64, 1e-10) and GPipe bitwise; a step
#    issues no device-to-host synchronization (torch.cuda.set_sync_debug_mode("error"));
#    fpipe.record() times with CUDA events; torch.profiler sees every action's range.
# 2. tests/test_syncs.py and tests/test_record.py on CPU (the same checks, host side).
# 3. benchmarks/bench_overhead.py --device cuda: fpipe vs plain autograd, 1 stage and 4 x 8, and
#    the per-action cost on tiny stages.
# 4. benchmarks/bench_compile.py --whole-step-only --device cuda: the compiled whole step
#    (pipeline(..., compile=True), issue 38) against the eager step and the unsplit model on the
#    GPU, grads checked against eager; Inductor's default mode (no CUDA graphs). Unrun so far.
# 5. The same with fpipe.Compile(mode="reduce-overhead"): the whole step captured as CUDA graphs
#    (the receive buffers are allocated inside the graph, from its private pool). Unrun so far.
set -uo pipefail
OUT="${OUT:-/tmp/fpipe-gpu}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python}"
status=0

"$PYTHON" - <<'PY' 2>&1 | tee "$OUT/machine.txt"
import platform, torch
assert torch.cuda.is_available(), "no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, Python {platform.python_version()}")
PY

FPIPE_TEST_DEVICE=cuda timeout 300 "$PYTHON" -m pytest tests/test_cuda.py -q -p no:cacheprovider -rs \
    2>&1 | tee "$OUT/test_cuda.txt" || status=1
timeout 120 "$PYTHON" -m pytest tests/test_record.py tests/test_syncs.py -q -p no:cacheprovider -k "not mesh" \
    2>&1 | tee "$OUT/test_cpu_side.txt" || status=1
timeout 240 "$PYTHON" benchmarks/bench_overhead.py --device cuda --json "$OUT/overhead_cuda.json" \
    2>&1 | tee "$OUT/overhead_cuda.txt" || status=1
timeout 600 "$PYTHON" benchmarks/bench_compile.py --whole-step-only --device cuda --json "$OUT/compile_cuda.json" \
    2>&1 | tee "$OUT/compile_cuda.txt" || status=1
timeout 600 "$PYTHON" benchmarks/bench_compile.py --whole-step-only --device cuda --mode reduce-overhead \
    --json "$OUT/compile_cuda_graphs.json" 2>&1 | tee "$OUT/compile_cuda_graphs.txt" || status=1
exit $status
