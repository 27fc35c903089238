"""Stage ``prompts`` (rule ``prompts``): one prompt set -> chat-templated prompts (text + token ids) as JSONL.

Sources, the row format and the deterministic subset rule: :mod:`dflash_eval.data.prompts`; the long-context
sources (``conversation``, ``repository``, ``trajectory``) and the selection per context-length bin
(``context_bins``, ``per_bin``): :mod:`dflash_eval.data.long_context`, :mod:`dflash_eval.data.binned`. Beside the
JSONL, ``<set>.meta.json`` records what was skipped and why (read by the report), the bins' counts, and its
provenance block (:mod:`dflash_eval.data.provenance`). Options: config
section ``prompt_set`` (each prompt set's own ``n`` / ``seed`` / ``max_prompt_tokens`` / ``context_bins`` /
``per_bin`` override it; the workflow passes the merged values) and ``generation.enable_thinking``.
"""

from __future__ import annotations

from pathlib import Path

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import sha256_file
from dflash_eval.data.binned import ALL_SOURCES, build_set_with_meta
from dflash_eval.data.prompts import write_prompts
from dflash_eval.data.provenance import stage_block, write_meta
from dflash_eval.target.context_limit import max_positions

STAGE = "prompts"


def add_arguments(p) -> None:
    p.add_argument("--source", required=True, choices=ALL_SOURCES, help="prompt source (config prompt_sets.<name>.source)")
    p.add_argument("--path", default=None, help="JSONL (id + prompt|messages) or .txt (one prompt per line) for "
                                               "--source file; the trajectories JSONL for trajectory; the folder for "
                                               "repository; optional override of the packaged data file otherwise")
    p.add_argument("--turn1-completions", default=None,
                   help="--source mt-bench-turn2: completions JSONL of the mt-bench set whose answers open the second turns")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="with --context-bins and --max-prompt-tokens 0: generation.max_new_tokens; the last bin then "
                        "ends at the target's max_position_embeddings less it")
    p.add_argument("--tokenizer", required=True, help="target folder holding the tokenizer and chat template")
    p.add_argument("--out", required=True, help="prompts JSONL; its provenance and skip counts per reason go to "
                                                "<name>.meta.json beside it (dflash_eval/data/provenance.py)")


def last_bin_end(context_bins: list[int], max_prompt_tokens: int, max_new_tokens: int | None, target_dir: str,
                 name: str) -> int:
    """The last context bin's upper bound (inclusive, templated tokens): ``max_prompt_tokens``, or for 0 the target's
    ``max_position_embeddings`` less ``max_new_tokens``; 0 without bins.

    Raises:
        InputError: 0 with an unknown position limit or generation budget.
    """
    if not context_bins or max_prompt_tokens:
        return max_prompt_tokens
    limit = max_positions(Path(target_dir))
    if limit is None or max_new_tokens is None:
        raise InputError(Path(target_dir) / "config.json", f"prompt_sets.{name}.max_prompt_tokens",
                         "0 ends the last bin at max_position_embeddings less generation.max_new_tokens, and "
                         + ("the target's config.json has no max_position_embeddings" if limit is None
                            else "--max-new-tokens is not given"), "set max_prompt_tokens above the last bin edge")
    return limit - max_new_tokens


def main(args, opts) -> None:
    name = Path(args.out).name.removesuffix(".jsonl")
    upper = last_bin_end(opts.context_bins, opts.max_prompt_tokens, args.max_new_tokens, args.tokenizer, name)
    rows, meta = build_set_with_meta(source=args.source, tokenizer_dir=args.tokenizer, n=opts.n, seed=opts.seed,
                                     path=args.path, enable_thinking=opts.enable_thinking, max_prompt_tokens=upper,
                                     turn1_completions=args.turn1_completions, context_bins=opts.context_bins,
                                     per_bin=opts.per_bin, set_name=name)
    out = write_prompts(rows, args.out)
    write_meta(out, meta, stage_block(STAGE, opts, {"prompts": sha256_file(out).hexdigest()}))
