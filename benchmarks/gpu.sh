#!/usr/bin/env bash
# GPU benchmark, one command on a single-GPU host, from any directory:
#
#     bash benchmarks/gpu.sh               # writes gpu_benchmark.md to $OUT if set, else the current directory
#     bash benchmarks/gpu.sh --cpu-smoke   # the same script on a CPU (CI): debug model, 4 steps, 2 runs
#
# 1. Checks the environment: nvidia-smi, torch.cuda, bf16, a C compiler for torch.compile, versions.
# 2. Trains recipes/llama.py --model_config llama-3.2-1b (bf16, --block_size 2048, one process) for
#    50 steps under accelerate_configs/ddp.yaml and fsdp.yaml (FSDP2), each eager and with
#    torch.compile (`accelerate launch --dynamo_backend inductor --dynamo_use_regional_compilation`:
#    block by block, as torchtitan does; one block's compile serves all 16). The per-device
#    batch is the largest that tools/planner.py fits in 85% of the GPU's memory (at most 64); a run
#    that still runs out of memory is retried at 3/4 of its batch, twice at most.
# 3. Writes one markdown table: tokens/s and MFU over steps 11-50 (the first 10 hold the warm-up and
#    the compile, reported apart), peak memory (torch.cuda.max_memory_allocated and
#    max_memory_reserved), the last loss. MFU is common/metrics.py's, as the recipe logs it.
# 4. Runs tools/smoke.py on all the host's GPUs (docs/smoke.md): parity, resume and export of every
#    config in bf16, versions, all-reduce bus bandwidth; $OUT/smoke (not with --cpu-smoke).
#
# Expected wall time on one H100/H200: about 7 minutes (an estimate: not yet run on a GPU). Each run
# builds the 1B model and writes its 4 GB export (deleted after); the compiled runs add the compile
# of one block's training step and of the final evaluation (per block: the whole 16-block model
# would take minutes more). Each run's log and metrics stay in $WORK_DIR
# (default: a temporary directory, printed). --cpu-smoke compiles with the aot_eager backend (dynamo
# and AOT autograd, no C++ build), batch 2 x 64 tokens, and runs only DDP eager and FSDP2 compiled,
# so that CI tests this script in two short launches.
set -euo pipefail

here=$PWD
cd "$(dirname "$0")/.."
root=$PWD
smoke=0
case "${1:-}" in
  --cpu-smoke) smoke=1 ;;
  -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$root/benchmarks/gpu.sh"; exit 0 ;;
  "") ;;
  *) echo "error: unknown argument '$1' (benchmarks/gpu.sh takes none, --cpu-smoke or --help)" >&2; exit 2 ;;
esac
out_dir=${OUT:-$here}
work=${WORK_DIR:-$(mktemp -d -t gpu_bench.XXXXXX)}
mkdir -p "$out_dir" "$work"
table="$out_dir/gpu_benchmark.md"
py=${PYTHON:-python}
t_start=$(date +%s)

# ------------------------------------------------------------------------------------------------
# 1. Environment
# ------------------------------------------------------------------------------------------------
if [ "$smoke" = 0 ]; then
  command -v nvidia-smi >/dev/null || { echo "error: nvidia-smi not found: no NVIDIA driver on this host (on a CPU, use --cpu-smoke)" >&2; exit 1; }
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
    || { echo "error: nvidia-smi cannot talk to the driver" >&2; exit 1; }
  command -v cc >/dev/null || command -v gcc >/dev/null \
    || echo "warning: no C compiler (cc/gcc): torch.compile's Triton launchers need one; the compiled runs will fail"
  # the host's GPUs as given, for the smoke run at the end
  [ -n "${CUDA_VISIBLE_DEVICES+x}" ] && all_gpus=(env "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES") \
    || all_gpus=(env -u CUDA_VISIBLE_DEVICES)
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one GPU, whatever the host has
fi
"$py" - "$smoke" <<'EOF' || exit 1
import sys
import accelerate, torch, transformers
smoke = sys.argv[1] == "1"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), accelerate {accelerate.__version__}, "
      f"transformers {transformers.__version__}, python {sys.version.split()[0]}")
