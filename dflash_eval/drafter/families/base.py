"""The drafter family interface (:class:`DrafterFamily`) and the draft-policy names it answers with; torch-free.

The registry and the families: :mod:`dflash_eval.drafter.families`; adding a family: docs/drafter-families.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_eval.core.errors import InputError

if TYPE_CHECKING:  # torch-free at import: the tensors are annotations only
    import torch

#: the ``dflash_config`` fields every family reads (older checkpoints keep them at the top level; reference
#: ``dflash==0.1.0`` ``dflash/model.py`` ``_draft_value``): :mod:`dflash_eval.drafter.config` reads them
SHARED_FIELDS = ("target_layer_ids", "block_size", "mask_token_id", "final_logit_softcapping",
                 "input_embedding_scale", "output_multiplier")


@dataclass
class Selection:
    """The drafts of a block's slots (``DFlashDrafter.propose`` / ``select``, the proposal path of a family); ``N``
    blocks, ``S`` drafted slots.

    Attributes:
        path: ``[N, S]`` int64, the drafted token per slot (slot ``j`` drafts position ``start + j``).
        candidates: ``[N, S, K]`` int64, a candidate walk (DFlash 2, LiLiCorr): the top-K logit candidates per
            slot, descending logit; None for DFlash 1.
        scores: ``[N, S, K]`` float32, a candidate walk: each candidate's score given the predecessor used at
            that slot (DFlash 2: the selector's score; LiLiCorr: the head's log-potential row); None for DFlash 1.
        probs: ``[N, S, K]`` float32, a candidate walk at temperature > 0: ``softmax(scores / T)``, the
            distribution the slot's draft was sampled from; None otherwise.
    """

    path: torch.Tensor
    candidates: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    probs: torch.Tensor | None = None


@dataclass
class WalkContext:
    """What a candidate walk may read beyond the slots' states and logits, for ``N`` blocks; the replay (all-anchor
    pass, sequential chain, online loop) builds it where the family's :attr:`DrafterFamily.walk_reads_context`.

    Attributes:
        embed_weight: ``[V, H]`` the target's input embeddings (``embed_tokens``, no ``input_embedding_scale``).
        anchor_hidden: ``[N, K*H]`` the target's concatenated states (the drafter's ``target_layer_ids``) at the
            position before each block's anchor token (``start - 1``: the last accepted target row of a verify
            step); zeros where ``start`` is 0.
        anchor_valid: ``[N]`` bool, False where ``start`` is 0 (no such row).
    """

    embed_weight: torch.Tensor
    anchor_hidden: torch.Tensor
    anchor_valid: torch.Tensor

    def rows(self, index) -> WalkContext:
        """The context of the blocks ``index`` (a slice, int64 indices or a bool mask)."""
        return WalkContext(self.embed_weight, self.anchor_hidden[index], self.anchor_valid[index])


# ----------------------------------------------------------------------------- draft policies at T > 0

#: the draft policies at temperature > 0 (their maths and sources: :mod:`dflash_eval.replay.policies`, whose
#: constants these equal; kept here too so that the family answers without importing torch)
REFERENCE, ARGMAX, PROBABILISTIC = "reference", "argmax", "probabilistic"
DRAFT_POLICIES = (REFERENCE, ARGMAX, PROBABILISTIC)
#: the engine settings named in ``tau.csv``'s ``engine`` column (vLLM 0.32.0 ``vllm/config/speculative.py``
#: ``draft_sample_method``; the reference ``dflash==0.1.0`` ``dflash/model.py`` ``dflash_generate``)
REFERENCE_ENGINE = "dflash 0.1.0 dflash_generate"
VLLM_ANY = "vLLM (any draft_sample_method)"
VLLM_GREEDY = "vLLM draft_sample_method=greedy (the default)"
VLLM_PROBABILISTIC = "vLLM draft_sample_method=probabilistic"


def _resolve(ref: str):
    """The function ``"module:function"`` names (:attr:`DrafterFamily.loader`, :attr:`DrafterFamily.stripper`)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _filters(setting) -> bool:
    """Whether a sampling setting (``top_p`` < 1 or ``top_k`` > 0) filters the distribution beyond its temperature."""
    return setting.top_p < 1 or bool(setting.top_k)


