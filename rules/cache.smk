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
#
# cache.source: vllm takes the states from a vLLM server in extract mode instead (the
# job's own, on tensor_parallel_size GPUs, log beside the job's; or the user's server at
# cache.vllm.url: no GPU, one thread); same cache format (docs/serving-engines.md).


rule hidden_states:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        completions="results/{run}/completions/{prompt_set}.jsonl",
        completions_meta="results/{run}/completions/{prompt_set}.meta.json",
    output:
        f"results/{{run}}/cache/{{prompt_set}}{CACHE_SUFFIX}",
    log:
        main="logs/hidden_states/{run}/{prompt_set}.log",
        server="logs/hidden_states/{run}/{prompt_set}.vllm.log",
    benchmark:
        "benchmarks/hidden_states/{run}/{prompt_set}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: 1 if PLAN.remote_cache_server else TORCH_THREADS
    resources:
        gpu=PLAN.hidden_states_gpus,
    params:
        target=target_dir,
        layer_ids=LAYER_IDS_ARG,
        options=lambda wildcards: PLAN.stage_flags("hidden_states", wildcards.prompt_set),
    shell:
        "python -m dflash_eval hidden-states --target {params.target:q}"
        " --completions {input.completions:q} --layer-ids {params.layer_ids}"
        " --target-fingerprint {input.fingerprint:q} --keep-partial {params.options}"
        " --server-log {log.server:q} --out {output:q} > {log.main:q} 2>&1"


# config cache.shards > 1: N jobs per prompt set, each on its own GPU (the GPU pool), each computing
# every N-th batch of the one-job batch plan (states bit-identical to one job), then one merge that
# links their samples into the prompt set's cache (dflash_eval/cache/shards.py); the merge, not
# rule hidden_states, then makes the cache.
if PLAN.cache_shards > 1:

    ruleorder: merge_cache_shards > hidden_states

    rule hidden_states_shard:
        input:
            unpack(target_model_files),
            fingerprint=TARGET.fingerprint,
            completions="results/{run}/completions/{prompt_set}.jsonl",
                completions_meta="results/{run}/completions/{prompt_set}.meta.json",
        output:
            f"results/{{run}}/cache/{{prompt_set}}.shard{{shard}}{CACHE_SUFFIX}",
        log:
            "logs/hidden_states_shard/{run}/{prompt_set}.{shard}.log",
        benchmark:
            "benchmarks/hidden_states_shard/{run}/{prompt_set}.{shard}.tsv"
        wildcard_constraints:
            shard=r"\d+",
        conda:
            "../envs/gpu.yaml"
        container:
            config["containers"]["cuda"]
        threads: TORCH_THREADS
        resources:
            gpu=PLAN.target_gpus,
        params:
            target=target_dir,
            layer_ids=LAYER_IDS_ARG,
            shards=PLAN.cache_shards,
            options=lambda wildcards: PLAN.stage_flags("hidden_states", wildcards.prompt_set),
        shell:
            "python -m dflash_eval hidden-states-shard --target {params.target:q}"
            " --completions {input.completions:q} --layer-ids {params.layer_ids}"
            " --shard {wildcards.shard}/{params.shards}"
            " --target-fingerprint {input.fingerprint:q} --keep-partial {params.options}"
            " --out {output:q} > {log:q} 2>&1"

    rule merge_cache_shards:
        input:
            shards=lambda wildcards: PLAN.shard_caches(wildcards.run, wildcards.prompt_set),
            completions="results/{run}/completions/{prompt_set}.jsonl",
        output:
            f"results/{{run}}/cache/{{prompt_set}}{CACHE_SUFFIX}",
        log:
            "logs/merge_cache_shards/{run}/{prompt_set}.log",
        conda:
            "../envs/cpu.yaml"
        container:
            config["containers"]["cuda"]
        shell:
            "python -m dflash_eval merge-cache-shards --shards {input.shards:q}"
            " --completions {input.completions:q} --out {output:q} > {log:q} 2>&1"
