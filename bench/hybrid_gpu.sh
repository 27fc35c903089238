#!/usr/bin/env bash
# The target stages at a user's scale (issue #43), one GPU, < 9 min: the completions, extraction and
# long-context benches, each on a random 8.2B Qwen3.5-style hybrid (hidden 4096, 32 layers, 3 Gated DeltaNet :
# 1 attention, fla kernels; built on the GPU from a config, bf16) and on an 8.0B llama (Llama-3-8B layout), each
# stage beside the plain loop a user writes on the same inputs, warm, the first call / first fla use reported apart.
#
#   bash bench/hybrid_gpu.sh            # GPU host, from the repository root; figures under $OUT
#   bash bench/hybrid_gpu.sh --smoke    # CPU: tiny models, torch kernels (checks the script; tests/bench)
#   STEPS="completions_hybrid completions_llama" bash bench/hybrid_gpu.sh   # a subset (names below)
#
# Steps: completions_{hybrid,llama} (bench/completions_gpu.py), extraction_{hybrid,llama} (bench/extraction.py),
# long_context_{hybrid,llama} (bench/long_context.py: 1k / 8k / 32k-token samples). Default on a GPU (< 9 min on
# one H100): extraction_hybrid (its loop now runs two passes) and long_context_hybrid (the loop writing HDF5); with --smoke: all six.
#
# Packages the GPU host may lack (fla, einops, h5py, safetensors, tenacity, jsonschema) are installed from wheels in the
# git-ignored .whl/ (flat folder: einops, fla_core, flash_linear_attention, h5py, safetensors, tenacity, jsonschema,
# jsonschema_specifications, referencing, rpds_py, attrs) into a folder put on PYTHONPATH, only those that do not
# import. Writes under $OUT (default: a temporary folder) completions_{hybrid,llama}.{txt,json},
# extraction_{hybrid,llama}.txt, long_context_{hybrid,llama}.{txt,json}, env.txt and summary.txt (every figure
# line) for the steps run; at the end all but the summary go into hybrid_gpu.tgz (so $OUT holds summary.txt and
# hybrid_gpu.tgz; cut short, the files stay as they are).
set -uo pipefail
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/env.txt" >&2; }

# --- missing packages from the carried wheels (never the GPU host's own torch / transformers / triton)
DEPS=${DEPS:-/tmp/dflash-hybrid-deps}
need=()
want() {  # want MODULE WHEEL-PREFIX...: the wheels when MODULE does not import
  local mod=$1; shift
  if ! PYTHONPATH="$DEPS" $PY -c "import $mod" 2>/dev/null; then
    for w in "$@"; do need+=($(ls .whl/"$w"-*.whl 2>/dev/null | head -1)); done
  fi
}
if [ "$SMOKE" = 0 ]; then
  want einops einops
  want fla fla_core flash_linear_attention
  want h5py h5py
  want safetensors safetensors
  want tenacity tenacity
  want jsonschema jsonschema jsonschema_specifications referencing rpds_py attrs
  if [ ${#need[@]} -gt 0 ]; then
    say "installing into $DEPS: ${need[*]}"
    $PY -m pip install -q --no-deps --no-index --target "$DEPS" "${need[@]}" 2>&1 | tail -3 | tee -a "$OUT/env.txt" >&2
  fi
fi
export PYTHONPATH="$PWD:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  $PY -c "from dflash_eval.target.hybrid import fla_status, kernel_versions; print('fla', fla_status()); print(kernel_versions())"
} >> "$OUT/env.txt" 2>&1

# --- the runs, the hybrid first (each has its own time limit; the default steps stay under 9 min)
if [ "$SMOKE" = 1 ]; then
  STEPS=${STEPS:-completions_hybrid extraction_hybrid long_context_hybrid completions_llama extraction_llama long_context_llama}
  C=(--smoke --batches 4 --rounds 2)
  E=(--smoke --no-rss --no-ceiling)
  L=(--smoke --contexts 64,128,256 --samples 2,1,1 --no-loop)
  SCRATCH=$(mktemp -d)
else
  STEPS=${STEPS:-long_context_hybrid extraction_hybrid}
  C=(--batches 32 --n-batches 1 --rounds 2 --max-new 128 --prompt-min 64 --prompt-max 512 --static-batches "")
  E=(--no-rss --no-ceiling)
  L=(--contexts 1024,8192,32768 --samples 8,4,2 --loop-writes)
  SCRATCH=/tmp/dflash-hybrid-bench
  avail=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
  [ "${avail:-0}" -gt 41943040 ] && SCRATCH=/dev/shm/dflash-hybrid-bench  # > 40 GiB free: off the disk
fi
step() {  # step SECONDS NAME COMMAND...: only the steps named in $STEPS
  local lim=$1 name=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  say "start $name (limit $lim s)"
  timeout "$lim" "$@" > "$OUT/$name.txt" 2>&1
  say "end $name: exit $?"
}
step 170 completions_hybrid $PY bench/completions_gpu.py --target hybrid-7b "${C[@]}" --out "$OUT/completions_hybrid.json"
step 280 extraction_hybrid $PY bench/extraction.py --models hybrid-7b --stage-runs 2 "${E[@]}" --out-dir "$SCRATCH"
rm -rf "$SCRATCH/hybrid-7b"
step 260 long_context_hybrid $PY bench/long_context.py --models hybrid-7b "${L[@]}" --out-dir "$SCRATCH" \
  --out "$OUT/long_context_hybrid.json"
rm -rf "$SCRATCH/hybrid-7b"
step 90 completions_llama $PY bench/completions_gpu.py --target llama-8b "${C[@]}" --out "$OUT/completions_llama.json"
step 100 extraction_llama $PY bench/extraction.py --models llama-8b "${E[@]}" --out-dir "$SCRATCH"
rm -rf "$SCRATCH/llama-8b"
step 200 long_context_llama $PY bench/long_context.py --models llama-8b "${L[@]}" --out-dir "$SCRATCH" \
  --out "$OUT/long_context_llama.json"
rm -rf "$SCRATCH"

ALL=()
for n in completions_hybrid extraction_hybrid long_context_hybrid completions_llama extraction_llama long_context_llama; do
  [ -f "$OUT/$n.txt" ] && ALL+=("$OUT/$n.txt")
done
: > "$OUT/summary.txt"
[ ${#ALL[@]} -gt 0 ] && grep -h -E "^device|first call|first run|first pass|ratio|^batch|^  stage|^  generate|dflash-eval hidden-states|plain HF loop|cache vs loop|random init|^  context|per-token" \
  "${ALL[@]}" > "$OUT/summary.txt" 2>/dev/null
cat "$OUT/summary.txt"
say "done"
# one archive of everything beside the summary (what comes back from a GPU host is counted in files)
(cd "$OUT" && tar czf hybrid_gpu.tgz --exclude hybrid_gpu.tgz --exclude summary.txt ./* \
  && rm -f completions_*.txt completions_*.json extraction_*.txt long_context_*.txt long_context_*.json env.txt)
