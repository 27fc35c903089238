"""One compatibility check of a drafter against its target and a hidden-state cache.

A DFlash drafter is tied to one target (reference ``z-lab/dflash`` ``dflash/model.py``:
``fc`` fuses ``len(target_layer_ids)`` target states of ``hidden_size`` each, block
tokens are embedded with the target's ``embed_tokens`` and the mask token is a row of
it). Every stage that pairs a drafter with a target or a cache calls
:func:`check_compat`, so each mismatch has one wording.
"""

from __future__ import annotations

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.replay.metrics import agreement


def check_compat(
    cfg: DrafterConfig,
    source,
    target=None,
    embed_rows: int | None = None,
    cache_attrs: dict | None = None,
    cache_path=None,
) -> list[str]:
    """Check a drafter config against what is known of the target and the cache.

    Args:
        cfg: the drafter's parsed config.
        source: where ``cfg`` came from (file named in errors).
        target: :class:`~dflash_eval.target.spec.TargetSpec` or None.
        embed_rows: rows of the target's input embedding (``embed_tokens.weight.shape[0]``), or None.
        cache_attrs: file attributes of a hidden-state cache (:mod:`dflash_eval.cache.format`), or None.
        cache_path: the cache file (named in errors).

    Checks, each only when its inputs are given: ``target_layer_ids`` are decoder layers of the
    target (``< num_hidden_layers``; without a target, ``< num_target_layers`` of the drafter's
    own config when it states one), drafter ``hidden_size`` equals the target's / the cache's,
    ``mask_token_id`` is a row of the embedding (without one: ``< vocab_size``), and the cache
    stores every layer the drafter needs.

    Returns:
        notes (e.g. the config's ``num_target_layers`` disagreeing with the actual target).

    Raises:
        InputError: naming ``source`` (or the cache), the field and the fix.
    """
    notes: list[str] = []
    ids = cfg.target_layer_ids
    n_layers, where = None, None
    if target is not None and target.num_layers is not None:
        n_layers, where = target.num_layers, f"the {target.num_layers}-layer target {target.path}"
        if target.hidden_size is not None and cfg.hidden_size != target.hidden_size:
            raise InputError(source, "hidden_size", f"drafter {cfg.hidden_size} != target {target.hidden_size} ({target.path})",
                             "evaluate against the target this drafter was trained for")
        if target.vocab_size is not None and cfg.vocab_size != target.vocab_size:  # a config of another target
            notes.append(f"config vocab_size {cfg.vocab_size} != the target's {target.vocab_size} ({target.path}): the "
                         "drafter drafts with the target's embedding and LM head; check that this is its target")
        claimed = cfg.raw.get("num_target_layers")
        if isinstance(claimed, int) and claimed != target.num_layers:
            notes.append(f"config num_target_layers {claimed} != the target's {target.num_layers} layers "
                         "(ids checked against the target)")
    elif cache_attrs is not None:
        n_layers = int(cache_attrs["num_target_layers"])
        where = f"the {n_layers}-layer target of cache {cache_path}"
    elif isinstance(cfg.raw.get("num_target_layers"), int):
        n_layers = cfg.raw["num_target_layers"]
        where = f"num_target_layers {n_layers} of the drafter config"
    if n_layers is not None:
        bad = [i for i in ids if i >= n_layers]
        if bad:
            raise InputError(source, "dflash_config.target_layer_ids", f"{bad} out of range for {where}",
                             "use the layer ids the drafter was trained with (0-based target decoder layers)")
    rows = embed_rows if embed_rows is not None else (None if target is not None else cfg.vocab_size)
    if rows is not None and not 0 <= cfg.mask_token_id < rows:
        what = "the target embedding" if embed_rows is not None else "the drafter's vocab_size"
        raise InputError(source, "dflash_config.mask_token_id", f"{cfg.mask_token_id} is not a row of {what} ({rows} rows)",
                         "use the mask token id the drafter was trained with")
    if cache_attrs is not None:
        if int(cache_attrs["hidden_size"]) != cfg.hidden_size:
            raise InputError(source, "hidden_size",
                             f"drafter {cfg.hidden_size} != target hidden size {cache_attrs['hidden_size']} (cache {cache_path})",
                             "evaluate against the target this drafter was trained for")
        stored = [int(i) for i in cache_attrs["target_layer_ids"]]
        missing = [i for i in ids if i not in stored]
        if missing:
            raise InputError(cache_path, "target_layer_ids",
                             f"drafter needs target layers {missing} but the cache stores {stored}",
                             "add them to cache.target_layer_ids in the workflow config (this re-extracts the cache)")
    return notes


def target_fingerprint(spec) -> str:
    """The target's weight fingerprint as the cache records it (``target_sha256``).

    :meth:`TargetSpec.weights_sha256`: a sha256 over every ``*.safetensors``, taken from the
    spec's ``target-fingerprint`` record when that still matches the weight files.
    """
    return spec.weights_sha256()


