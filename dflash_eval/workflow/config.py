"""Parse-time checks of a workflow config against the schema (:mod:`dflash_eval.core.schema`): readable
validation errors and integral numbers (torch-free; called from ``rules/common.smk``), and the cross-field checks
the schema cannot express (:func:`check_prompt_sets`, :func:`check_context_bins`, :func:`check_generation`,
:func:`check_cache`, called by
:func:`dflash_eval.workflow.plan.build_plan`)."""

from __future__ import annotations

import difflib
from typing import Any

from dflash_eval.core.errors import InputError
from dflash_eval.core.schema import load_schema
from dflash_eval.workflow.checkpoints import NAME_RE, name_problem


def describe_validation_error(err) -> tuple[str, str]:
    """``(config entry, problem)`` of a ``jsonschema.ValidationError`` raised for a workflow config.

    The entry is a dotted path with list indices (``checkpoints.list[0].overrides``); the problem is
    jsonschema's message, except for ``oneOf``/``anyOf`` failures, whose bare message ("... is not
    valid under any of the given schemas") says nothing: they read the ``description`` of the schema
    node that failed, which for such nodes states the rule (e.g. "set either random_init: true or
    drafter (exactly one)"); a name that fails the name pattern (:data:`dflash_eval.workflow.checkpoints.NAME_RE`)
    reads what a name may hold.
    """
    if not hasattr(err, "absolute_path"):  # not a jsonschema error: keep its text
        return "(config)", str(err)
    # jsonschema's best_match descends into one alternative of a oneOf ("False was expected"); the
    # alternative means nothing to the user, the rule of the oneOf does
    node = err
    while node.parent is not None:
        node = node.parent
        if node.validator in ("oneOf", "anyOf") and isinstance(node.schema, dict) and node.schema.get("description"):
            err = node
    path = ""
    for part in err.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    problem = err.message
    if err.validator in ("oneOf", "anyOf") and isinstance(err.schema, dict) and err.schema.get("description"):
        problem = f"not one of the allowed forms: {err.schema['description']}"
    elif err.validator == "pattern" and isinstance(err.instance, str) and err.schema.get("pattern") in (
            NAME_RE.pattern, "^$|" + NAME_RE.pattern):  # a name, or '' for a default
        problem = f"{err.instance!r}: a name becomes a folder or file name, so it {name_problem(err.instance)}"
    elif err.validator == "additionalProperties" and isinstance(err.instance, dict) and isinstance(err.schema, dict):
        known = list(err.schema.get("properties", {}))
        for key in sorted(set(err.instance) - set(known)):  # a misspelt option: name the closest known one
            close = difflib.get_close_matches(key, known, n=3)
            if close:
                problem += f"; the closest known option to {key!r} is {close[0]!r}"
                if len(close) > 1:
                    problem += f" (or {' / '.join(repr(c) for c in close[1:])})"
    return path or "(top level)", problem



def integral_numbers(config: Any, node: dict | None = None) -> Any:
    """``config`` with each float the schema types ``integer`` (JSON Schema accepts ``4.0`` there) made an int, in
    place (dicts and lists), and returned: ``n: 4.0`` and ``n: 4`` are one setting, so they give the same options
    record and rerun nothing."""
    node = load_schema() if node is None else node
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if isinstance(config, float) and "integer" in kinds and "number" not in kinds and config.is_integer():
        return int(config)
    if isinstance(config, dict):
        props, other = node.get("properties", {}), node.get("additionalProperties")
        for key, value in config.items():
            sub = props.get(key, other if isinstance(other, dict) else None)
            if sub is not None:
                config[key] = integral_numbers(value, sub)
    elif isinstance(config, list) and isinstance(node.get("items"), dict):
        for i, value in enumerate(config):
            config[i] = integral_numbers(value, node["items"])
    return config