class DrafterFamily:
    """What the package asks about one kind of drafter; one subclass instance per family in :data:`FAMILIES`.

    Class attributes (override in a family module):

    * ``name``: the family's name: the ``variant`` of ``tau.csv``, of an evaluate output and of a ``demo``
      checkpoint entry (``checkpoints.demo[].variant``, ``dflash-eval train --variant``).
    * ``label``: its name in the report's tables and legends ("DFlash 1").
    * ``architecture``: its ``config.json`` ``architectures`` entry (vLLM and SGLang pick the model class by it).
    * ``speculators_model_type``: its ``speculators_model_type`` in a speculators checkpoint (None: not read).
    * ``config_fields``: the ``dflash_config`` fields only this family has, all required (no defaults; read from
      ``dflash_config`` or the top level, as the shared fields are); a config holding any of them is of this family
      (:meth:`claims`), unless its ``architectures`` names another family's :attr:`architecture`
      (:func:`~dflash_eval.drafter.families.family_of_config`: families may share field names).
    * ``model``: the dotted name of its nn.Module (documentation; built by :func:`dflash_eval.drafter.model.load_drafter`).
    * ``parts``: the optional parts of :class:`~dflash_eval.drafter.model.DFlashDrafter` its model has:
      ``"conv"`` (a grouped dynamic causal conv around each sublayer), ``"selector"`` (the candidate selector).
    * ``selects_candidates``: its proposal path. False: each drafted slot is the argmax of its own logits,
      independent of the other slots (the replay may stop at the first rejected slot; DDTree's per-slot top-k
      tree is defined). True: a walk over each slot's top-K logit candidates, slot by slot, by the nn.Module's
      ``select(hidden, logits, anchor_ids, temperature, predecessors, generator) -> Selection``
      (``path``, ``candidates``, ``scores``, ``probs``); the replay walks every slot and adds the candidate
      diagnostics (a perfect selector's tau, the unary chain, top-K recall and pick rate by slot), and at
      temperature > 0 drafts the walk's sampled path with q on its candidates.
    * ``walk_reads_context``: whether its candidate walk reads a :class:`WalkContext` (the target's embedding
      table and the target row before the anchor; ``select(..., context=...)``): the replay then builds one.
    * ``ddtree_applicable``: whether a serving engine builds a DDTree over its drafts (False: the DDTree columns
      are NaN and DDTree budgets are skipped).
    * ``probabilistic_is_reference``: whether vLLM's ``draft_sample_method=probabilistic`` drafts as the reference
      does at every setting (then the ``probabilistic`` policy is not a distinct expectation and is refused).
    * ``report_sections``: the report's family-specific sections (``"selector"``: the candidate diagnostics);
      ``report_note``: the note the report prints with them.
    * ``order``: its place in the report (runs, legends, the family comparison), lowest first.
    * ``loader``, ``stripper``: ``"module:function"`` of a family whose checkpoint holds more than a DFlash
      drafter (LiLiCorr: backbone + head), which loads (``(folder, device=, dtype=) -> module``) and strips
      (``(checkpoint, out_dir) -> out_dir``) it itself (:meth:`load`, :meth:`strip`); None: the DFlash path.
      Named, not imported: the registry stays torch-free and below the modules that build drafters.
    """

    name: str = ""
    label: str = ""
    architecture: str = ""
    speculators_model_type: str | None = None
    config_fields: tuple[str, ...] = ()
    model: str = "dflash_eval.drafter.model.DFlashDrafter"
    parts: tuple[str, ...] = ()
    selects_candidates: bool = False
    walk_reads_context: bool = False
    ddtree_applicable: bool = True
    probabilistic_is_reference: bool = False
    report_sections: tuple[str, ...] = ()
    report_note: str | None = None
    order: int = 0
    loader: str | None = None
    stripper: str | None = None

    def __repr__(self) -> str:
        return f"<drafter family {self.name}>"

    # ------------------------------------------------------------------ config

    def claims(self, cfg: dict, dcfg: dict) -> bool:
        """Whether a drafter ``config.json`` (``cfg``; ``dcfg`` its ``dflash_config``) is of this family: one of its
        :attr:`config_fields` is set, or ``architectures`` names :attr:`architecture`. The base family claims
        what no other family does (:func:`family_of_config`)."""
        archs = cfg.get("architectures") or []
        return any(k in dcfg or k in cfg for k in self.config_fields) or (
            bool(self.config_fields) and self.architecture in archs)

    def read_fields(self, cfg: dict, dcfg: dict, source: str, sizes: dict, notes: list[str]) -> dict:
        """This family's :attr:`config_fields`, validated: ``{field: value}`` (``{}`` when it has none).

        Args:
            cfg, dcfg: the config and its ``dflash_config`` (read only).
            source: the file named in errors.
            sizes: the shared fields already read: ``hidden_size``, ``vocab_size``, ``block_size`` (ints).
            notes: appended to (recorded in ``strip_info.json``).

        Raises:
            InputError: a field missing or malformed, naming ``source``, the field and the fix.
        """
        return {}

    def strip_config(self, config_out: dict, fields: dict) -> None:
        """What ``strip_drafter`` writes for this family into the stripped ``config.json`` ``config_out`` (in
        place; its ``dflash_config`` already holds the shared fields): the family's fields where the engines read
        them, and :attr:`architecture` where ``architectures`` is unset."""
        config_out.setdefault("architectures", [self.architecture])

    def demo_fields(self, hidden_size: int, vocab_size: int, given: dict | None = None) -> dict:
        """The family's fields of a drafter built by ``dflash-eval train`` or the random-init demo checkpoint
        (:func:`dflash_eval.drafter.demo.drafter_config_for_target`) for a target of that hidden size and
        vocabulary: the family's defaults, with the non-None values of ``given`` (the trainer's flags) over them;
        {} for a family without fields."""
        return {}

    def speculators_fields(self, cfg: dict) -> dict:
        """The ``dflash_config`` entries of a speculators (flat) ``config.json`` for this family's fields."""
        return {k: cfg[k] for k in self.config_fields if cfg.get(k) is not None}

    # ------------------------------------------------------------------ loading

    def load(self, folder, device, dtype):
        """The drafter module of a stripped folder of this family, by :attr:`loader` (called with ``folder``,
        ``device=``, ``dtype=``), or None where the DFlash loader (:func:`dflash_eval.drafter.model.load_drafter`:
        :class:`~dflash_eval.drafter.model.DFlashDrafter` and its exact key check) builds it."""
        return None if self.loader is None else _resolve(self.loader)(folder, device=device, dtype=dtype)

    def strip(self, checkpoint, out_dir):
        """Strip ``checkpoint`` to ``out_dir`` in the engines' layout by :attr:`stripper` and return ``out_dir``, or
        None where ``strip_drafter``'s DFlash path strips it."""
        return None if self.stripper is None else _resolve(self.stripper)(checkpoint, out_dir)

    # ------------------------------------------------------------------ draft policies at T > 0

    def draft_policies(self, setting) -> list[str]:
        """The draft policies that give distinct expectations at a sampling setting (``setting``: a
        :class:`dflash_eval.replay.sampling.SamplingSetting`, or anything with ``greedy``, ``top_p``, ``top_k``);
        the default of ``evaluate.sampling[].draft``.

        Temperature 0: ``[reference]`` (every policy drafts the argmax). Otherwise reference and argmax, plus
        probabilistic when it differs from the reference: the setting filters (top-p < 1 or top-k > 0; at plain
        temperature vLLM's probabilistic q is the reference's) and not :attr:`probabilistic_is_reference`."""
        if setting.greedy:
            return [REFERENCE]
        if self.probabilistic_is_reference or not _filters(setting):
            return [REFERENCE, ARGMAX]
        return [REFERENCE, ARGMAX, PROBABILISTIC]

    def check_policy(self, setting, policy: str, where=None, field: str = "evaluate.sampling") -> None:
        """Raise :class:`InputError` unless ``policy`` is one of :data:`DRAFT_POLICIES` that applies (an explicit
        ``probabilistic`` at plain temperature is accepted where it equals the reference, refused where
        :attr:`probabilistic_is_reference`)."""
        if policy not in DRAFT_POLICIES or (self.probabilistic_is_reference and policy == PROBABILISTIC):
            filtered = type("Filtered", (), {"greedy": False, "top_p": 0.5, "top_k": 0})()
            raise InputError(where, f"{field}.draft", f"draft policy {policy!r} does not apply to a {self.name} drafter",
                             f"use one of {self.draft_policies(filtered)}")

    def engine_settings(self, setting, policy: str) -> list[str]:
        """The serving configurations whose drafts follow ``policy`` at ``setting``, as read in their source.

        vLLM 0.32.0 (``vllm/config/speculative.py`` ``draft_sample_method``; ``vllm/v1/sample/rejection_sampler.py``
        ``rejection_random_sample_kernel``, where ``NO_DRAFT_PROBS`` sets q = 1 at the draft):
        ``greedy`` = argmax; ``probabilistic`` = the probabilistic policy where the setting filters and the family
        samples its logits (not :attr:`probabilistic_is_reference`), the reference otherwise."""
        if setting.greedy:
            return [REFERENCE_ENGINE, VLLM_ANY]
        if policy == ARGMAX:
            return [VLLM_GREEDY]
        if policy == PROBABILISTIC:
            return [VLLM_PROBABILISTIC]
        return [REFERENCE_ENGINE] + ([VLLM_PROBABILISTIC] if self.probabilistic_is_reference or not _filters(setting)
                                     else [])

    def vllm_draft_sample_method(self, setting, policy: str) -> str | None:
        """vLLM's ``draft_sample_method`` that drafts as ``policy`` at ``setting`` (:meth:`engine_settings`), or None
        where no vLLM setting does (the reference's filtered q with top-p / top-k)."""
        if policy == ARGMAX or setting.greedy:
            return "greedy"
        if policy == PROBABILISTIC or self.probabilistic_is_reference or not _filters(setting):
            return "probabilistic"
        return None

    # ------------------------------------------------------------------ tau table and report

    def table_columns(self, max_block_size: int) -> list[str]:
        """The family's extra ``tau.csv`` columns (after the ``variant`` columns), in a table of block size up to
        ``max_block_size`` holding one of its rows; [] for none."""
        return []

    def table_values(self, result: dict) -> dict[str, Any]:
        """The values of :meth:`table_columns` from one evaluate output (the JSON object); {} for none."""
        return {}
