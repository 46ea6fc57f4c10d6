#!/usr/bin/env bash
# Run on a lent GPU machine (one GPU, 16 cores), from the repository root, in about 5 minutes (the 2026-12-06 run: 95 s):
#   bash benchmarks/gpu_check.sh
# 1. the CUDA tests (NCCL at world size 1 under torch.cuda.set_sync_debug_mode("error"); gloo with 2 ranks on one GPU);
# 2. the step time of every mode on NCCL, with the time the CPU takes to queue an iteration (runs ahead or not);
# 3. on the 16 CPU cores: ShardedDataParallel's parameter sync overlapped with the next forward, on and off, 8 ranks
#    (the 2-core CI machine cannot show that gain: its ranks take turns on the cores).
# Put the figures into benchmarks/README.md ("On a GPU"). tests/gpu runs every case and lists every failure.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$(command -v python3 || command -v python)}  # a lent machine's image has python3 only
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # the checkout, not installed
status=0
echo "== CUDA tests"; timeout 150 "$python" -m pytest -q -p no:cacheprovider tests/gpu || status=1
echo "== NCCL step times"; timeout 60 "$python" benchmarks/gpu_timing.py --params-millions 50 --iterations 20 || status=1
echo "== overlap_param_sync on 16 cores, 8 ranks (gloo, CPU)"
timeout 120 "$python" benchmarks/bench_zero.py --world-sizes 8 --variants sdp sdp-overlap --params-millions 20 --iters 5 --rounds 3 || status=1
exit $status
