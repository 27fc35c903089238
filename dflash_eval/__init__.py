"""dflash-eval: offline evaluation of DFlash drafter checkpoints.

Pipeline (one module per stage)::

    prompts -> completions -> cache (HDF5 hidden states) -> checkpoints (strip)
            -> replay (acceptance length tau) -> summary / report

Terms follow the DFlash paper (Chen, Liang & Liu, arXiv 2602.06036) and the
z-lab/dflash reference code: target, drafter, block size B, mask token,
``target_layer_ids``, verify step, bonus token, acceptance length tau.
"""

__version__ = "0.1.0"
