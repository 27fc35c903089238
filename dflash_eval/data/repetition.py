"""How much a completion repeats itself: the fraction of its token n-grams that already occurred earlier in it.

A completion that loops (the same sentence, list item or code line over and over) is easy to draft: the drafter
has seen the continuation a few tokens back, so acceptance is high for a reason that says little about the
drafter. Serving engines meet such output too (vLLM issues report looping output with healthy acceptance), so the
tau table keeps those samples in ``tau`` and adds ``n_loop`` / ``tau_noloop`` beside it
(:mod:`dflash_eval.report.loops`).

The measure, for a response of token ids ``x[0..L-1]`` (its ``completion_ids``, the stop id included) and
``n >= 1``::

    grams    = [x[i:i+n] for i in 0 .. L-n]            # L - n + 1 n-grams, overlapping
    repeated = #{i : x[i:i+n] == x[j:j+n] for some j < i}
    fraction = repeated / (L - n + 1) = 1 - distinct n-grams / (L - n + 1)

0.0 for a response shorter than ``n`` tokens (it has no n-gram) and for one whose n-grams are all distinct; it
approaches 1 for a response that cycles through a short pattern (a 5-token cycle repeated 4 times: 20 tokens,
13 8-grams of which 5 are distinct, ``8 / 13``). The first occurrence of every n-gram is never counted, so a
response that is one block said twice scores about 1/2.

Why this measure: it can be checked by hand (list the n-grams, mark each one seen before, divide), it has no
model or tokenizer of its own (token ids, so it is exact for the target's tokenizer: two texts that differ in
whitespace are different ids and count as different), and n = 8 is long enough that ordinary phrases ("of the",
a function signature's punctuation) rarely repeat by chance in a few hundred tokens while a looping sentence
repeats every one of its 8-grams. What it misses: repetition with small edits (a counter that increments, a
list item whose number changes, paraphrase) breaks the n-grams at every edit, so such loops score low unless the
edited runs are longer than n; it does not say where the loop starts (a long healthy answer that loops at the end
scores by the share of the looping tail); and it is a property of the response, not of the drafter, so the same
flag applies to every checkpoint evaluated on that completion.

Stored per completion by the completions stage (:data:`STORED_NGRAM`, field :func:`field_name`); a completions
file written before the field existed, or a config with another ``loops.ngram``, is measured from the token ids
when read (:func:`row_repetition`), so existing completions need no rerun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from dflash_eval.data.completions import read_completions

#: the n of the value the completions stage stores with every completion (the schema's default ``loops.ngram``)
STORED_NGRAM = 8


def field_name(n: int) -> str:
    """The completions row field holding the measure at ``n``: ``repeated_8gram_fraction`` for 8."""
    return f"repeated_{int(n)}gram_fraction"


def repeated_ngram_fraction(ids: Sequence[int], n: int = STORED_NGRAM) -> float:
    """The fraction of the token n-grams of ``ids`` that already occurred earlier in ``ids`` (module docstring).

    Args:
        ids: one response's token ids, ``[L]`` ints (a list or a 1-D integer array).
        n: n-gram length in tokens, >= 1.

    Returns:
        ``repeated / (L - n + 1)`` in ``[0, 1)``, a Python float; 0.0 when ``L < n``.

    Raises:
        ValueError: ``n < 1``, or ``ids`` is not one-dimensional.
    """
    if n < 1:
        raise ValueError(f"n-gram length {n} < 1")
    x = np.asarray(ids, dtype=np.int64)
    if x.ndim != 1:
        raise ValueError(f"token ids of shape {x.shape}, expected [L]")
    if len(x) < n:
        return 0.0
    grams = np.lib.stride_tricks.sliding_window_view(x, n)  # [L - n + 1, n]
    distinct = len(np.unique(grams, axis=0))
    return float(1.0 - distinct / len(grams))


def row_repetition(row: dict, n: int = STORED_NGRAM) -> float:
    """The measure of one completions row (:func:`dflash_eval.data.completions.read_completions`) at ``n``: the stored
    :func:`field_name` value when the row has it, else computed from its ``completion_ids``."""
    stored = row.get(field_name(n))
    return float(stored) if stored is not None else repeated_ngram_fraction(row["completion_ids"], n)


def read_repetition(path: str | Path, n: int = STORED_NGRAM) -> dict[str, float]:
    """``{sample id: measure at n}`` of every row of a completions file (:func:`row_repetition`).

    Raises:
        InputError: the file is missing or malformed (:func:`dflash_eval.data.completions.read_completions`).
    """
    return {str(r["id"]): row_repetition(r, n) for r in read_completions(path)}
