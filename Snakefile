# dflash-eval: evaluate DFlash drafter checkpoints (acceptance length tau).
#
#   prompts + target -> completions -> HDF5 hidden-state cache      (once per prompt set)
#   checkpoint -> stripped drafter -> evaluate(cache) -> tau tables  (per checkpoint)
#
# Run from the repository root: `snakemake --cores all [--configfile my.yaml]`.
# See README.md, docs/configuration.md, docs/outputs.md, docs/design.md (rerun semantics) and
# profiles/README.md.

from snakemake.utils import min_version

min_version("9.11")


configfile: "config/config.yaml"


# `snakemake --report report.html` (or report.zip): Snakemake's own report of a finished run.
report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/completions.smk"
include: "rules/cache.smk"
include: "rules/drafters.smk"
include: "rules/kernel_parity.smk"
include: "rules/engine_parity.smk"
include: "rules/fp8_parity.smk"
include: "rules/validate_online.smk"
include: "rules/validate_engine.smk"
include: "rules/costs.smk"
include: "rules/evaluate.smk"
include: "rules/trackers.smk"


rule all:
    default_target: True
    input:
        expand("results/{run}/tau.csv", run=RUN),
        expand("results/{run}/tau.parquet", run=RUN),
        expand("results/{run}/report.md", run=RUN),
        expand("results/{run}/report.html", run=RUN),
        PLAN.extra_outputs(),
        PLAN.trackers_outputs(),
    localrule: True


# A finished hidden_states job leaves its sidecar <cache>.partial as a hard link of the
# cache (rules/cache.smk), for a rerun after a lost Snakemake; a run that ended (success
# or error) needs none of them.
onsuccess:
    remove_done_links(PLAN.caches() + PLAN.shard_caches())
    # what the trackers left out (a checkpoint without a step, two at one step, W&B points lost with their
    # folders): on the console, not only in the job log, when this run logged (dflash_eval/trackers/log.py)
    for _note in trackers_run_warnings(PLAN, STARTED):
        logger.warning(f"dflash-eval: {_note}")
    # a validation that did not pass is a warning on the console, not only a row of the report
    for _note in failed_checks(PLAN.validate_online_outputs() + PLAN.validate_engine_outputs(), STARTED):
        logger.warning(f"dflash-eval: {_note}")


onerror:
    # Snakemake knows which jobs finished: the done links are not needed (a forced rerun of hidden_states
    # would adopt them instead of recomputing); only a killed Snakemake leaves them
    remove_done_links(PLAN.caches() + PLAN.shard_caches())
    for _note in failed_checks(PLAN.validate_online_outputs() + PLAN.validate_engine_outputs(), STARTED):
        logger.warning(f"dflash-eval: {_note}")  # a validation that did not pass, also when a later job failed
