"""DFlash 2: DFlash 1 plus grouped dynamic causal convs and a candidate selector (reference ``dflash==0.1.0``
``dflash/model.py`` ``DFlash2DraftModel``, ``GroupedDynamicCausalConv``, ``CandidateSelector``; blog
inco.ai/blog/dflash2; speculators PR #1006 ``src/speculators/models/dflash2/``; vLLM 0.32.0 ``qwen3_dflash2``).

Its nn.Module: :class:`dflash_eval.drafter.model.DFlashDrafter` with the convs (``DecoderLayer.attention_conv`` /
``mlp_conv``) and :class:`~dflash_eval.drafter.model.CandidateSelector` (``DFlashDrafter.select``): the drafts are
the selector's walk over each slot's top-``selector_top_k`` logit candidates, each slot scored after the pick
before it. So the replay walks every slot and reports the candidate diagnostics (tau.csv's selector columns, the
report's selector section), no engine builds a DDTree over the walk (docs/design.md, "DDTree is not applicable to
DFlash 2"), and vLLM's ``probabilistic`` DFlash 2 walk (``vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py``
``_selector_walk_kernel``) samples the selector's path at the temperature on its candidates: the reference's q.
"""

from __future__ import annotations

import math

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.families.base import SHARED_FIELDS, DrafterFamily
from dflash_eval.replay.metrics import aggregate

#: the DFlash 2 fields, all four required (the reference ``DFlash2DraftModel`` and vLLM's ``qwen3_dflash2`` read
#: every one): conv taps, channels per conv group, rank of the selector's bilinear term, candidates per slot
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: the fields of a random-init demo drafter and the trainer's defaults: the published z-lab DFlash 2 drafter's taps
#: and group size (docs/checkpoint-formats.md), rank and top-K capped by the target's width / vocabulary
DEMO_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
#: the candidate diagnostics of tau.csv, then :func:`slot_columns`
COLUMNS = ["tau_oracle", "tau_unary", "sel_accepted", "sel_oracle_accepted", "sel_pick_rate", "sel_oracle_path_rate"]
#: the report's note on its selector section
NOTE = ("DFlash 2 drafters (variant `dflash2`) draft the candidate selector's path, at temperature 0: "
        "tau_unary is the per-slot argmax of the same logits (the selector switched off), tau_oracle a "
        "perfect selector over the same top-K candidates; recall@K is the mean over draft slots of "
        "P(slot k's target token is among its top-K candidates), pick rate the share of slots where the "
        "selector picked it, given the earlier picks were right and it was a candidate (pooled over "
        "slots), oracle path the share of verify steps where the selector accepted the whole oracle "
        "prefix. The figure shows both rates slot by slot (tau.csv: topk_recall_slot_k, "
        "pick_rate_slot_k). Sets evaluated only at temperature > 0 are left out: their selector columns "
        "are those of the greedy path on the sampled completions, the same in every draft-policy row. "
        "DDTree is not evaluated for DFlash 2 drafters: their DDTree columns in tau.csv are NaN and the "
        "DDTree tables leave them out, since no serving engine builds a tree over the selector's path "
        "(ddtree_applicable false).")


def slot_columns(max_block_size: int) -> list[str]:
    """``topk_recall_slot_1 .. _<B-1>`` then ``pick_rate_slot_1 .. _<B-1>`` (the selector diagnostics by slot)."""
    return [f"{kind}_slot_{k}" for kind in ("topk_recall", "pick_rate") for k in range(1, max_block_size)]


def _nan(x) -> float:
    return math.nan if x is None else float(x)


