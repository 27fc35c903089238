"""Stage ``hidden_states_shard`` (rule ``hidden_states_shard``, config ``cache.shards`` > 1): shard K of N of a prompt set's cache.

The ``hidden_states`` stage with ``--shard K/N`` (every N-th batch of the one-job batch plan:
:mod:`dflash_eval.cache.shards`); same arguments and options. Rule ``merge_cache_shards`` joins the N shards.
"""

from __future__ import annotations

from dflash_eval.stages.hidden_states import STAGE, add_arguments, main

__all__ = ["STAGE", "add_arguments", "main"]
