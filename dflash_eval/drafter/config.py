"""Drafter configuration: parse and validate a DFlash drafter ``config.json`` (HF Qwen3 layout + ``dflash_config``).

Kept apart from :mod:`dflash_eval.drafter.model` so that the model file reads top to bottom
against the paper. The fields and where they are read from follow the reference
``z-lab/dflash`` (``dflash/model.py``, ``_draft_value``): ``block_size``,
``mask_token_id`` and ``target_layer_ids`` come from ``dflash_config`` or from the top
level (older checkpoints), and are never guessed.

**Fields stored twice.** Several fields can sit in two places of one config
(:func:`field_locations`): a ``dflash_config`` field and its top-level copy (dflash 0.1.0
reads ``dflash_config`` first, z-lab HEAD reads ``block_size`` from the top level),
``dtype`` and its older name ``torch_dtype``, ``rope_theta`` at the top level and inside
``rope_parameters`` / ``rope_scaling``, and the two RoPE dicts themselves (transformers 5
uses ``rope_scaling`` when both are present and drops ``rope_parameters``,
``modeling_rope_utils.py`` ``convert_rope_params_to_dict``). When the copies agree nothing
is said; when they differ the config is refused with both values named
(:func:`check_duplicated_fields`) -- never a silent choice -- and ``--override FIELD=JSON``
(workflow: the checkpoint entry's ``overrides``) settles it by writing the given value to
every copy (recorded in ``strip_info.json`` notes). :data:`OVERRIDE_KEYS` are the only
accepted override keys; any other key is an error.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import non_finite_entry
from dflash_eval.drafter.families import DEFAULT, FAMILIES, SHARED_FIELDS, DrafterFamily, family_of_config

# Config keys of DFlash variants this implementation does not model. A checkpoint
# carrying them would load "successfully" with the wrong maths, so refuse it.
UNSUPPORTED_DFLASH_KEYS = ("attention_sink_bias",)
# Variant switches (sglang / MiMo-style drafts) that change the maths only when set to a true value.
UNSUPPORTED_DFLASH_SWITCHES = ("use_swa", "causal")
# Target-only fields that must not leak into the drafter (speculators #613/#738).
IGNORED_TARGET_FIELDS = ("partial_rotary_factor",)
#: ``dflash_config`` fields every drafter reads; older checkpoints keep them at the top level (a family's own
#: fields: its ``config_fields``, :mod:`dflash_eval.drafter.families`)
DFLASH_FIELDS = SHARED_FIELDS
#: where a drafter config records the sequence length it was trained on (:attr:`DrafterConfig.trained_max_len`):
#: the training block of ``dflash_eval.drafter.train``; other trainers' checkpoints record none that is read
TRAINED_MAX_LEN_FIELD = "dflash_config.training.max_len"
#: the RoPE dicts of an HF config: transformers 5's name first, then the older one
ROPE_DICTS = ("rope_parameters", "rope_scaling")
#: keys ``--override`` / a checkpoint entry's ``overrides`` accept: the fields above, plus the
#: other fields a config can hold twice (an override writes its value to every copy)
OVERRIDE_KEYS = DFLASH_FIELDS + ("dtype", "rope_theta", "rope_parameters")


def _norm(value: Any) -> Any:
    """Comparable form of a config value: tuples as lists, ``torch.bfloat16`` as ``bfloat16``."""
    if isinstance(value, tuple):
        return [_norm(v) for v in value]
    if isinstance(value, list):
        return [_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("torch."):
        return value[len("torch."):]
    return value


def _rope_dict(d: dict) -> dict:
    """A RoPE dict without ``rope_theta`` (a field of its own), ``type`` spelled ``rope_type``."""
    out = {k: _norm(v) for k, v in d.items() if k not in ("rope_theta", "type")}
    if "type" in d and "rope_type" not in d:
        out["rope_type"] = _norm(d["type"])
    return out


def field_locations(cfg: dict) -> dict[str, list[tuple[str, Any]]]:
    """Every copy of each field a drafter config can hold twice: ``{field: [(location, value), ...]}``.

    Fields: each of :data:`DFLASH_FIELDS` and of every family's ``config_fields`` (``dflash_config.<f>`` and
    top-level ``<f>``), ``dtype``
    (``dtype``, ``torch_dtype``), ``rope_theta`` (top level, ``rope_parameters.rope_theta``,
    ``rope_scaling.rope_theta``) and ``rope_parameters`` (the ``rope_parameters`` and
    ``rope_scaling`` dicts without ``rope_theta``, ``type`` read as ``rope_type``; a dict naming
    two different types in ``type`` and ``rope_type`` counts as two copies). Only copies that are
    present are listed.
    """
    dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    out: dict[str, list[tuple[str, Any]]] = {}
    for name in DFLASH_FIELDS + tuple(f for fam in FAMILIES.values() for f in fam.config_fields):
        out[name] = [(loc, d[name]) for loc, d in ((f"dflash_config.{name}", dcfg), (name, cfg)) if name in d]
    out["dtype"] = [(k, cfg[k]) for k in ("dtype", "torch_dtype") if k in cfg and cfg[k] is not None]
    ropes = [(k, cfg[k]) for k in ROPE_DICTS if isinstance(cfg.get(k), dict)]
    out["rope_theta"] = ([("rope_theta", cfg["rope_theta"])] if cfg.get("rope_theta") is not None else []) + [
        (f"{k}.rope_theta", d["rope_theta"]) for k, d in ropes if d.get("rope_theta") is not None]
    rope_copies = []
    for k, d in ropes:
        if "type" in d and "rope_type" in d and _norm(d["type"]) != _norm(d["rope_type"]):
            # one dict naming two RoPE types: two readings of it, as different as two dicts
            rope_copies.append((f"{k} (read by 'type')", {**_rope_dict(d), "rope_type": _norm(d["type"])}))
            rope_copies.append((f"{k} (read by 'rope_type')", {**_rope_dict(d), "rope_type": _norm(d["rope_type"])}))
        else:
            rope_copies.append((k, _rope_dict(d)))
    out["rope_parameters"] = rope_copies
    return {k: v for k, v in out.items() if v}


def check_duplicated_fields(cfg: dict, source: str) -> None:
    """Refuse a config whose copies of one field (:func:`field_locations`) disagree.

    Raises:
        InputError: naming the field, every copy with its value, and the ``--override`` that settles it.
    """
    for name, copies in field_locations(cfg).items():
        if len({json.dumps(_norm(v), sort_keys=True) for _, v in copies}) > 1:
            values = ", ".join(f"{loc}={v!r}" for loc, v in copies)
            fix = (f"set the right value with --override {name}=<JSON> (workflow: the checkpoint entry's "
                   f"overrides: {{{name}: ...}}), which writes it to every copy, or correct the config file"
                   if name in OVERRIDE_KEYS else "correct the config file (or pass a corrected one with "
                   "--drafter-config; workflow: the checkpoint entry's drafter_config)")
            raise InputError(
                source, name,
                f"stored twice with different values ({values}); dflash-eval does not guess which one the "
                "drafter was trained with", fix,
            )


def check_override_keys(overrides: dict | None) -> None:
    """Refuse override keys outside :data:`OVERRIDE_KEYS` (an unknown key must never be ignored).

    Raises:
        InputError: naming the key, the accepted keys and the closest one.
    """
    for name in overrides or {}:
        if name not in OVERRIDE_KEYS:
            close = difflib.get_close_matches(str(name), OVERRIDE_KEYS, n=1)
            raise InputError(
                None, f"override {name!r}",
                f"unknown key (accepted: {', '.join(OVERRIDE_KEYS)})" + (f"; did you mean {close[0]!r}?" if close else ""),
                "fix the key in the checkpoint entry's overrides (CLI: strip --override KEY=JSON)",
            )


def apply_overrides(cfg: dict, overrides: dict, source: str) -> list[str]:
    """Write each override to every copy of its field in ``cfg`` (in place); returns notes.

    A field with no copy yet is written to its main place (``dflash_config.<f>`` for
    :data:`DFLASH_FIELDS`, the top level otherwise).

    Raises:
        InputError: a key outside :data:`OVERRIDE_KEYS` (with the closest accepted key), or a
            ``rope_parameters`` value that is not an object.
    """
    check_override_keys(overrides)
    notes: list[str] = []
    locations = field_locations(cfg)
    for name, value in overrides.items():
        if value is None:
            continue
        if name == "rope_parameters" and not isinstance(value, dict):
            raise InputError(None, "override 'rope_parameters'", f"must be a JSON object, got {value!r}",
                             'e.g. rope_parameters={"rope_type": "default"}')
        stored = [(loc, v) for loc, v in locations.get(name, [])]
        differing = [f"{loc}={v!r}" for loc, v in stored if _norm(v) != _norm(value)
                     and not (name == "rope_parameters" and v == _rope_dict(value))]
        if differing:
            notes.append(f"override {name}={value!r} replaces the checkpoint's {', '.join(differing)}")
        if name in DFLASH_FIELDS:
            dcfg = cfg.setdefault("dflash_config", {})
            dcfg[name] = copy.deepcopy(value)
            if name in cfg:
                cfg[name] = copy.deepcopy(value)
        elif name == "dtype":
            cfg["dtype"] = value
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = value
        elif name == "rope_theta":
            cfg["rope_theta"] = value
            for k in ROPE_DICTS:
                if isinstance(cfg.get(k), dict) and "rope_theta" in cfg[k]:
                    cfg[k]["rope_theta"] = value
        else:  # rope_parameters: one dict for both names; rope_theta stays its own field
            present = [k for k in ROPE_DICTS if isinstance(cfg.get(k), dict)] or ["rope_parameters"]
            for k in present:
                theta = (cfg.get(k) or {}).get("rope_theta") if isinstance(cfg.get(k), dict) else None
                cfg[k] = copy.deepcopy(value)
                if theta is not None and "rope_theta" not in value:
                    cfg[k]["rope_theta"] = theta
    return notes


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters, read from an HF ``config.json`` (Qwen3 layout + ``dflash_config``).

    ``block_size``, ``mask_token_id`` and ``target_layer_ids`` are read from
    ``dflash_config`` or the top level (older checkpoints), as ``dflash==0.1.0``
    ``_draft_value`` does; a field stored in both places with different values is
    refused (module docstring). They are never recomputed.
    The family's own fields (its ``config_fields``, e.g. DFlash 2's conv and selector sizes) are read the same
    way, by the family (:mod:`dflash_eval.drafter.families`), into :attr:`family_fields`, and read back as
    attributes (``cfg.selector_top_k``); :attr:`variant` names the family.
    ``sliding_window`` is set only for configs with ``sliding_attention`` layers
    (which require ``use_sliding_window: true``); ``is_causal`` is the optional
    top-level override of every layer's causality (reference semantics).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    is_causal: bool | None = None
    #: the drafter's family (:data:`dflash_eval.drafter.families.FAMILIES` name; tau.csv ``variant``)
    variant: str = DEFAULT
    #: the family's own fields (its ``config_fields``), read as attributes (:meth:`__getattr__`)
    family_fields: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict, repr=False)
    notes: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def from_dict(
        cls,
        cfg: dict,
        source: str = "config.json",
        overrides: dict | None = None,
    ) -> "DrafterConfig":
        """Parse and validate a drafter ``config.json`` dict (the argument is never modified).

        Args:
            cfg: the JSON object (HF Qwen3 config with ``dflash_config``).
            source: file name used in error messages.
            overrides: ``{field: value}`` with keys from :data:`OVERRIDE_KEYS`, e.g. a
                ``target_layer_ids`` the file lacks; each value is written to every copy of
                its field (noted when it replaces a stored value). ``raw`` holds the result.

        Raises:
            InputError: an unknown override key; a field stored twice with different values
                (:func:`check_duplicated_fields`); a required field missing or malformed; or a
                DFlash variant this project does not implement.
        """
        cfg = copy.deepcopy(cfg)
        notes: list[str] = apply_overrides(cfg, dict(overrides or {}), source)
        check_duplicated_fields(cfg, source)
        check_finite_numbers(cfg, source)
        dcfg = cfg.get("dflash_config") or {}

        unsupported = [k for k in UNSUPPORTED_DFLASH_KEYS if k in dcfg or k in cfg]
        unsupported += [k for k in UNSUPPORTED_DFLASH_SWITCHES if dcfg.get(k) or cfg.get(k)]
        for key in unsupported:
            raise InputError(
                source, f"dflash_config.{key}",
                "this is an attention-sink / SWA-variant drafter (sglang / MiMo style), which dflash-eval does "
                "not implement",
                "evaluate it with the engine it was trained for, or file an issue with the checkpoint layout",
            )
        for key in IGNORED_TARGET_FIELDS:
            rp = cfg.get("rope_parameters") or {}
            if key in cfg or (isinstance(rp, dict) and key in rp):
                cfg.pop(key, None)
                if isinstance(rp, dict):
                    rp.pop(key, None)
                notes.append(
                    f"ignored target-only field '{key}' (the drafter uses full RoPE; speculators #613/#738)"
                )

        def pick(name: str, required: bool = True, default: Any = None):
            # copies agree (check_duplicated_fields), so the order only picks where to look first
            if name in dcfg:
                return dcfg[name]
            if name in cfg:
                return cfg[name]
            if required:
                raise InputError(
                    source, f"dflash_config.{name}",
                    "missing (dflash-eval never guesses it: the build_target_layer_ids fallback "
                    "loads wrong layers silently, z-lab/dflash #156)",
                    f"add dflash_config.{name} to the checkpoint config, or set it in the checkpoint "
                    f"entry of the workflow config (overrides: {{{name}: ...}}; CLI: strip --override {name}=...)",
                )
            return default

        def need(name: str, default: Any = None) -> int:
            value = cfg.get(name)
            value = default if value is None else value
            if value is None:
                raise InputError(source, name, "missing", f"add '{name}' to the drafter config.json")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InputError(source, name, f"must be a positive integer, got {value!r}", f"fix '{name}'")
            return value

        def flag(name: str, default: bool = False) -> bool:
            value = cfg.get(name, default)
            if not isinstance(value, bool):  # bool("false") is True
                raise InputError(source, name, f"must be true or false, got {value!r}", f"fix '{name}' (a JSON boolean)")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        n_layers = need("num_hidden_layers")
        layer_types = check_layer_types(cfg, n_layers, source, notes)
        sliding = None
        if "sliding_attention" in layer_types:
            # transformers' Qwen3Config drops sliding_window unless use_sliding_window is true (so the
            # reference then applies no window), while SpecForge refuses such a config: ambiguous, refuse.
            if cfg.get("use_sliding_window") is not True:
                raise InputError(
                    source, "use_sliding_window",
                    f"layer_types has sliding_attention but use_sliding_window is {cfg.get('use_sliding_window')!r} "
                    "(the reference then applies no window; SpecForge refuses to train such a config)",
                    "set use_sliding_window: true and sliding_window to the trained window, or make every "
                    "layer full_attention (pass the corrected config with --drafter-config)",
                )
            # no default: transformers' Qwen3Config would give 4096 (absent) or no window (null), the z-lab MLX
            # reference (dflash model_mlx.py) refuses the config; a drafter trained with another window would be
            # evaluated with the wrong one, silently
            if cfg.get("sliding_window") is None:
                raise InputError(
                    source, "sliding_window",
                    f"{'null' if 'sliding_window' in cfg else 'missing'} while layers "
                    f"{[i for i, t in enumerate(layer_types) if t == 'sliding_attention']} are sliding_attention "
                    f"(the reference would apply {'no window' if 'sliding_window' in cfg else 'transformers default 4096'}"
                    "; dflash-eval does not guess the trained window)",
                    "give sliding_window as trained (the training run's config, e.g. 2048) in the drafter's "
                    "config.json (pass the corrected config with --drafter-config)",
                )
            sliding = need("sliding_window")
        is_causal = cfg.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            raise InputError(source, "is_causal", f"must be true/false, got {is_causal!r}", "fix is_causal")
        if is_causal is not None:
            notes.append(f"is_causal={is_causal} applies to every layer (reference Qwen3DFlashAttention)")
        tli = pick("target_layer_ids")
        if not isinstance(tli, (list, tuple)) or not tli or not all(isinstance(i, int) and i >= 0 for i in tli):
            raise InputError(source, "dflash_config.target_layer_ids", f"must be a non-empty list of layer indices, got {tli!r}", "fix the list")
        block_size, mask_token_id = pick("block_size"), pick("mask_token_id")
        for name, value, low in (("block_size", block_size, 2), ("mask_token_id", mask_token_id, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(source, f"dflash_config.{name}", f"must be an integer >= {low}, got {value!r}", f"fix {name}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise InputError(source, "hidden_act", f"'{act}' not supported (DFlash drafters use silu)", "use silu")
        softcap = pick("final_logit_softcapping", required=False)
        family = family_of_config(cfg, dcfg, source)
        fields = family.read_fields(cfg, dcfg, source, {"hidden_size": hidden, "vocab_size": need("vocab_size"),
                                                        "block_size": block_size}, notes)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=need("num_key_value_heads", heads),
            head_dim=need("head_dim", hidden // heads),
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            target_layer_ids=[int(i) for i in tli],
            block_size=block_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=flag("attention_bias"),
            hidden_act=act,
            layer_types=layer_types,
            sliding_window=sliding,
            input_embedding_scale=float(pick("input_embedding_scale", required=False, default=1.0)),
            output_multiplier=float(pick("output_multiplier", required=False, default=1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            is_causal=is_causal,
            variant=family.name,
            family_fields=fields,
            raw=cfg,
            notes=notes,
        )

    def __getattr__(self, name: str):
        """A field of the drafter's family (``cfg.selector_top_k``; its ``config_fields``).

        Raises:
            AttributeError: not a field of the family."""
        fields = self.__dict__.get("family_fields") or {}
        if name in fields:
            return fields[name]
        raise AttributeError(f"{type(self).__name__} of family {self.__dict__.get('variant')!r} has no {name!r}")

    @property
    def family(self) -> DrafterFamily:
        """The drafter's family (:mod:`dflash_eval.drafter.families`)."""
        return FAMILIES[self.variant]

    @property
    def architecture(self) -> str:
        """The ``architectures`` entry of the drafter's family."""
        return self.family.architecture

    @property
    def trained_max_len(self) -> int | None:
        """The sequence length (tokens, prompt + completion) the drafter was trained on, where its config records it:
        :data:`TRAINED_MAX_LEN_FIELD` (written by ``dflash_eval.drafter.train``); None when absent or not a positive
        integer (it only labels the report's tau against context, so a malformed value is not an error)."""
        value = (self.raw.get("dflash_config") or {}).get("training") or {}
        value = value.get("max_len") if isinstance(value, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def rotary_config(self):
        """A ``transformers.Qwen3Config`` carrying only what RoPE needs (theta, scaling, head_dim); ``raw`` is not modified."""
        # deep copies: transformers writes into the RoPE dict it is given (rope_theta, rope_type), and
        # raw is what strip writes out. The two RoPE dicts agree (check_duplicated_fields), so one is passed.
        rope = next((self.raw[k] for k in ROPE_DICTS if isinstance(self.raw.get(k), dict)), None)
        kw = {k: self.raw[k] for k in ("rope_theta", "max_position_embeddings") if self.raw.get(k) is not None}
        if rope is not None:
            kw["rope_parameters"] = copy.deepcopy(rope)
        return qwen3_config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            **kw,
        )