class DFlash2(DrafterFamily):
    """DFlash 2 (module docstring)."""

    name = "dflash2"
    label = "DFlash 2"
    architecture = "DFlash2DraftModel"
    speculators_model_type = "dflash2"  # speculators PR #1006 models/dflash2/config.py
    config_fields = FIELDS
    parts = ("conv", "selector")
    selects_candidates = True
    ddtree_applicable = False
    probabilistic_is_reference = True
    report_sections = ("selector",)
    report_note = NOTE
    order = 2

    def read_fields(self, cfg: dict, dcfg: dict, source: str, sizes: dict, notes: list[str]) -> dict:
        """The four :data:`FIELDS`, validated (see :meth:`DrafterFamily.read_fields`). ``conv_group_size`` must
        divide ``hidden_size`` (the conv's groups) and ``selector_top_k`` be at most ``vocab_size``;
        ``architectures`` naming ``DFlash2DraftModel`` without the fields is refused; the fields under another
        architecture are noted (the stripped config names ``DFlash2DraftModel``, which vLLM and SGLang dispatch on).

        Raises:
            InputError: a partial set (naming the missing fields), a value that is not a positive integer, a group
                size not dividing the hidden size, top-K above the vocabulary, or the architecture without the fields.
        """
        present = {k: (dcfg[k] if k in dcfg else cfg[k]) for k in FIELDS if k in dcfg or k in cfg}
        archs = cfg.get("architectures") or []
        if not present:
            raise InputError(source, "dflash_config.conv_kernel_size",
                             f"architectures names {self.architecture} but none of {list(FIELDS)} "
                             "is set (the conv and the selector cannot be built)",
                             "add the DFlash 2 fields to dflash_config (as the training run saved them)")
        missing = [k for k in FIELDS if k not in present]
        if missing:
            raise InputError(source, f"dflash_config.{missing[0]}",
                             f"a DFlash 2 config needs all of {list(FIELDS)}; {missing} missing "
                             f"(present: {present})",
                             "add the missing fields to dflash_config as the training run saved them "
                             "(reference dflash==0.1.0 DFlash2DraftModel reads all four)")
        for k, v in present.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(source, f"dflash_config.{k}", f"must be a positive integer, got {v!r}", f"fix {k}")
        if sizes["hidden_size"] % present["conv_group_size"]:
            raise InputError(source, "dflash_config.conv_group_size",
                             f"{present['conv_group_size']} does not divide hidden_size {sizes['hidden_size']} "
                             "(channels per conv group)", "fix conv_group_size or hidden_size")
        if present["selector_top_k"] > sizes["vocab_size"]:
            raise InputError(source, "dflash_config.selector_top_k",
                             f"{present['selector_top_k']} candidates per slot exceed vocab_size {sizes['vocab_size']}",
                             "fix selector_top_k")
        if present["conv_kernel_size"] > sizes["block_size"]:
            notes.append(f"conv_kernel_size {present['conv_kernel_size']} > block_size {sizes['block_size']}: taps "
                         "past the block start read zeros (SpecForge and speculators refuse to train this)")
        if archs and self.architecture not in archs:
            notes.append(f"architectures {archs} with the DFlash 2 fields: read as {self.architecture} "
                         "(the stripped config.json names it)")
        return dict(present)

    def strip_config(self, config_out: dict, fields: dict) -> None:
        """vLLM's ``qwen3_dflash2`` reads the DFlash 2 fields and the shared ones from ``dflash_config`` only: all
        are written there (a top-level shared field copied in); ``architectures`` is set to ``DFlash2DraftModel``,
        the name vLLM and SGLang pick the DFlash 2 model class by."""
        dcfg = config_out["dflash_config"]
        dcfg.update({k: fields[k] for k in FIELDS})
        dcfg.update({k: config_out[k] for k in SHARED_FIELDS if k in config_out and k not in dcfg})
        config_out["architectures"] = [self.architecture]

    def demo_fields(self, hidden_size: int, vocab_size: int, given: dict | None = None) -> dict:
        """:data:`DEMO_FIELDS` (group size 1 when 16 does not divide the hidden size), the non-None ``given`` values
        over them, then rank capped at the hidden size and top-K at the vocabulary."""
        f = dict(DEMO_FIELDS)
        f["conv_group_size"] = f["conv_group_size"] if hidden_size % f["conv_group_size"] == 0 else 1
        f.update({k: int(v) for k, v in (given or {}).items() if k in FIELDS and v})
        f["selector_rank"] = min(f["selector_rank"], hidden_size)
        f["selector_top_k"] = min(f["selector_top_k"], vocab_size)
        return f

    def table_columns(self, max_block_size: int) -> list[str]:
        """:data:`COLUMNS` then :func:`slot_columns`."""
        return COLUMNS + slot_columns(max_block_size)

    def table_values(self, result: dict) -> dict:
        """The selector columns of one evaluate output: its per-sample oracle / unary chains aggregated (tau as the
        ``tau`` column), its ``selector`` aggregate; {} for an output without ``selector``."""
        if "selector" not in result:
            return {}
        B, sel = result["block_size"], result["selector"]
        out = {"tau_oracle": aggregate([s["acceptance_lengths_oracle"] for s in result["samples"]], B).tau,
               "tau_unary": aggregate([s["acceptance_lengths_unary"] for s in result["samples"]], B).tau,
               "sel_accepted": _nan(sel["accepted"]), "sel_oracle_accepted": _nan(sel["oracle_accepted"]),
               "sel_pick_rate": _nan(sel["pick_rate_all"]), "sel_oracle_path_rate": _nan(sel["oracle_path_rate"])}
        for k, v in sel["topk_recall"].items():
            out[f"topk_recall_slot_{k}"] = _nan(v)
        for k, v in sel["pick_rate"].items():
            out[f"pick_rate_slot_{k}"] = _nan(v)
        return out
