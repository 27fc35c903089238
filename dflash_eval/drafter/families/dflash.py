"""DFlash 1: the block-diffusion drafter of the paper (Chen, Liang, Liu, arXiv:2602.06036; reference ``z-lab/dflash``
``dflash==0.1.0`` ``dflash/model.py`` ``DFlashDraftModel``; speculators ``src/speculators/models/dflash/``).

Its nn.Module: :class:`dflash_eval.drafter.model.DFlashDrafter` with no family parts. Each drafted slot is the
argmax of its own logits (at temperature > 0 a sample of the setting's filtered q), so the replay may stop a block
at its first rejected slot and DDTree's per-slot top-k tree is defined. Its fields are the shared ones
(:data:`dflash_eval.drafter.families.base.SHARED_FIELDS`); it is the family of a config no other family claims.
"""

from __future__ import annotations

from dflash_eval.drafter.families.base import DrafterFamily


class DFlash(DrafterFamily):
    """DFlash 1 (module docstring): the base family's answers throughout."""

    name = "dflash"
    label = "DFlash 1"
    architecture = "DFlashDraftModel"
    speculators_model_type = "dflash"  # speculators models/dflash/config.py DFlashSpeculatorConfig
    order = 1
