"""Stage ``completions`` (rule ``completions``): the target's completions of one prompt set (greedy, or seeded samples).

Reads the prompts JSONL (``prompts`` stage) and the target; generates with a source of
:mod:`dflash_eval.serving.generation` (HF ``generate`` here, or a vLLM / SGLang server); writes the
completions file (:mod:`dflash_eval.data.completions`: format, resumable sidecar). Options: config
section ``generation`` and ``target.linear_attn_backend`` (:mod:`dflash_eval.core.options`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from dflash_eval.core import options as options_mod
from dflash_eval.data.completions import STOP_EOS, PartialCompletions
from dflash_eval.data.repetition import STORED_NGRAM, field_name, repeated_ngram_fraction
from dflash_eval.target.context_limit import check_context_limit
from dflash_eval.core.errors import InputError
from dflash_eval.serving.generation import ServerSource, end_of_turn_ids, open_source, stop_token_ids
from dflash_eval.core.io import sha256_file
from dflash_eval.core.progress import Progress
from dflash_eval.target.spec import TargetSpec
from dflash_eval.data.prompts import read_prompts
from dflash_eval.data.provenance import stage_block, write_meta

log = logging.getLogger(__name__)

STAGE = "completions"


def add_arguments(p) -> None:
    """Files of the stage (its options come from the config schema)."""
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--prompts", required=True, help="prompts JSONL from the 'prompts' stage")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint' (the weights are not hashed again while it matches)")
    p.add_argument("--server-log", default=None,
                   help="log file of the served vLLM (default: <out>.vllm.log); when the job starts no server, a given "
                        "file gets one line saying so (the workflow declares it for every source)")
    p.add_argument("--out", required=True, help="completions JSONL; <name>.meta.json beside it records the target's "
                                                "sha256 and the provenance block (dflash_eval/data/provenance.py)")


def main(args, opts) -> None:
    generate_completions(args.target, args.prompts, args.out, opts, server_log=args.server_log,
                         target_fingerprint=args.target_fingerprint)


def generate_completions(target_dir: str | Path, prompts_path: str | Path, out: str | Path, opts=None, *,
                         server_log: str | None = None, target_fingerprint: str | Path | None = None,
                         **overrides) -> Path:
    """Greedy (``generation.sampling`` at temperature > 0: seeded sampled) completions of every prompt in a prompts JSONL (format and resume: :mod:`dflash_eval.data.completions`).

    Completions are appended to the sidecar ``.<out name>.partial`` as they finish; the output
    is written in the prompts file's order (temp file + rename) once every prompt is done.
    A rerun after an interruption continues the sidecar (log: ``N already done``).

    Args:
        target_dir: HF target folder (server sources read only its config, tokenizer and stop ids).
        prompts_path: JSONL from the prompts stage (:func:`dflash_eval.data.prompts.read_prompts`).
        out: output JSONL.
        opts: the stage's options (:func:`dflash_eval.core.options.make`; config section ``generation`` and
            ``target.linear_attn_backend``): ``source`` (``transformers`` | ``openai`` | ``sglang``,
            :data:`dflash_eval.serving.generation.SOURCES`), ``max_new_tokens`` (stop id included),
            ``batch_size`` (prompts per ``generate`` call), ``device`` / ``dtype`` (``auto``: bf16 on
            CUDA, float32 on CPU; for ``serve: vllm`` they choose vLLM's ``--dtype``),
            ``linear_attn_backend`` (GDN kernel of hybrid targets; use the cache stage's), the server
            settings (``endpoint``, ``serve``, ``vllm``, ``concurrency``, ``timeout_s``, ``retries``,
            ``allow_retokenize``).
        server_log: the served vLLM's log (default ``<out>.vllm.log`` when vLLM is started here).
        target_fingerprint: a ``target-fingerprint`` record (:func:`dflash_eval.target.spec.write_fingerprint`),
            so the weights are not hashed again.
        **overrides: option values, when ``opts`` is not given.

    Returns:
        ``Path(out)``.

    Raises:
        InputError: a bad option, bad prompts file or target folder, prompt ids outside the vocabulary,
            a prompt + ``max_new_tokens`` beyond the target's ``max_position_embeddings`` (unless
            ``allow_beyond_max_positions``: :func:`dflash_eval.target.context_limit.check_context_limit`),
            a partial file from other settings, a server with another tokenizer or a too short max
            length, a server without token ids (unless allowed).
        ServerUnavailable / ServerError: the server failed (after retries); the partial file keeps
            what was done, a rerun resumes.
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    max_new_tokens = opts.max_new_tokens
    prompts_path, out, target_dir = Path(prompts_path), Path(out), Path(target_dir)
    rows = read_prompts(prompts_path)
    prompts_sha256 = sha256_file(prompts_path).hexdigest()
    ids_seen: set[str] = set()
    for k, r in enumerate(rows):
        if str(r["id"]) in ids_seen:
            raise InputError(prompts_path, f"line {k + 1}: id", f"duplicate prompt id {r['id']!r}", "give every prompt a unique id")
        ids_seen.add(str(r["id"]))

    check_context_limit(rows, max_new_tokens, target_dir, prompts_path, opts.allow_beyond_max_positions)
    if opts.serve == "vllm" and not server_log:
        server_log = f"{out}.vllm.log"  # the served vLLM's log beside the output
    with open_source(opts, target_dir, rows, server_log, target_fingerprint) as (src, tok, vocab):
        for k, r in enumerate(rows):
            bad = [t for t in r["prompt_ids"] if not 0 <= t < vocab]
            if bad:
                raise InputError(prompts_path, f"line {k + 1}: prompt_ids", f"ids {bad[:5]} outside the target "
                                 f"vocabulary ({vocab})", "rebuild the prompts with this target's tokenizer")
        stop_ids, by_source = stop_token_ids(target_dir, tok)
        log.info("stop ids %s (%s); declared by %s", stop_ids, ", ".join(repr(tok.convert_ids_to_tokens(i))
                                                                         for i in stop_ids), json.dumps(by_source))
        eot = end_of_turn_ids(tok)
        missing = {i: t for i, t in eot.items() if i not in stop_ids}
        if missing:
            log.warning("the tokenizer ends chat turns with %s, which the target does not declare as end of "
                        "generation: completions may run past the end of the turn (add the id to "
                        "generation_config.json eos_token_id)", ", ".join(f"{t} (id {i})" for i, t in missing.items()))

        provenance = src.provenance()
        key = {"prompts_sha256": prompts_sha256, "n_prompts": len(rows), "max_new_tokens": max_new_tokens,
               "generation": provenance, **src.resume_key()}
        partial = PartialCompletions(out, key)
        done: dict[str, str] = {}
        try:
            done.update(partial.load())
            unknown = set(done) - ids_seen
            if unknown:
                raise InputError(partial.path, "id", f"rows for prompts not in {prompts_path}: {sorted(unknown)[:5]}",
                                 f"delete {partial.path} to start over")
            todo = {i for i, r in enumerate(rows) if str(r["id"]) not in done}
            log.info("completions: %d prompts, %d already done (%s), %d to generate", len(rows), len(rows) - len(todo),
                     f"resumed from {partial.path}" if len(todo) < len(rows) else "fresh start", len(todo))
            n_new = n_gen = 0
            t0 = time.perf_counter()
            # tqdm bar on a terminal (total: at most max_new_tokens per prompt); off a terminal the
            # throttled INFO lines below are the progress, so the bar logs none of its own.
            bar = Progress(len(todo) * max_new_tokens, "completions", logger=log, log_every=float("inf"))

            def emit(results) -> None:
                nonlocal n_new, n_gen
                lines, toks = [], 0
                for i, ids, stop, extra in results:
                    r = rows[i]
                    row = {"id": r["id"], "prompt_ids": r["prompt_ids"], "completion_ids": ids,
                           "text": tok.decode(ids, skip_special_tokens=False), "stop_reason": stop,
                           "max_new_tokens": max_new_tokens, "generation": provenance,
                           field_name(STORED_NGRAM): repeated_ngram_fraction(ids, STORED_NGRAM), **extra}
                    line = json.dumps(row, ensure_ascii=False)
                    done[str(r["id"])] = line
                    lines.append(line)
                    toks += len(ids)
                partial.append(lines)
                n_gen += len(lines)
                n_new += toks
                bar.update(toks)
                el = max(time.perf_counter() - t0, 1e-9)
                if n_gen == len(todo) or len(lines) > 1 or n_gen % max(1, len(todo) // 20) == 0:
                    log.info("generated %d/%d prompts (%d done in all), %d new tokens, %.1f tokens/s", n_gen, len(todo),
                             len(done), n_new, n_new / el)

            try:
                src.run([r["prompt_ids"] for r in rows], todo, emit)
            finally:
                bar.close()
            elapsed = time.perf_counter() - t0
            partial.finish([done[str(r["id"])] for r in rows])
        except BaseException:
            partial.close()
            if partial.path.exists():
                log.error("interrupted: %d of %d prompts are done and kept in %s; rerun to resume", len(done),
                          len(rows), partial.path)
            raise
        finally:
            src.close()

    final = [json.loads(done[str(r["id"])]) for r in rows]
    n_eos = sum(1 for f in final if f["stop_reason"] == STOP_EOS)
    log.info("completions done: generated %d prompts (%d new tokens) in %.1f s = %.1f tokens/s; "
             "%d of %d stopped at a stop id, %d at max_new_tokens=%d", n_gen, n_new, elapsed,
             n_new / max(elapsed, 1e-9), n_eos, len(rows), len(rows) - n_eos, max_new_tokens)
    if isinstance(src, ServerSource) and src.n_retokenized:
        log.warning("re-tokenized %d completions from the server's text (generation.allow_retokenize): round-trip "
                    "mismatch rate %.3f (%d of them differ in length from what the server generated)",
                    src.n_retokenized, src.n_mismatch / src.n_retokenized, src.n_mismatch)
    if isinstance(src, ServerSource) and src.client.retry_counts:
        log.info("server requests retried: %s", json.dumps(src.client.retry_counts))
    early = {}
    for f in final:
        for t in f["completion_ids"][:-1]:
            if t in eot:
                early[f["id"]] = eot[t]
                break
    if early:
        log.warning("%d of %d completions contain an end-of-turn token before their end (%s): generation ran past "
                    "the end of the turn; the target's stop ids %s miss it (first: %s)", len(early), len(rows),
                    ", ".join(sorted(set(early.values()))), stop_ids, list(early)[:5])
    # the weights that generated them (the job's own model: known from the fingerprint record, not hashed again)
    weights = (TargetSpec.read(target_dir, fingerprint_file=target_fingerprint).weights_sha256()
               if target_fingerprint else None)
    write_meta(out, {"n_rows": len(rows), "max_new_tokens": max_new_tokens, "target_sha256": weights},
               stage_block(STAGE, opts, {"target": weights, "prompts": prompts_sha256,
                                         "completions": sha256_file(out).hexdigest()}))
    log.info("wrote %d completions -> %s", len(rows), out)
    return out


