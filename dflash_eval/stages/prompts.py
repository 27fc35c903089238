"""Stage ``prompts`` (rule ``prompts``): one prompt set -> chat-templated prompts (text + token ids) as JSONL.

Sources, the row format and the deterministic subset rule: :mod:`dflash_eval.data.prompts`. Beside the
JSONL, ``<set>.meta.json`` records what was skipped and why (read by the report) and its provenance
block (:mod:`dflash_eval.data.provenance`). Options: config
section ``prompt_set`` (each prompt set's own ``n`` / ``seed`` / ``max_prompt_tokens`` override it;
the workflow passes the merged values) and ``generation.enable_thinking``.
"""

from __future__ import annotations

from dflash_eval.data.prompts import SOURCES, build_prompt_set_with_meta, write_prompts
from dflash_eval.core.io import sha256_file
from dflash_eval.data.provenance import stage_block, write_meta

STAGE = "prompts"


def add_arguments(p) -> None:
    p.add_argument("--source", required=True, choices=SOURCES, help="prompt source (config prompt_sets.<name>.source)")
    p.add_argument("--path", default=None, help="JSONL (id + prompt|messages) or .txt (one prompt per line) for "
                                               "--source file; optional override of the packaged data file otherwise")
    p.add_argument("--turn1-completions", default=None,
                   help="--source mt-bench-turn2: completions JSONL of the mt-bench set whose answers open the second turns")
    p.add_argument("--tokenizer", required=True, help="target folder holding the tokenizer and chat template")
    p.add_argument("--out", required=True, help="prompts JSONL; its provenance and skip counts per reason go to "
                                                "<name>.meta.json beside it (dflash_eval/data/provenance.py)")


def main(args, opts) -> None:
    rows, meta = build_prompt_set_with_meta(source=args.source, tokenizer_dir=args.tokenizer, n=opts.n, seed=opts.seed,
                                            path=args.path, enable_thinking=opts.enable_thinking,
                                            max_prompt_tokens=opts.max_prompt_tokens,
                                            turn1_completions=args.turn1_completions)
    out = write_prompts(rows, args.out)
    write_meta(out, meta, stage_block(STAGE, opts, {"prompts": sha256_file(out).hexdigest()}))
