"""One prompt set's cache written by N jobs: the shard plan, and the merged cache that reads as one.

Format: :mod:`dflash_eval.cache.format` ("Sharded caches"). ``hidden-states --shard K/N`` makes
the batch plan of the *whole* prompt set (:func:`dflash_eval.core.runtime.length_batches`, longest
first) and computes only the batches ``K, K + N, K + 2N, ...`` of it (:func:`shard_plan`): each
sample is computed in exactly the batch, with exactly the neighbours, it has in a one-job
extraction, so its states are bit-identical to that job's on the same GPU model and software
(packed and padded batches alike). Round-robin over the longest-first batches gives every shard
about the same tokens. A shard is an ordinary cache of its samples (``<out>.partial`` sidecar,
verified resume after a kill). :func:`merge_shards` then writes the prompt set's cache: the
file-level arrays of every sample in the completions file's order, the shards' attributes, and
per sample an HDF5 external link ``/samples/<i:06d>`` -> ``<shard file>:/samples/<j:06d>``, so
:class:`~dflash_eval.cache.reader.CacheReader` (and ``evaluate``) read it as one cache without
copying the states.

The workflow does this with config ``cache.shards: N`` (rules ``hidden_states_shard`` and
``merge_cache_shards``); by hand::

    python -m dflash_eval hidden-states ... --shard 0/2 --out cache/set.shard0.h5   # one job per GPU
    python -m dflash_eval hidden-states ... --shard 1/2 --out cache/set.shard1.h5
    python -m dflash_eval merge-cache-shards --shards cache/set.shard0.h5 cache/set.shard1.h5 \
        --completions completions/set.jsonl --out cache/set.h5
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from dflash_eval.cache.format import FILE_DATASETS, HEADER_VERSION, IDENTITY_ATTRS, h5py_module, write_header
from dflash_eval.cache.reader import CacheReader, open_h5_readonly
from dflash_eval.core.errors import InputError
from dflash_eval.core.io import sha256_file
from dflash_eval.data.completions import read_completions


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` (0 <= K < N) -> ``(K, N)``; an argparse type."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"shard K/N needs 0 <= K < N, got {text!r}")
    return k, n


def shard_plan(batches: list[list[int]], k: int, n: int) -> tuple[list[int], list[list[int]]]:
    """Shard ``k`` of ``n`` of a batch plan.

    Args:
        batches: the whole prompt set's batches (indices into its samples), in plan order.

    Returns:
        ``(keep, local)``: the shard's sample indices in ascending (completions file) order, and its
        batches ``batches[k::n]`` as indices into ``keep``.
    """
    mine = batches[k::n]
    keep = sorted(i for b in mine for i in b)
    where = {g: j for j, g in enumerate(keep)}
    return keep, [[where[g] for g in b] for b in mine]


def merge_shards(shards: list["str | Path"], completions_path: "str | Path", out: "str | Path") -> Path:
    """Write the prompt set's cache ``out`` over finished shard caches (external links, no copy of states).

    The shards must lie in ``out``'s folder (links are stored relative to it), be finished, share
    every identity attribute (:data:`~dflash_eval.cache.format.IDENTITY_ATTRS`: target, layers,
    completions file, dtype, batching, ...), and hold every sample of the completions file exactly once.

    Returns:
        ``Path(out)``, written to a temporary name and renamed (whole or absent).

    Raises:
        InputError: a shard unfinished, outside ``out``'s folder, of other settings, or samples missing or twice.
    """
    h5py = h5py_module()

    out = Path(out)
    ids = [str(r["id"]) for r in read_completions(Path(completions_path))]
    sha = sha256_file(Path(completions_path)).hexdigest()
    where: dict[str, tuple[str, int, int]] = {}  # sample id -> (shard file name, shard index, index in it)
    attrs0, runs, arrays, dtypes = None, [], {}, {}
    for s, path in enumerate(map(Path, shards)):
        if path.resolve().parent != out.resolve().parent:
            raise InputError(path, None, f"shard is not in the merged cache's folder {out.parent}",
                             "write the shards next to the merged cache")
        with CacheReader(path) as rd:  # refuses unfinished or foreign files
            attrs, shard_ids = dict(rd.attrs), list(rd.sample_ids)
        if attrs.get("completions_sha256") != sha:
            raise InputError(path, "completions_sha256", "shard of another completions file",
                             "rerun the shard on this prompt set's completions")
        attrs0 = attrs if attrs0 is None else attrs0
        diff = [k for k in IDENTITY_ATTRS if attrs.get(k) != attrs0.get(k)]
        if diff:
            raise InputError(path, diff[0], f"shard made with other settings than {shards[0]} ({', '.join(diff)})",
                             "rerun every shard with the same settings")
        runs += json.loads(attrs.get("extraction_runs") or "[]")
        for j, sid in enumerate(shard_ids):
            if sid in where:
                raise InputError(path, "sample_ids", f"sample {sid!r} also in shard {where[sid][0]}",
                                 "merge each shard once, all of one --shard K/N plan")
            where[sid] = (path.name, s, j)
        with open_h5_readonly(path) as f:
            for name in ("sample_ids", *FILE_DATASETS):
                arrays.setdefault(name, []).append(f[name][()])
                dtypes[name] = f[name].dtype
    missing = [i for i in ids if i not in where]
    if missing or len(where) != len(ids):
        raise InputError(completions_path, "id", f"{len(missing)} sample(s) in no shard (first: {missing[:3]})",
                         "extract every shard K/N for K = 0 .. N-1 and merge them all")
    tmp = out.with_name(f".{out.name}.merge-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            for k, v in attrs0.items():
                if k not in ("n_samples", "extraction_runs"):
                    f.attrs[k] = v if not isinstance(v, list) else np.asarray(v)
            f.attrs["extraction_runs"] = json.dumps(runs)
            f.attrs["shards"] = json.dumps([Path(p).name for p in shards])
            if int(attrs0["format_version"]) >= HEADER_VERSION:
                write_header(f.attrs)  # the shards' header (verified when read) plus ``shards``
            for name, parts in arrays.items():
                f.create_dataset(name, data=np.array([parts[where[i][1]][where[i][2]] for i in ids],
                                                     dtype=dtypes[name]), dtype=dtypes[name])
            grp = f.create_group("samples")
            for i, sid in enumerate(ids):
                name, _, j = where[sid]
                grp[f"{i:06d}"] = h5py.ExternalLink(name, f"/samples/{j:06d}")
            f.attrs["n_samples"] = len(ids)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out

