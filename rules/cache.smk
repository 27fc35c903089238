# Target forward over prompt + completion ids -> HDF5 hidden-state cache.
# params.layer_ids (the cached layers: cache.target_layer_ids, or the union of every
# drafter's target_layer_ids) is a rerun trigger: changing the cached layers
# re-extracts every cache (and re-evaluates downstream).
#
# The job builds the cache in the sidecar <output>.partial, which is not declared:
# Snakemake never deletes it, so a killed or failed job (SIGKILL, SLURM time limit,
# disk full) is resumed by the next run from the samples already written and verified.
# --keep-partial leaves the finished sidecar as a hard link of the output until the
# workflow succeeds (Snakefile onsuccess), so a rerun after a lost Snakemake reuses
# the output of a job it did not see finish (docs/errors.md: troubleshooting).


rule hidden_states:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        completions="results/{run}/completions/{prompt_set}.jsonl",
    output:
        "results/{run}/cache/{prompt_set}.h5",
    log:
        "logs/hidden_states/{run}/{prompt_set}.log",
    benchmark:
        "benchmarks/hidden_states/{run}/{prompt_set}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: TORCH_THREADS
    resources:
        gpu=1,
    params:
        target=target_dir,
        layer_ids=LAYER_IDS_ARG,
        options=PLAN.stage_flags("hidden_states"),
    shell:
        "python -m dflash_eval hidden-states --target {params.target:q}"
        " --completions {input.completions:q} --layer-ids {params.layer_ids}"
        " --target-fingerprint {input.fingerprint:q} --keep-partial {params.options}"
        " --out {output:q} > {log:q} 2>&1"
