#!/usr/bin/env bash
# Regenerate the demo drafters of the SmolLM2-135M-Instruct target on one GPU (used: one H200).
#   stage gen:   GGUF -> HF target; greedy training completions of the ShareGPT training prompts;
#                eval completions + bf16 hidden-state caches of the two demo prompt sets
#   stage train: the demo drafter run (2 layers, block 8), its checkpoints stripped and replayed on
#                the eval caches
# Inputs (made on the CPU machine, see demo/drafters/PROVENANCE.md): $DATA/train_prompts.jsonl,
# $DATA/eval_humaneval.jsonl, $DATA/eval_sharegpt.jsonl; the GGUF at $GGUF.
# Usage: scripts/demo_drafters_gpu.sh gen|train WORKDIR OUTDIR
set -euo pipefail
stage=$1; W=$2; OUTD=$3
DATA=${DATA:-.dev/data}; GGUF=${GGUF:-$W/smol.gguf}
LAYERS=${LAYERS:-1,8,15,22,27}
BUDGET=${BUDGET:-450}
PY=${PY:-python3}; DEV=${DEV:-cuda}
export PYTHONUNBUFFERED=1
mkdir -p "$W" "$OUTD"
run() { echo "+ $*" >&2; "$@"; }
if [ "$stage" = gen ]; then
  run $PY -m dflash_eval target-from-gguf --gguf "$GGUF" --out "$W/target"
  run $PY -m dflash_eval completions --target "$W/target" --prompts "$DATA/train_prompts.jsonl" \
      --max-new-tokens 256 --batch-size 1280 --device "$DEV" --out "$W/train.jsonl"
  for s in humaneval sharegpt; do
    run $PY -m dflash_eval completions --target "$W/target" --prompts "$DATA/eval_$s.jsonl" \
        --max-new-tokens 256 --batch-size 32 --device "$DEV" --out "$W/eval/completions/$s.jsonl"
    run $PY -m dflash_eval hidden-states --target "$W/target" --completions "$W/eval/completions/$s.jsonl" \
        --layer-ids "$LAYERS" --device "$DEV" --out "$W/eval/cache/$s.h5"
  done
  gzip -c "$W/train.jsonl" > "$OUTD/train_completions.jsonl.gz"
elif [ "$stage" = train ]; then
  # the run that produced demo/drafters (demo/drafters/PROVENANCE.md); checkpoints at 2 % / 25 % of the
  # time budget and at its end
  run $PY -m dflash_eval train --target "$W/target" --data "$W/train.jsonl" --layer-ids "$LAYERS" \
      --seqs-per-step 64 --anchors 32 --max-steps 100000 --time-budget-s "$BUDGET" --save-fracs 0.02,0.25 \
      ${MASK:+--mask-token-id $MASK} --device "$DEV" --seed 0 --out-dir "$W/D" \
      --num-layers 2 --intermediate-size 704 --block-size 8
  for ck in "$W"/D/step*.pt; do
    name=D-$(basename "$ck" .pt)
    run $PY -m dflash_eval strip-drafter --checkpoint "$ck" --target "$W/target" --out-dir "$W/drafters/$name"
    for s in humaneval sharegpt; do
      run $PY -m dflash_eval evaluate --drafter "$W/drafters/$name" --cache "$W/eval/cache/$s.h5" \
          --target "$W/target" --device "$DEV" --batch-size 32 --out "$W/evals/$name/$s.json"
    done
    cp "$W/drafters/$name/model.safetensors" "$OUTD/$name.safetensors"
  done
  $PY -m dflash_eval summary --evals "$W"/evals/*/*.json --out-csv "$OUTD/gpu_tau.csv" --out-parquet "$W/gpu_tau.parquet"
  cat "$OUTD/gpu_tau.csv"
fi
