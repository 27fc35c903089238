"""Stage ``merge_cache_shards`` (rule ``merge_cache_shards``, config ``cache.shards`` > 1): N shard caches -> one cache.

The merged file links each sample to its shard (HDF5 external links; format:
:mod:`dflash_eval.cache.format`, "Sharded caches"), so ``evaluate`` reads it as one cache.
"""

from __future__ import annotations

import logging

from dflash_eval.cache.shards import merge_shards

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--shards", nargs="+", required=True,
                   help="the finished shard caches (hidden-states --shard K/N for K = 0..N-1), in the merged "
                        "cache's folder")
    p.add_argument("--completions", required=True, help="the prompt set's completions JSONL the shards were made from")
    p.add_argument("--out", required=True, help="the prompt set's cache (it links to the shards: keep them beside it)")


def main(args, opts) -> None:
    out = merge_shards(args.shards, args.completions, args.out)
    log.info("wrote %s over %d shard(s)", out, len(args.shards))