def check_prompt_sets(prompt_sets: dict) -> None:
    """Cross-entry checks of ``prompt_sets``: an ``mt-bench-turn2`` set names (``turn1``) a configured set of
    source ``mt-bench`` and reads the same data.

    Raises:
        InputError: naming the entry.
    """
    for name, ps in prompt_sets.items():
        if ps["source"] != "mt-bench-turn2":
            continue
        first = prompt_sets.get(ps["turn1"])
        if first is None or first["source"] != "mt-bench":
            what = "is not a configured prompt set" if first is None else f"has source {first['source']!r}"
            raise InputError("config", f"prompt_sets.{name}.turn1", f"{ps['turn1']!r} {what}",
                             "name the prompt set with source: mt-bench whose answers open the second turn")
        if ps.get("path") and ps["path"] != first.get("path"):
            raise InputError("config", f"prompt_sets.{name}.path", f"{ps['path']!r} differs from the first turn's data "
                             f"({first.get('path') or 'the packaged mt-bench'})", "drop path: the first turn's is used")


def check_set_checkpoints(prompt_sets: dict, checkpoints: dict) -> None:
    """``prompt_sets.<name>.checkpoints`` names configured checkpoints only.

    Raises:
        InputError: naming the entry, the unknown names and the configured ones.
    """
    for name, ps in prompt_sets.items():
        unknown = [c for c in ps.get("checkpoints") or [] if c not in checkpoints]
        if unknown:
            raise InputError("config", f"prompt_sets.{name}.checkpoints", f"{unknown} are not configured checkpoints "
                             f"(configured: {sorted(checkpoints)})",
                             "use names from the checkpoint table (checkpoints.list / glob / demo), or drop the key")


def check_context_bins(name: str, opts: dict, max_new_tokens: int, max_positions: int | None,
                       set_entry: dict | None = None) -> None:
    """Parse-time checks of a prompt set's ``context_bins`` (``opts``: ``prompt_set`` overlaid with the entry): edges
    strictly ascending, ``max_prompt_tokens`` (when not 0) above the last edge, and, when the target's
    ``max_position_embeddings`` is known, every edge and ``max_prompt_tokens`` plus ``generation.max_new_tokens``
    within it (the completions stage would refuse those prompts: :mod:`dflash_eval.target.context_limit`).
    ``set_entry`` (the set's own entry): a ``per_bin`` given there without any ``context_bins`` is refused (it would
    be ignored).

    Raises:
        InputError: naming ``prompt_sets.<name>.context_bins`` (or ``.max_prompt_tokens``, ``.per_bin``) and the fix.
    """
    bins, top = list(opts.get("context_bins") or ()), int(opts.get("max_prompt_tokens") or 0)
    if not bins and set_entry is not None and "per_bin" in set_entry:
        raise InputError("config", f"prompt_sets.{name}.per_bin", "is set but the set has no context_bins, so it "
                         "would be ignored (the set takes prompt_set.n prompts by the seeded walk)",
                         f"give prompt_sets.{name}.context_bins (lower edges, e.g. [2048, 4096]), or drop per_bin")
    if not bins:
        return
    field = f"prompt_sets.{name}.context_bins"
    # the response length in force: the set's own, else generation's
    new_key = (f"prompt_sets.{name}.max_new_tokens" if set_entry is not None and "max_new_tokens" in set_entry
               else "generation.max_new_tokens")
    if any(b <= a for a, b in zip(bins, bins[1:])):
        raise InputError("config", field, f"{bins} is not strictly ascending", "list the lower edges in ascending "
                         "order, e.g. [2048, 4096, 8192]")
    if top and top <= bins[-1]:
        raise InputError("config", f"prompt_sets.{name}.max_prompt_tokens", f"{top} does not exceed the last bin edge "
                         f"{bins[-1]}, so the last bin [{bins[-1]}, {top}] is empty",
                         "raise max_prompt_tokens above the last edge, or set it to 0 (the last bin then ends at the "
                         f"target's max_position_embeddings less {new_key})")
    if max_positions is None:
        return
    over = [b for b in bins if b + max_new_tokens > max_positions]
    if over:
        raise InputError("config", field, f"bin edge(s) {over} + {new_key} {max_new_tokens} exceed the "
                         f"target's max_position_embeddings {max_positions}: the target cannot hold those prompts",
                         f"drop those bins or lower them to at most {max_positions - max_new_tokens}, lower "
                         f"{new_key}, or use a target with more positions")
    if top + max_new_tokens > max_positions:
        raise InputError("config", f"prompt_sets.{name}.max_prompt_tokens", f"{top} + {new_key} "
                         f"{max_new_tokens} exceeds the target's max_position_embeddings {max_positions}",
                         f"set max_prompt_tokens to at most {max_positions - max_new_tokens}, or 0 (up to that)")
    if not top and max_positions - max_new_tokens <= bins[-1]:
        raise InputError("config", field, f"the last bin [{bins[-1]}, max_position_embeddings {max_positions} - "
                         f"max_new_tokens {max_new_tokens}] is empty", "drop or lower the last bin, or lower "
                         f"{new_key}")


