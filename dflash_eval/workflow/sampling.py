"""Which prompt sets are drawn at which sampling setting, and which evaluate.sampling settings each is evaluated at
(torch-free, used at parse time by :mod:`dflash_eval.workflow.plan`).

A prompt set's completions are drawn at ``generation.sampling`` overlaid, field by field, with its own
``prompt_sets.<name>.sampling`` (:func:`set_sampling`). Each ``evaluate.sampling`` setting is evaluated on the
sets drawn at its temperature, every setting on every set with ``evaluate.cross_temperature``
(:func:`evaluate_settings`): the expectation of the reference's speculative sampler is exact given
trajectories drawn at the setting (docs/design.md, "Acceptance at temperature > 0"). The caches of the sets
evaluated above temperature 0 store the target's final normed hidden state (:func:`needs_final_hidden`).
:func:`check_sampling_settings` refuses a setting or a set without a partner, naming the entry and the fix.
"""

from __future__ import annotations

from dflash_eval.core.errors import InputError
from dflash_eval.core.schema import sampling_label, schema_default


def set_sampling(config: dict, prompt_set: str) -> dict:
    """How a prompt set's completions are drawn: ``generation.sampling`` overlaid, field by field, with
    ``prompt_sets.<prompt_set>.sampling``; what neither sets takes the schema default.

    Returns:
        ``{"temperature": float, "top_p": float, "top_k": int, "seed": int}`` (temperature 0 = greedy).
    """
    out = {k: schema_default(f"generation.sampling.{k}") for k in ("temperature", "top_p", "top_k", "seed")}
    out.update((config.get("generation") or {}).get("sampling") or {})
    out.update(((config.get("prompt_sets") or {}).get(prompt_set) or {}).get("sampling") or {})
    return {"temperature": float(out["temperature"]), "top_p": float(out["top_p"]), "top_k": int(out["top_k"]),
            "seed": int(out["seed"])}


def _settings(config: dict) -> list[dict]:
    return list((config.get("evaluate") or {}).get("sampling") or [{"temperature": 0}])


def evaluate_settings(config: dict, prompt_set: str) -> list[dict]:
    """The ``evaluate.sampling`` entries evaluated on a prompt set, in their configured order: those at the
    setting its completions are drawn at (:func:`set_sampling`: the same temperature, top-p and top-k; at
    temperature 0 the filters do not matter), or every entry with ``evaluate.cross_temperature`` (each tau.csv
    row then names its trajectory and is marked as not an expectation).

    The expectation given the trajectory is exact only on trajectories drawn at the setting
    (docs/design.md, "Acceptance at temperature > 0"), so a setting whose top-p / top-k differ from the
    completions' is not evaluated there (the evaluate stage refuses it too).
    """
    if (config.get("evaluate") or {}).get("cross_temperature"):
        return _settings(config)
    drawn = setting_key(set_sampling(config, prompt_set))
    return [e for e in _settings(config) if setting_key(e) == drawn]


def needs_final_hidden(config: dict, prompt_set: str) -> bool:
    """Whether a prompt set's cache stores the target's final normed hidden state: ``cache.final_hidden`` (every
    cache), or a setting above temperature 0 among its :func:`evaluate_settings` (it needs the target's p)."""
    return bool((config.get("cache") or {}).get("final_hidden")) or any(
        float(e.get("temperature", 0)) > 0 for e in evaluate_settings(config, prompt_set))


def _where_drawn(config: dict, prompt_set: str) -> str:
    """The config entry that sets a prompt set's completion temperature (for error messages)."""
    own = ((config.get("prompt_sets") or {}).get(prompt_set) or {}).get("sampling") or {}
    return f"prompt_sets.{prompt_set}.sampling" if "temperature" in own else "generation.sampling"


