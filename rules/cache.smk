# Target forward over prompt + completion ids -> HDF5 hidden-state cache.
# params.layer_ids (cache.target_layer_ids) is a rerun trigger: changing the
# cached layers re-extracts every cache (and re-evaluates downstream).


rule hidden_states:
    input:
        unpack(target_model_files),
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
        linear_attn_backend=config["target"]["linear_attn_backend"],
        device=config["cache"]["device"],
        dtype=config["cache"]["dtype"],
    shell:
        "python -m dflash_eval hidden-states --target {params.target:q}"
        " --completions {input.completions:q} --layer-ids {params.layer_ids}"
        " --batch-tokens {params.batch_tokens}"
        " --linear-attn-backend {params.linear_attn_backend}"
        " --device {params.device:q} --dtype {params.dtype}"
        " --out {output:q} > {log:q} 2>&1"