#: transformers ``Qwen3Config`` defaults of ``sliding_window`` and ``max_window_layers`` (what a config without them
#: gets when the reference builds it)
QWEN3_SLIDING_WINDOW, QWEN3_MAX_WINDOW_LAYERS = 4096, 28


def qwen3_config(**fields):
    """transformers' ``Qwen3Config(**fields)``: the config class of the drafter's layers upstream."""
    from transformers import Qwen3Config  # deferred: DrafterConfig and the drafter build transformers-free (tests/core/test_startup.py)

    return Qwen3Config(**fields)


#: the attention kinds a drafter layer can have (transformers ``Qwen3Config.layer_types``; the reference
#: ``Qwen3DFlashAttention`` windows ``sliding_attention`` layers and nothing else)
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(cfg: dict, n_layers: int, source: str, notes: list[str]) -> list[str]:
    """The drafter's per-layer attention kinds: an explicit ``layer_types``, else :func:`implied_layer_types`.

    An explicit ``layer_types`` decides alone, as in transformers' ``Qwen3Config`` (``max_window_layers``
    derives the types only when ``layer_types`` is absent), so ``max_window_layers`` is then ignored, whatever it
    holds: published configs keep it at the layer count as a leftover (SpecForge ``configs/qwen3-32b-dflash.json``:
    ``max_window_layers: 10`` beside ten ``full_attention`` layers), and a sliding-first layout such as 4 sliding
    + 1 full cannot be expressed by it (it makes layers ``>= max_window_layers`` slide).

    Raises:
        InputError: ``layer_types`` that is not a list of ``n_layers`` entries of :data:`LAYER_TYPES`
            (field ``layer_types``), or a malformed ``max_window_layers`` where it is read.
    """
    given = cfg.get("layer_types")
    if given is None:
        return implied_layer_types(cfg, n_layers, source, notes)
    if not isinstance(given, list) or len(given) != n_layers or any(t not in LAYER_TYPES for t in given):
        bad = [t for t in given if t not in LAYER_TYPES] if isinstance(given, list) else given
        raise InputError(
            source, "layer_types",
            f"expected a list of num_hidden_layers={n_layers} entries of {'/'.join(LAYER_TYPES)}, got "
            f"{given!r}" + (f" ({len(given)} entries)" if isinstance(given, list) else "")
            + (f"; unknown: {bad}" if isinstance(given, list) and bad else ""),
            "fix layer_types or num_hidden_layers as the training run saved them",
        )
    return list(given)