def check_sampling_settings(config: dict) -> None:
    """``evaluate.sampling`` against the prompt sets' completions (:func:`set_sampling`, :func:`evaluate_settings`).

    Raises:
        InputError: two entries with the same setting (one tau.csv row each); a setting evaluated on no prompt set
            (no set is drawn at its temperature, without ``cross_temperature``); a prompt set with no setting
            at its completions' temperature (its evaluate jobs would have nothing to evaluate).
    """
    seen = {}
    entries = _settings(config)
    for i, entry in enumerate(entries):
        key = setting_key(entry)  # temperature 0 ignores the filters (one-hot argmax)
        if key in seen:
            raise InputError("config", f"evaluate.sampling[{i}]", f"the same setting as entry {seen[key]}",
                             "list each sampling setting once")
        seen[key] = i
    sets = sorted(config.get("prompt_sets") or {})
    drawn = {ps: set_sampling(config, ps)["temperature"] for ps in sets}
    shown = ", ".join(f"{ps}: {t:g}" for ps, t in drawn.items()) or "none configured"
    for i, entry in enumerate(entries):
        t = float(entry.get("temperature", 0))
        near = [ps for ps in sets if drawn[ps] == t]
        if t > 0 and near and not any(entry in evaluate_settings(config, ps) for ps in sets):
            label = sampling_label(entry)
            raise InputError("config", f"evaluate.sampling[{i}]", f"{label} matches no prompt set: the sets at "
                             f"temperature {t:g} are drawn at "
                             f"{', '.join(f'{ps}: {sampling_label(set_sampling(config, ps))}' for ps in near)}, and the "
                             "expectation given the cached completions is exact only on completions drawn at the "
                             "setting's temperature, top-p and top-k",
                             f"draw a prompt set at it (prompt_sets.<name>.sampling: {_yaml(entry)}), give this entry "
                             f"the set's top_p / top_k, or set evaluate.cross_temperature: true (rows on other "
                             "completions are then marked as not an expectation)")
        if not any(entry in evaluate_settings(config, ps) for ps in sets):
            raise InputError("config", f"evaluate.sampling[{i}]", f"temperature {t:g} matches no prompt set: a setting "
                             "is evaluated on the sets whose completions are drawn at its temperature (completion "
                             f"temperatures: {shown})",
                             ("add a greedy prompt set (one without sampling; listing prompt_sets replaces the "
                              "default humaneval + sharegpt)" if t == 0 else
                              f"add a prompt set drawn at it (prompt_sets.<name>.sampling: {{temperature: {t:g}}}, "
                              "with the setting's top_p / top_k)") + ", drop the setting, or set "
                             "evaluate.cross_temperature: true (every setting on every set, rows labelled with "
                             "their trajectory)")
    for ps in sets:
        if not evaluate_settings(config, ps) and any(float(e.get("temperature", 0)) == drawn[ps] for e in entries):
            own = set_sampling(config, ps)
            raise InputError("config", _where_drawn(config, ps), f"prompt set {ps!r} is drawn at {sampling_label(own)}, but "
                             "the evaluate.sampling settings at its temperature have other top-p / top-k "
                             f"({', '.join(sampling_label(e) for e in entries if float(e.get('temperature', 0)) == drawn[ps])}"
                             "): the expectation is exact only on completions drawn at the setting",
                             f"add {_yaml(own)} to evaluate.sampling, draw the set with the setting's top_p / top_k, "
                             "or set evaluate.cross_temperature: true (then marked as not an expectation)")
        if not evaluate_settings(config, ps):
            t = drawn[ps]
            raise InputError("config", _where_drawn(config, ps), f"prompt set {ps!r} is drawn at temperature {t:g}, "
                             "but no evaluate.sampling setting is at that temperature, so its evaluate jobs would "
                             f"have nothing to evaluate (settings: {[e.get('temperature', 0) for e in entries]})",
                             f"add a setting at temperature {t:g} to evaluate.sampling, draw the set at a temperature "
                             "that is evaluated, or set evaluate.cross_temperature: true")



def _yaml(entry: dict) -> str:
    return "{" + ", ".join(f"{k}: {entry[k]:g}" if isinstance(entry[k], float) else f"{k}: {entry[k]}"
                           for k in ("temperature", "top_p", "top_k") if k in entry) + "}"


def setting_key(entry: dict) -> tuple:
    """A sampling setting's identity as :func:`check_sampling_settings` compares them (no torch import at parse
    time): ``(temperature, top_p, top_k)``, ``(0.0,)`` for temperature 0 (which ignores the filters)."""
    t = float(entry.get("temperature", 0))
    return (t, float(entry.get("top_p", 1.0)), int(entry.get("top_k", 0))) if t > 0 else (0.0,)


def greedy_only_note(config: dict, prompt_set: str, prompt_sets) -> str | None:
    """A warning when ``validate_online`` (``sampling`` null) will run greedy only although T > 0 settings are
    evaluated on other sets: its ``prompt_set`` is evaluated at temperature 0 alone. None otherwise."""
    if config["validate_online"].get("sampling") is not None:
        return None
    sampled = sorted(x for x in prompt_sets if any(float(e.get("temperature", 0)) > 0 for e in evaluate_settings(config, x)))
    if not sampled or any(float(e.get("temperature", 0)) > 0 for e in evaluate_settings(config, prompt_set)):
        return None
    return (f"validate_online runs greedy only: its prompt set {prompt_set!r} is evaluated at temperature 0 alone; for "
            f"the speculative sampler's check set validate_online.prompt_set to a set drawn at T > 0 ({', '.join(sampled)})")
