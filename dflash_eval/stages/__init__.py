"""The pipeline's stages: one module per Snakemake rule, named as the rule (``evaluate`` -> ``evaluate.py``).

Each loads and checks its inputs, calls the algorithm and format modules of the package, and
writes its outputs atomically. Each defines ``add_arguments(parser)`` (files, non-config switches)
and ``main(args, opts)``; a stage with config options names them by ``STAGE`` in
:data:`dflash_eval.core.options.STAGE_OPTIONS` (:mod:`dflash_eval.cli` builds the flags).
"""
