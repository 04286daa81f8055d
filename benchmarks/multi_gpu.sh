#!/usr/bin/env bash
# The multi-GPU run: tensor-parallel artifacts with NCCL, one GPU per rank.
#
#   OUT=results-dir bash benchmarks/multi_gpu.sh tp      # build, fresh load, orders (2 ranks)
#   OUT=results-dir bash benchmarks/multi_gpu.sh dp      # data-parallel training, build + fresh load
#   OUT=results-dir bash benchmarks/multi_gpu.sh bench   # benchmarks/distributed.py, worlds $WORLDS (default 2),
#                                                        # $RUNS runs, within $BENCH_TIMEOUT s (default 540),
#                                                        # extra arguments in $BENCH_ARGS
#   OUT=results-dir bash benchmarks/multi_gpu.sh tp dp   # several steps, one archive ($OUT/results.tgz)
#
# Each step writes its JSON and logs under $OUT. NVLink multicast stays off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TP_DEVICE=cuda PYTHONPATH="$PWD"
OUT=${OUT:?set OUT to a results folder}
PY=${PY:-python3}
[ $# -gt 0 ] || { echo "usage: multi_gpu.sh tp|dp|bench ..."; exit 2; }

{
  echo "steps: $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c 'import torch, torch.distributed as d; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  $PY -c 'import transformers; print("transformers", transformers.__version__)'
} >"$OUT/env.txt" 2>&1

run() {  # job, world, phase, dir, [env...]
  local job=$1 world=$2 phase=$3 dir=$4
  shift 4
  local t0=$SECONDS
  env "$@" $PY -m torch.distributed.run --standalone --nproc-per-node "$world" \
    "tests/fixtures/$job.py" "$phase" "$dir" >"$OUT/$job-$phase-$world.log" 2>&1
  echo "$job $phase world $world: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
  mkdir -p "$OUT/$job" && cp "$dir"/"$phase"-*.json "$OUT/$job"/ 2>/dev/null
}

for step in "$@"; do
if [ "$step" = tp ]; then
  dir=$(mktemp -d)
  cache=$(mktemp -d)
  run dist_job 2 build "$dir"
  run dist_job 2 load "$dir" TORCHINDUCTOR_CACHE_DIR="$cache" CXX=/bin/false
  echo "files in the load job's Inductor cache: $(find "$cache" -type f | wc -l)" >>"$OUT/steps.txt"
  cache2=$(mktemp -d)
  run dist_job 2 orders "$dir" TORCHINDUCTOR_CACHE_DIR="$cache2" CXX=/bin/false
  ls -l "$dir" >"$OUT/files.txt"
elif [ "$step" = dp ]; then
  dir=$(mktemp -d)
  run dp_job 2 build "$dir"
  run dp_job 2 load "$dir" TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" CXX=/bin/false
elif [ "$step" = bench ]; then
  # Stops before the device's per-call limit, so that the archive below is still written
  # (bench.log holds each world's row as it is measured).
  timeout "${BENCH_TIMEOUT:-540}" $PY benchmarks/distributed.py --worlds ${WORLDS:-2} \
    --runs "${RUNS:-2}" ${BENCH_ARGS:-} --out "$OUT/distributed_${TAG:-h100}.json" >"$OUT/bench.log" 2>&1
  echo "bench worlds ${WORLDS:-2} rc $?" >>"$OUT/steps.txt"
fi
done
cat "$OUT/steps.txt"
# The device returns a limited number of files: every rank's JSON goes into one
# summary.json ({"dist_job/load-2-rank0.json": {...}, ...}), the logs into one archive.
$PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
found = {str(p.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.glob("*/*.json"))}
(out / "summary.json").write_text(json.dumps(found, indent=1))
PYEOF
tar -czf "$OUT/logs.tgz" -C "$OUT" --exclude="*.tgz" --exclude=summary.json --exclude="*.json" . 2>/dev/null
find "$OUT" -type f ! -name "*.tgz" ! -name summary.json ! -name steps.txt ! -name "distributed_*.json" ! -name bench.log -delete
find "$OUT" -mindepth 1 -type d -empty -delete
