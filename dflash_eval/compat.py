"""One compatibility check of a drafter against its target and a hidden-state cache.

A DFlash drafter is tied to one target (reference ``z-lab/dflash`` ``dflash/model.py``:
``fc`` fuses ``len(target_layer_ids)`` target states of ``hidden_size`` each, block
tokens are embedded with the target's ``embed_tokens`` and the mask token is a row of
it). Every stage that pairs a drafter with a target or a cache calls
:func:`check_compat`, so each mismatch has one wording.
"""

from __future__ import annotations

from .drafter_config import DrafterConfig
from .errors import InputError


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
        target: :class:`~dflash_eval.target.TargetSpec` or None.
        embed_rows: rows of the target's input embedding (``embed_tokens.weight.shape[0]``), or None.
        cache_attrs: file attributes of a hidden-state cache (:mod:`dflash_eval.cache`), or None.
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