if not smoke:
    if not torch.cuda.is_available():
        sys.exit(f"error: torch {torch.__version__} sees no GPU (torch.version.cuda={torch.version.cuda}; a CPU-only "
                 "wheel, or CUDA_VISIBLE_DEVICES hides it): install the CUDA build of torch")
    props = torch.cuda.get_device_properties(0)
    if not torch.cuda.is_bf16_supported():
        sys.exit(f"error: {props.name} (compute capability {props.major}.{props.minor}) has no bf16; this benchmark "
                 "trains in bf16 (Ampere or newer)")
    torch.ones(1, device="cuda").add_(1)  # a kernel really runs
    print(f"GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}")
EOF

# ------------------------------------------------------------------------------------------------
# 2. Runs
# ------------------------------------------------------------------------------------------------
if [ "$smoke" = 1 ]; then
  model=debug; block=64; steps=4; log_every=2; backend=aot_eager; precision=bf16
else
  model=llama-3.2-1b; block=2048; steps=50; log_every=10; backend=inductor; precision=bf16
fi

pick_batch() {  # $1: config name -> the largest per-device batch that tools/planner.py fits
  if [ "$smoke" = 1 ]; then echo 2; return; fi
  "$py" - "$1" "$model" "$block" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, ".")
from common.checks import detect_memory
from tools import planner
config, model, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
shape = planner.model_shape(planner.load_model_config(model, 4096))  # the recipe's default tokenizer: 4,096 entries
strategy = planner.read_strategy(Path(f"accelerate_configs/{config}.yaml"))
memory, _ = detect_memory(1)
fits = [b for b in range(1, 65)
        if planner.plan_strategy(strategy, shape, 1, b, block, 1, False, "bf16")["total"] <= 0.85 * memory]
print(max(fits) if fits else 1)
EOF
}

failed=0
runs=()
for config in ddp fsdp; do
  batch=$(pick_batch "$config")
  compiles=(no "$backend")
  # --cpu-smoke: DDP eager and FSDP2 compiled, every code path of the script in two launches
  if [ "$smoke" = 1 ]; then compiles=("$([ "$config" = ddp ] && echo no || echo "$backend")"); fi
  for compile in "${compiles[@]}"; do
    name="${config}_${compile}"
    for attempt in 1 2 3; do
      dir="$work/$name"
      rm -rf "$dir"
      args=(--config_file "accelerate_configs/$config.yaml" --num_processes 1 --mixed_precision "$precision")
      [ "$compile" != no ] && args+=(--dynamo_backend "$compile" --dynamo_use_regional_compilation)
      echo "== $name: batch $batch x $block, $steps steps (attempt $attempt)"
      t0=$(date +%s)
      set +e
      "$py" -m accelerate.commands.launch "${args[@]}" recipes/llama.py --model_config "$model" \
        --block_size "$block" --per_device_train_batch_size "$batch" --max_steps "$steps" \
        --warmup_steps $((steps / 5)) --logging_steps "$log_every" --eval_steps 1000000 --max_eval_samples 8 \
        --save_steps 0 --sample_tokens 0 --report_to none --output_dir "$dir" --overwrite_output_dir \
        >"$work/$name.log" 2>&1
      rc=$?
      set -e
      echo "   exit $rc after $(( $(date +%s) - t0 )) s (log: $work/$name.log)"
      rm -rf "$dir/final"  # the export (4 GB for the 1B model): not needed for the table
      if [ $rc = 0 ]; then break; fi
      if grep -qE "OutOfMemoryError|CUDA out of memory" "$work/$name.log" && [ "$batch" -gt 1 ]; then
        batch=$(( batch * 3 / 4 > 0 ? batch * 3 / 4 : 1 ))
        echo "   out of memory: retrying at batch $batch"
        continue
      fi
      tail -n 20 "$work/$name.log" >&2
      failed=1
      break
    done
    runs+=("$name:$config:$compile:$batch:$rc")
  done