def check_cache_target(spec, cache_attrs: dict, cache_path, allow_foreign_cache: bool = False) -> dict:
    """The cache must have been extracted from this very target (same weights).

    A cache of another model replays that model's hidden states and greedy completions, so its tau
    says nothing about this target. Compares the cache's ``target_sha256`` with
    :func:`target_fingerprint` of ``spec``.

    Returns:
        ``{"target_sha256", "cache_target_sha256", "match", "allowed_mismatch"}`` for the evaluate
        output (``allowed_mismatch`` is True only when they differ and ``allow_foreign_cache`` is set).

    Raises:
        InputError: the fingerprints differ (both named) and ``allow_foreign_cache`` is False.
    """
    mine = target_fingerprint(spec)
    theirs = cache_attrs.get("target_sha256")
    match = theirs == mine
    if not match and not allow_foreign_cache:
        raise InputError(cache_path, "target_sha256",
                         f"the cache was extracted from a target with weights sha256 {theirs}, but the target given "
                         f"({spec.path}) has {mine}: its hidden states and completions are another model's",
                         "evaluate with the target the cache was made from, re-extract the cache with this target "
                         "(snakemake reruns it when the target changes), or pass --allow-foreign-cache "
                         "(workflow: evaluate.allow_foreign_cache: true; recorded in the output)")
    return {"target_sha256": mine, "cache_target_sha256": theirs, "match": match,
            "allowed_mismatch": bool(not match and allow_foreign_cache)}


def check_agreement(values, sample_ids, cache_path, warn_below: float, refuse_below: float,
                    allow_low_agreement: bool = False) -> tuple[dict, list[str]]:
    """Are the cached completions the target's own greedy output?

    The replay assumes every completion token is the target's greedy choice (then the target's
    continuation *is* the completion). Completions sampled at T > 0, edited, or generated by another
    model break that, and tau is then wrong. The cache stores, per sample, the fraction of completion
    tokens equal to the target's teacher-forced argmax (``argmax_agreement``, :mod:`dflash_eval.cache.format`);
    bf16 near-ties make it slightly below 1 on GPU, never far below.

    Args:
        values: per-sample agreement (None = not recorded), in ``sample_ids`` order.
        warn_below: warn when the mean is below this (config ``evaluate.agreement_warn``).
        refuse_below: refuse when the mean is below this (config ``evaluate.agreement_min``);
            samples below it are named in the warning whatever the mean.
        allow_low_agreement: evaluate anyway (recorded in the output).

    Returns:
        ``(record, warnings)``: record ``{"min", "mean", "n_unknown", "warn_below", "refuse_below",
        "low_samples", "allowed_low"}`` for the evaluate output, and the warning lines.

    Raises:
        InputError: the mean agreement is below ``refuse_below`` and ``allow_low_agreement`` is False.
    """
    stats = agreement(values)
    low = [(sid, v) for sid, v in zip(sample_ids, values) if v is not None and v < refuse_below]
    refused = stats.mean < refuse_below
    finite = (lambda x: None if x != x else x)  # NaN (no sample records one) -> null in JSON
    record = {"min": finite(stats.min), "mean": finite(stats.mean), "n_unknown": stats.n_unknown, "warn_below": warn_below,
              "refuse_below": refuse_below, "low_samples": [sid for sid, _ in low],
              "allowed_low": bool(refused and allow_low_agreement)}
    what = (f"the completions agree with the target's greedy tokens on {stats.mean:.3f} of tokens on average "
            f"(lowest sample {stats.min:.3f})")
    if refused and not allow_low_agreement:
        raise InputError(cache_path, "argmax_agreement",
                         f"{what}, below evaluate.agreement_min {refuse_below}: they are not this target's greedy "
                         "output (sampled at T > 0, edited, or generated by another model), so tau would be wrong",
                         "regenerate the completions greedily with this target (delete the prompt set's completions "
                         "and cache), or pass --allow-low-agreement (workflow: evaluate.allow_low_agreement: true; "
                         "recorded in the output)")
    warnings = []
    if stats.n_unknown:
        warnings.append(f"{cache_path}: {stats.n_unknown} samples record no argmax_agreement (older cache): "
                        "cannot check that the completions are the target's greedy output")
    if stats.mean < warn_below or low:
        names = ", ".join(f"{sid} ({v:.3f})" for sid, v in sorted(low, key=lambda t: t[1])[:10])
        warnings.append(f"{cache_path}: {what}" + (f" (below evaluate.agreement_warn {warn_below})"
                                                   if stats.mean < warn_below else "")
                        + (f"; samples below {refuse_below}: {names}" if low else "")
                        + ("; evaluated anyway (--allow-low-agreement)" if refused else ""))
    return record, warnings
