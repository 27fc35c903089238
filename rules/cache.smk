# Target forward over prompt + completion ids -> HDF5 hidden-state cache.
# params.layer_ids (cache.target_layer_ids) is a rerun trigger: changing the
# cached layers re-extracts every cache (and re-evaluates downstream).
#
# The job builds the cache in the sidecar <output>.partial, which is not declared:
# Snakemake never deletes it, so a killed or failed job (SIGKILL, SLURM time limit,
# disk full) is resumed by the next run from the samples already written and verified.
# --keep-partial leaves the finished sidecar as a hard link of the output until the
# workflow succeeds (Snakefile onsuccess), so a rerun after a lost Snakemake reuses
# the output of a job it did not see finish (README: Troubleshooting).


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
        batch_tokens=config["cache"]["batch_tokens"],
        packing=config["cache"]["packing"],
        linear_attn_backend=config["target"]["linear_attn_backend"],
        device=config["cache"]["device"],
        dtype=config["cache"]["dtype"],
    shell:
        "python -m dflash_eval hidden-states --target {params.target:q}"
        " --completions {input.completions:q} --layer-ids {params.layer_ids}"
        " --batch-tokens {params.batch_tokens} --packing {params.packing}"
        " --linear-attn-backend {params.linear_attn_backend}"
        " --target-fingerprint {input.fingerprint:q} --keep-partial"
        " --device {params.device:q} --dtype {params.dtype}"
        " --out {output:q} > {log:q} 2>&1"