done

# ------------------------------------------------------------------------------------------------
# 3. Table
# ------------------------------------------------------------------------------------------------
"$py" - "$work" "$table" "$model" "$block" "$steps" "$log_every" "$smoke" "${runs[@]}" <<'EOF'
import datetime
import json
import os
import sys

import torch

work, table, model, block, steps, log_every, smoke = sys.argv[1:8]
block, steps, log_every = int(block), int(steps), int(log_every)


def gib(n):
    return f"{n / 2**30:.2f} GiB" if n is not None else "-"


rows = []
for spec in sys.argv[8:]:
    name, config, compile_, batch, rc = spec.split(":")
    strategy = {"ddp": "DDP", "fsdp": "FSDP2"}[config]
    label = "eager" if compile_ == "no" else f"{compile_}, per block"
    path = os.path.join(work, name, "metrics.jsonl")
    if rc != "0" or not os.path.exists(path):
        rows.append(f"| {strategy} | {label} | {batch} x {block} | failed (exit {rc}, {work}/{name}.log) "
                    "| | | | | |")
        continue
    records = [json.loads(line) for line in open(path)]
    windows = [r for r in records if not r.get("summary")]
    summary = next(r for r in records if r.get("summary"))
    tokens_per_window = int(batch) * block * log_every  # per device (one process)
    steady = windows[1:] or windows
    seconds = [tokens_per_window / r["tokens_per_second"] for r in steady]
    tps = tokens_per_window * len(steady) / sum(seconds)  # tokens over time, steps log_every+1 .. steps
    step_s = int(batch) * block / tps
    first_overhead = tokens_per_window / windows[0]["tokens_per_second"] - log_every * step_s
    mfu = windows[-1].get("mfu")  # flops_per_token x tokens/s / peak: the same ratio at the steady rate
    mfu = f"{mfu / windows[-1]['tokens_per_second'] * tps:.1%}" if mfu is not None else "- (no peak known)"
    rows.append(f"| {strategy} | {label} | {batch} x {block} | {tps:,.0f} | {mfu} | "
                f"{gib(summary.get('peak_memory_bytes'))} | {gib(summary.get('peak_memory_reserved_bytes'))} | "
                f"{first_overhead:.1f} | {windows[-1]['loss']:.3f} |")

device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke)"
head = (f"# recipes/llama.py on {device}, {datetime.date.today().isoformat()}\n\n"
        f"`bash benchmarks/gpu.sh{' --cpu-smoke' if smoke == '1' else ''}`: --model_config {model}, bf16, "
        f"--block_size {block}, one process, {steps} steps; tokens/s and MFU over steps {log_every + 1}-{steps} "
        f"(per device); 'first {log_every} steps, extra s': their time beyond {log_every} steady steps (warm-up, "
        "and the compile). Peak memory: torch.cuda.max_memory_allocated / max_memory_reserved (on a CPU: the "
        "peak RSS, no reserved). torch " + torch.__version__ + ".\n\n")
cols = ("| strategy | torch.compile | batch x seq | tokens/s | MFU | peak allocated | peak reserved "
        f"| first {log_every} steps, extra s | last loss |\n|---|---|---|---|---|---|---|---|---|\n")
text = head + cols + "\n".join(rows) + "\n"
open(table, "w").write(text)
print(text)
EOF
echo "wrote $table ($(( $(date +%s) - t_start )) s in all)"
# 4. The first GPU host of a cluster: every config on all its GPUs in bf16, the versions and the
#    all-reduce bus bandwidth (tools/smoke.py; its table and smoke.json in $OUT/smoke)
if [ "$smoke" = 0 ]; then
  "${all_gpus[@]}" "$py" tools/smoke.py --output_dir "$out_dir/smoke" || failed=1
fi
exit $failed
