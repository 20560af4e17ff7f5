#!/usr/bin/env bash
# Everything the project checks on a GPU machine, in one go, logs and JSON under OUTDIR:
# the GPU tests, the README's whole test command, the GPU benchmarks, and probe / tune / run on
# the GPUs there are. Each step is timed out and logged on its own, so one failure does not hide
# the rest; the summary at the end lists each step's exit code.
#
#   bash benchmarks/gpu_checks.sh OUTDIR [--quick]
set -u
out=${1:?usage: gpu_checks.sh OUTDIR [--quick]}
quick=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TREE_ATTN_PROFILE_DIR="$out/profiles"
summary="$out/summary.txt"
: > "$summary"

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-16s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$summary"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> "$out/gpu.txt" 2>&1
step gpu-tests 600 python3 -m pytest -q -m gpu -rs
step whole-suite 900 python3 -m pytest -q -rs
if [ "$quick" = "--quick" ]; then
  step bench-kernel 600 python3 benchmarks/bench_kernel.py --quick --out "$out/bench_kernel.json"
  step bench-step 600 python3 benchmarks/bench_step.py --lens 4k,64k,1m --steps 30 --out "$out/bench_step.json"
else
  step bench-kernel 900 python3 benchmarks/bench_kernel.py --out "$out/bench_kernel.json"
  step bench-step 900 python3 benchmarks/bench_step.py --out "$out/bench_step.json"
fi
step bench-host 300 python3 benchmarks/bench_host.py --out "$out/bench_host.json"
step bench-paged 600 python3 benchmarks/bench_paged.py --device cuda --tokens 65536 --dtype bf16 --out "$out/bench_paged.json"
step probe 120 tree-attn probe
step probe-measure 300 tree-attn probe --measure --json
step tune 600 tree-attn tune --quick --json
step run 600 tree-attn run --seq-len 65536 --strategy tree,allreduce,ring --json
step run-eager 600 tree-attn run --seq-len 65536 --strategy tree,allreduce --no-cuda-graph --json
# The cost model's single-GPU terms and this node's links, measured; then the model against runs here.
step calibrate-costmodel 600 python3 benchmarks/calibrate_costmodel.py --out "$out/costmodel_params.json"
step simulate-calibrated 120 tree-attn simulate --params "$out/costmodel_params.json" -w 8,16,128 -n 32K,1M,5.12M --json
cat "$summary"