def check_generation(gen: dict) -> None:
    """Cross-field checks of config section ``generation`` (serving-engine sources).

    Raises:
        InputError: ``serve: vllm`` with a source other than ``openai`` or together with ``endpoint.url``;
            a server source with neither a URL nor ``serve: vllm``.
    """
    serve_vllm = gen.get("serve") == "vllm"
    url = (gen.get("endpoint") or {}).get("url")
    if serve_vllm and gen["source"] != "openai":
        raise InputError("config", "generation.serve", f"vllm serves the 'openai' protocol, but generation.source is "
                         f"{gen['source']!r}", "set generation.source: openai")
    if serve_vllm and url:
        raise InputError("config", "generation", "both serve: vllm and endpoint.url are set",
                         "use your server (endpoint.url, serve: none) or let the workflow start vLLM (serve: vllm, no url)")
    if gen["source"] != "transformers" and not serve_vllm and not url:
        raise InputError("config", "generation.source", f"{gen['source']!r} needs a server",
                         "set generation.endpoint.url (e.g. http://gpu-host:8000), or generation.serve: vllm")


def check_cache(cache: dict, engine_parity: bool = False) -> None:
    """Cross-field checks of config section ``cache`` (the ``vllm`` source).

    ``engine_parity``: ``engine_parity.enabled``; with ``source: hf`` its job extracts with vLLM, configured by
    ``cache.vllm``, so those settings are then checked as for ``source: vllm``.

    Raises:
        InputError: ``shards`` > 1 with ``source: vllm``; ``cache.vllm.url`` with ``source: hf`` and no
            ``engine_parity`` (it would be ignored); settings of the job-owned
            server (``tensor_parallel_size`` > 1, a ``connector`` other than ``auto``) together with ``url``
            (your server has its own flags: docs/serving-engines.md); ``storage_dir`` without ``url``.
    """
    v = cache.get("vllm") or {}
    url = v.get("url")
    if cache.get("source", "hf") == "vllm" and int(cache.get("shards", 1) or 1) > 1:
        raise InputError("config", "cache.shards", f"{cache['shards']} shards split the HF forward, but cache.source "
                         "is 'vllm' (one server per prompt set)", "drop cache.shards, or use cache.source: hf")
    if cache.get("source", "hf") != "vllm" and not engine_parity:
        if url:
            raise InputError("config", "cache.vllm.url", "set, but cache.source is 'hf' (the HF forward inside the "
                             "job) and engine_parity is off: the server would not be used",
                             "set cache.source: vllm (or engine_parity.enabled: true), or drop cache.vllm.url")
        return
    if url:
        if int(v.get("tensor_parallel_size", 1)) > 1 or v.get("connector", "auto") != "auto":
            raise InputError("config", "cache.vllm", "tensor_parallel_size / connector configure the server the job "
                             "starts, but cache.vllm.url names your own server",
                             "start your server with those flags (docs/serving-engines.md) and drop them here")
    elif v.get("storage_dir"):
        raise InputError("config", "cache.vllm.storage_dir", "only for your own server (cache.vllm.url); the "
                         "job-owned server writes its dumps beside the cache", "drop storage_dir, or set cache.vllm.url")
