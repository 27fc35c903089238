"""The completions stage's context check: prompt + ``max_new_tokens`` within the target's positions.

A target trained for ``max_position_embeddings`` positions (HF ``config.json``, or its
``text_config``) produces states past them that no serving engine will show the drafter (vLLM
refuses ``--max-model-len`` beyond it by default), so such a sample's tau would describe a case that
never happens. :func:`check_context_limit` refuses it unless ``generation.allow_beyond_max_positions``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

from dflash_eval.core.errors import InputError

log = logging.getLogger(__name__)


def max_positions(target_dir: Path) -> int | None:
    """``max_position_embeddings`` of the target's ``config.json`` (top level, else ``text_config``); None if absent."""
    cfg_file = Path(target_dir) / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    value = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def check_context_limit(rows: Sequence[dict], max_new_tokens: int, target_dir: Path, prompts_path: Path,
                        allow: bool) -> None:
    """Refuse prompts whose ``len(prompt_ids) + max_new_tokens`` exceeds the target's ``max_position_embeddings``.

    Args:
        rows: the prompts (each with ``id`` and ``prompt_ids``, token ids).
        max_new_tokens: ``generation.max_new_tokens`` (tokens).
        target_dir: the target HF folder (its ``config.json``; no limit known: nothing checked).
        prompts_path: the prompts file (named in the error, with the first offending line).
        allow: ``generation.allow_beyond_max_positions``: warn instead of raising.

    Raises:
        InputError: naming the first such prompt (line, id, length), the limit, how many there are,
            and the options that fix it.
    """
    limit = max_positions(target_dir)
    if not limit:
        return
    over = [(k, r) for k, r in enumerate(rows) if len(r["prompt_ids"]) + max_new_tokens > limit]
    if not over:
        return
    k, r = over[0]
    n = len(r["prompt_ids"])
    what = (f"prompt {r['id']!r} has {n} tokens + generation.max_new_tokens {max_new_tokens} = {n + max_new_tokens}, "
            f"beyond the target's max_position_embeddings {limit} ({Path(target_dir) / 'config.json'}); "
            f"{len(over)} of {len(rows)} prompts are")
    if allow:
        log.warning("%s: %s (generated anyway: generation.allow_beyond_max_positions)", prompts_path, what)
        return
    raise InputError(prompts_path, f"line {k + 1}: prompt_ids", what + ": states past the trained positions are not "
                     "what the drafter sees in serving",
                     f"drop such prompts (prompt_set.max_prompt_tokens, or prompt_sets.<name>.max_prompt_tokens, at most "
                     f"{max(limit - max_new_tokens, 0)}), lower generation.max_new_tokens (to {max(limit - n, 1)} for "
                     "this prompt), or set generation.allow_beyond_max_positions: true (flag "
                     "--allow-beyond-max-positions) to generate anyway")