def implied_layer_types(cfg: dict, n_layers: int, source: str, notes: list[str]) -> list[str]:
    """The ``layer_types`` of a config that gives none, as transformers ``Qwen3Config`` derives them (what the
    z-lab reference's ``from_pretrained`` builds): with ``use_sliding_window: true``, layers from
    ``max_window_layers`` (default 28) on use the ``sliding_window`` (default 4096); else all full attention.
    Noted when any layer slides: the reference windows such a config, and reading it as full attention would
    evaluate another drafter.

    Raises:
        InputError: ``max_window_layers`` that is not a non-negative integer.
    """
    if cfg.get("use_sliding_window") is not True or cfg.get("sliding_window", QWEN3_SLIDING_WINDOW) is None:
        return ["full_attention"] * n_layers
    first = cfg.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise InputError(source, "max_window_layers", f"must be a non-negative integer, got {first!r}",
                         "fix max_window_layers (or give layer_types)")
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if "sliding_attention" in types:
        notes.append(f"layer_types not given: {types} from use_sliding_window, max_window_layers {first} and "
                     f"sliding_window {cfg.get('sliding_window', QWEN3_SLIDING_WINDOW)}, as transformers Qwen3Config "
                     "derives them (the reference's drafter)")
    return types


#: float fields that must be positive where set (a zero or negative one breaks the norm, RoPE, the softcap or
#: turns the embedding / logits scale to nothing or upside down)
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "final_logit_softcapping", "input_embedding_scale",
                   "output_multiplier")


def check_finite_numbers(cfg: dict, source: str) -> None:
    """Refuse a NaN or infinite number anywhere in a drafter config (Python's ``json`` reads ``NaN`` and
    ``Infinity``), and a :data:`POSITIVE_FLOATS` field that is not positive, naming the field: such a config
    builds a drafter whose every draft is rejected (``rms_norm_eps: NaN`` gives tau 1.0 and exit 0, like NaN
    weights, which are refused where loaded).

    Raises:
        InputError: ``(source, field path, ...)``.
    """
    where = non_finite_entry(cfg)
    if where:
        raise InputError(source, where, "not a finite number (NaN or infinity): no trained drafter has one",
                         "restore the value the training run saved (or give it with strip --override / the "
                         "checkpoint entry's overrides)")
    for copy_ in (cfg, cfg.get("dflash_config") or {}, cfg.get("rope_parameters") or {}):
        for name in POSITIVE_FLOATS:
            v = copy_.get(name) if isinstance(copy_, dict) else None
            if v is None or (name == "final_logit_softcapping" and v == 0):  # unset; a softcap of 0: none
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InputError(source, name, f"must be a positive number, got {v!r}", f"restore the trained {name}")
