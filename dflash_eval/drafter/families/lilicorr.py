"""LiLiCorr, the third drafter family: a DFlash backbone whose drafts are a path through its top-k candidate lattice.

LiLiCorr (NVIDIA, arXiv 2608.20530; training ``NVIDIA/Model-Optimizer`` PR #2342, ``modelopt/torch/speculative/
plugins/{hf,modeling}_lilicorr.py`` at commits eea939b0 / 33d8c76d; serving SGLang PR #37462
``python/sglang/srt/models/lilicorr.py``, ``python/sglang/srt/speculative/lilicorr_utils.py``,
``python/sglang/kernels/ops/speculative/lilicorr.py`` (commits 085551a8, 090be2bf, 56a1572f); vLLM PR #57934
``vllm/v1/worker/gpu/spec_decode/lilicorr/speculator.py`` ``LiLiCorrSpeculator`` (commit 5b3da7fe) with
``dflash2/speculator.py`` ``_selector_walk_kernel`` (commit 0e1a7cca); TensorRT-LLM
``tensorrt_llm/_torch/models/modeling_lilicorr.py`` (commit 8d62b3e5)).

This module is torch-free (the family interface's rule): the family object (:class:`LiLiCorr`) and the strict
geometry reader (:class:`LiLiCorrConfig`). The head (nn.Module) is :mod:`dflash_eval.drafter.lilicorr_model`; the
checkpoint layout, the path walks and the block diagnostics are :mod:`dflash_eval.drafter.lilicorr_drafter`.

**Checkpoint layout** (Model-Optimizer's export, what the three engines load): a DFlash drafter folder
(``config.json`` + ``model.safetensors``) whose ``architectures`` is ``["LiLiCorrDraftModel"]`` (the engines
route on it), whose ``dflash_config`` carries :data:`GEOMETRY_FIELDS` as ``lilicorr_<field>`` (plus
``projector_type: "lilicorr"`` and ``lilicorr_enabled: true``), and whose weights are the backbone's under
their DFlash names plus the head's under ``lilicorr.``. The backbone may carry DFlash 2's grouped convs
(``conv_kernel_size``, ``conv_group_size``) but no candidate selector.

**Geometry without defaults** (:class:`LiLiCorrConfig`): every engine and the trainer refuse a missing field;
``logit_scale`` and ``vector_eps`` change no tensor shape, so a wrong one loads cleanly and scores another
function. ``hidden_size`` 0 means the drafter's width (SGLang ``resolve_hidden_size``, vLLM; TensorRT-LLM
refuses 0).

**The path**: ``c_1 = argmax start``, ``c_j = argmax_c pair[j - 1][c_{j-1}, c]``, left to right, ties to the
lower rank -- locally optimal, not Viterbi (SGLang ``lilicorr_greedy_path``; Model-Optimizer's docstring: under
prefix acceptance, trading an early slot for a better tail is self-defeating). At T > 0 the engines sample the
same walk, slot j from ``softmax(row_j / T)`` with ``row_j`` the log-potentials out of the sampled predecessor and
no log-prob prior: SGLang (``lilicorr_sample_path``, only with ``SGLANG_ENABLE_LILICORR_SAMPLING``; otherwise it
commits the greedy path at every temperature) by inverse CDF from one uniform per slot (its newest kernels file,
0b79ccf2, also applies the request's draft top-k / top-p to the K candidates); vLLM with ``_selector_walk_kernel``,
a Gumbel-max draw keyed by seed, position and candidate id (same distribution, other draws). Both verify with that
q. The family's ``reference`` policy is this sampled walk at the temperature only (vLLM
``draft_sample_method=probabilistic``, SGLang with sampling enabled), ``argmax`` the greedy walk with one-hot q
(vLLM ``greedy``, SGLang's default); there is no ``dflash`` reference implementation of LiLiCorr.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.families.base import (
    ARGMAX,
    VLLM_ANY,
    VLLM_GREEDY,
    VLLM_PROBABILISTIC,
    DrafterFamily,
)
from dflash_eval.drafter.families.dflash2 import DFlash2

#: ``config.json`` ``architectures`` of a LiLiCorr drafter (SGLang, vLLM and TensorRT-LLM route on it)
ARCHITECTURE = "LiLiCorrDraftModel"
#: the head's geometry, each read from ``dflash_config.lilicorr_<field>`` with no default: ``(field, kind, low)``
#: (``int`` >= low, or ``float`` > low)
GEOMETRY_FIELDS = (("candidate_topk", int, 1), ("hidden_size", int, 0), ("num_layers", int, 1), ("num_heads", int, 1),
                   ("mlp_ratio", float, 0.0), ("factor_dim", int, 1), ("vector_eps", float, 0.0),
                   ("logit_scale", float, 0.0))
#: widest head SGLang's and vLLM's fused walk serve (a power of two; ``lilicorr_utils.py``
#: ``MAX_FUSED_CANDIDATE_TOPK``, vLLM ``LiLiCorrHead``)
ENGINE_MAX_TOPK = 16
#: SGLang's LiLiCorr commits (``python/sglang/srt/speculative/lilicorr_utils.py`` ``resolve_sampling_enabled``)
SGLANG_GREEDY = "SGLang LiLiCorr, SGLANG_ENABLE_LILICORR_SAMPLING unset (the default: the greedy commit)"
SGLANG_SAMPLED = "SGLang LiLiCorr, SGLANG_ENABLE_LILICORR_SAMPLING=1"
#: the report's note on a LiLiCorr drafter's rows of the selector section
NOTE = ("LiLiCorr drafters (variant `lilicorr`) draft the head's path through each slot's top-K candidate lattice; "
        "at temperature 0 tau_unary is the backbone's own chain (each slot's argmax, the head switched off), "
        "tau_oracle a perfect path over the same top-K candidates, pick rate the share of slots where the head "
        "picked the target's token given the earlier picks were right and it was a candidate. DDTree is not "
        "evaluated (no engine builds a tree over the head's path).")
RESTORE_FIX = "restore the value the training run saved (Model-Optimizer exports every lilicorr_* field)"


@dataclass(frozen=True)
class LiLiCorrConfig:
    """The head's geometry (:data:`GEOMETRY_FIELDS`), read strictly by :meth:`from_dict`; ``notes`` for the log."""

    candidate_topk: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_ratio: float
    factor_dim: int
    vector_eps: float
    logit_scale: float
    notes: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json", model_hidden: int | None = None) -> LiLiCorrConfig:
        """Read ``cfg["dflash_config"]["lilicorr_*"]`` (where the engines read them) with no default.

        Args:
            cfg: a drafter ``config.json`` object. source: named in errors.
            model_hidden: the drafter's ``hidden_size`` (checks that ``num_heads`` divides the head width).

        Raises:
            InputError: naming ``dflash_config.lilicorr_<field>``: missing, not a number of its kind (a bool, a
                string, a float where an integer is needed), not finite, below its bound, ``vector_eps`` not in
                (0, 0.5) (Model-Optimizer and TensorRT-LLM refuse it), ``num_heads`` not dividing the head width,
                or ``lilicorr_enabled: false``.
        """
        dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
        if "lilicorr_enabled" in dcfg and dcfg["lilicorr_enabled"] is not True:
            raise InputError(source, "dflash_config.lilicorr_enabled", f"{dcfg['lilicorr_enabled']!r} for a LiLiCorr "
                             "drafter (SGLang then builds no head)", "set it to true, or drop the lilicorr_* fields "
                             "and the LiLiCorrDraftModel architecture to evaluate the backbone alone")
        values, notes = {}, []
        for name, kind, low in GEOMETRY_FIELDS:
            key = f"dflash_config.lilicorr_{name}"
            if f"lilicorr_{name}" not in dcfg:
                elsewhere = " (it is at the top level; the engines read dflash_config)" if f"lilicorr_{name}" in cfg else ""
                raise InputError(source, key, "missing: a LiLiCorr head has no default geometry" + elsewhere,
                                 f"add dflash_config.lilicorr_{name} with the value the training run saved (Model-Optimizer "
                                 "exports every lilicorr_* field)")
            v = dcfg[f"lilicorr_{name}"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
                raise InputError(source, key, f"must be {'an integer' if kind is int else 'a number'}, got {v!r}",
                                 RESTORE_FIX)
            if not math.isfinite(v):
                raise InputError(source, key, f"not a finite number ({v!r})", RESTORE_FIX)
            if (kind is int and v < low) or (kind is float and not v > low):
                raise InputError(source, key, f"must be {'>=' if kind is int else '>'} {low}, got {v!r}", RESTORE_FIX)
            values[name] = kind(v)
        if not values["vector_eps"] < 0.5:
            raise InputError(source, "dflash_config.lilicorr_vector_eps", f"must be in (0, 0.5), got "
                             f"{values['vector_eps']!r} (Model-Optimizer and TensorRT-LLM refuse it)", RESTORE_FIX)
        width = values["hidden_size"] or model_hidden
        if width and width % values["num_heads"]:
            raise InputError(source, "dflash_config.lilicorr_num_heads", f"{values['num_heads']} does not divide the "
                             f"head width {width}", RESTORE_FIX)
        k = values["candidate_topk"]
        if k & (k - 1) or k > ENGINE_MAX_TOPK:
            notes.append(f"lilicorr_candidate_topk {k}: SGLang and vLLM serve only a power of two <= {ENGINE_MAX_TOPK}")
        if values["hidden_size"] == 0:
            notes.append("lilicorr_hidden_size 0 (the drafter's width): TensorRT-LLM refuses 0")
        return cls(**values, notes=tuple(notes))

    def to_dflash_config(self) -> dict:
        """The ``dflash_config`` entries Model-Optimizer's export writes for this head."""
        out = {f"lilicorr_{name}": getattr(self, name) for name, _, _ in GEOMETRY_FIELDS}
        return {"projector_type": "lilicorr", "lilicorr_enabled": True, **out}


def is_lilicorr(cfg: dict) -> bool:
    """Whether a drafter ``config.json`` object is a LiLiCorr drafter: ``architectures`` names
    :data:`ARCHITECTURE` or ``dflash_config`` holds a ``lilicorr_*`` field."""
    dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    return ARCHITECTURE in (cfg.get("architectures") or []) or any(str(k).startswith("lilicorr_") for k in dcfg)


#: DFlash 2's conv fields (a LiLiCorr backbone may carry them) and its selector fields (a LiLiCorr drafter has none)
CONV_FIELDS, SELECTOR_FIELDS = ("conv_kernel_size", "conv_group_size"), ("selector_rank", "selector_top_k")


def backbone_dict(cfg: dict) -> dict:
    """The DFlash backbone's config dict of a LiLiCorr ``config.json`` (a copy): the ``lilicorr_*`` fields,
    ``projector_type`` and :data:`ARCHITECTURE` dropped. A backbone with DFlash 2's convs and no selector
    (Model-Optimizer ``_install_sublayer_convs``) gets placeholder selector fields (``selector_rank`` 1,
    ``selector_top_k`` = ``candidate_topk``) so that the DFlash 2 backbone with its convs is built;
    :func:`without_selector` then removes the selector."""
    raw = copy.deepcopy(cfg)
    dcfg = raw.setdefault("dflash_config", {})
    k = dcfg.get("lilicorr_candidate_topk", 1)
    for key in [key for key in dcfg if str(key).startswith("lilicorr_")] + ["projector_type"]:
        dcfg.pop(key, None)
    raw["architectures"] = [a for a in raw.get("architectures") or [] if a != ARCHITECTURE]
    has = [f for f in CONV_FIELDS + SELECTOR_FIELDS if f in dcfg or f in raw]
    if set(CONV_FIELDS) & set(has) and not set(SELECTOR_FIELDS) & set(has):
        dcfg.update(dict(zip(SELECTOR_FIELDS, (1, k if isinstance(k, int) and not isinstance(k, bool) and k > 0
                                                 else 1))))
    return raw


def without_selector(model):
    """``model`` (a :class:`~dflash_eval.drafter.model.DFlashDrafter`) with its candidate selector removed, in place:
    LiLiCorr drafts from the backbone's unary logits, and its checkpoint holds no selector."""
    model.candidate_selector = None
    return model


def export_config(backbone_cfg: dict, geometry: LiLiCorrConfig) -> dict:
    """The ``config.json`` of a LiLiCorr drafter from its backbone's config dict: :data:`ARCHITECTURE`, the geometry in
    ``dflash_config`` (:meth:`LiLiCorrConfig.to_dflash_config`), the DFlash 2 selector fields removed."""
    cfg = copy.deepcopy(backbone_cfg)
    dcfg = cfg.setdefault("dflash_config", {})
    for key in SELECTOR_FIELDS:
        dcfg.pop(key, None)
        cfg.pop(key, None)
    dcfg.update(geometry.to_dflash_config())
    cfg["architectures"] = [ARCHITECTURE]
    cfg.setdefault("model_type", "qwen3")
    return cfg



#: the family's own ``dflash_config`` fields (the geometry, ``lilicorr_<field>``)
CONFIG_FIELDS = tuple(f"lilicorr_{name}" for name, _, _ in GEOMETRY_FIELDS)


class LiLiCorr(DrafterFamily):
    """LiLiCorr (module docstring): drafts are the head's walk over each slot's top-K candidates, so, as DFlash 2,
    it selects candidates, no engine builds a DDTree over the walk, and vLLM's ``probabilistic`` walk is the
    reference's distribution. Its backbone may carry DFlash 2's convs (``parts`` lists none: they are optional)."""

    name = "lilicorr"
    label = "LiLiCorr"
    architecture = ARCHITECTURE
    config_fields = CONFIG_FIELDS
    model = "dflash_eval.drafter.lilicorr_model.LiLiCorrHead"
    selects_candidates = True
    ddtree_applicable = False
    probabilistic_is_reference = True
    walk_reads_context = True  # the head reads the candidates' target embeddings and the anchor row
    # backbone + head under lilicorr.*, keys checked both ways (SGLang check_head_weight_coverage); the target's
    # shared tensors are dropped without comparison (the stripper reads no target)
    loader = "dflash_eval.drafter.lilicorr_drafter:load_lilicorr"
    stripper = "dflash_eval.drafter.lilicorr_drafter:strip_lilicorr"
    report_sections = ("selector",)
    report_note = NOTE
    order = 3

    def table_columns(self, max_block_size: int) -> list[str]:
        """DFlash 2's candidate columns (:data:`dflash_eval.drafter.families.dflash2.COLUMNS`, the slot columns):
        ``tau_unary`` is the backbone's own chain, ``tau_oracle`` the oracle over the top-K lattice,
        ``sel_pick_rate`` how often the head picked the target's candidate."""
        return DFlash2.table_columns(self, max_block_size)

    def table_values(self, result: dict) -> dict:
        """As :meth:`DFlash2.table_values` (the evaluate output's ``selector`` block and per-sample chains)."""
        return DFlash2.table_values(self, result)

    def claims(self, cfg: dict, dcfg: dict) -> bool:
        """A ``lilicorr_*`` field anywhere in ``dflash_config`` or the top level, or ``architectures`` naming
        :data:`ARCHITECTURE` (:func:`is_lilicorr`)."""
        return is_lilicorr(cfg) or any(str(k).startswith("lilicorr_") for k in list(dcfg) + list(cfg))

    def read_fields(self, cfg: dict, dcfg: dict, source: str, sizes: dict, notes: list[str]) -> dict:
        """The geometry (:meth:`LiLiCorrConfig.from_dict`), as ``{"lilicorr_<field>": value}``; its notes appended.

        Raises:
            InputError: as :meth:`LiLiCorrConfig.from_dict`; ``candidate_topk`` above ``vocab_size``.
        """
        geometry = LiLiCorrConfig.from_dict({**cfg, "dflash_config": dcfg}, source, sizes.get("hidden_size"))
        if sizes.get("vocab_size") and geometry.candidate_topk > sizes["vocab_size"]:
            raise InputError(source, "dflash_config.lilicorr_candidate_topk", f"{geometry.candidate_topk} candidates "
                             f"per slot exceed vocab_size {sizes['vocab_size']}", RESTORE_FIX)
        notes.extend(geometry.notes)
        return {f"lilicorr_{name}": getattr(geometry, name) for name, _, _ in GEOMETRY_FIELDS}

    def strip_config(self, config_out: dict, fields: dict) -> None:
        """The geometry, ``projector_type`` and ``lilicorr_enabled`` in ``dflash_config`` (where SGLang, vLLM and
        TensorRT-LLM read them) and ``architectures`` = :data:`ARCHITECTURE` (what they route on)."""
        config_out["dflash_config"].update({"projector_type": "lilicorr", "lilicorr_enabled": True, **fields})
        config_out["architectures"] = [self.architecture]

    def engine_settings(self, setting, policy: str) -> list[str]:
        """The serving configurations whose drafts follow ``policy`` at ``setting`` (module docstring): T = 0 every
        engine; ``argmax``: vLLM ``greedy`` and SGLang's default; ``reference``: vLLM ``probabilistic`` and SGLang
        with sampling enabled (its newest kernels also filter the candidates by the setting's top-k / top-p)."""
        if setting.greedy:
            return [SGLANG_GREEDY, VLLM_ANY]
        if policy == ARGMAX:
            return [VLLM_GREEDY, SGLANG_GREEDY]
        filters = setting.top_p < 1 or bool(setting.top_k)
        return [VLLM_PROBABILISTIC, SGLANG_SAMPLED + (" (newer SGLang also applies top-k / top-p)" if filters else "")]
