"""dflash-eval: offline evaluation of DFlash drafter checkpoints (acceptance length tau per checkpoint).

Layout: one module per pipeline stage under :mod:`dflash_eval.stages`, named as its Snakemake rule
(``prompts -> completions -> hidden_states`` once per prompt set; ``strip_drafter -> evaluate`` per
checkpoint; ``summary``, ``report``, ``target_costs`` per run); below them the algorithms
(:mod:`~dflash_eval.replay.anchors`, :mod:`~dflash_eval.replay.chain`, :mod:`~dflash_eval.replay.ddtree`,
:mod:`~dflash_eval.replay.metrics`), the drafter model (:mod:`~dflash_eval.drafter.model`), the formats
(:mod:`~dflash_eval.cache.format`, :mod:`~dflash_eval.data.completions`, :mod:`~dflash_eval.drafter.checkpoints`)
and the options generated from the config schema (:mod:`~dflash_eval.core.options`).

Terms follow the DFlash paper (Chen, Liang & Liu, arXiv 2602.06036) and the
z-lab/dflash reference code: target, drafter, block size B, mask token,
``target_layer_ids``, verify step, bonus token, acceptance length tau.
"""

__version__ = "0.1.0"
