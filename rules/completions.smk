# Greedy target completions (token ids + text) for one prompt set.


rule completions:
    input:
        unpack(target_all_files),
        fingerprint=TARGET.fingerprint,
        prompts="results/{run}/prompts/{prompt_set}.jsonl",
    output:
        "results/{run}/completions/{prompt_set}.jsonl",
    log:
        "logs/completions/{run}/{prompt_set}.log",
    benchmark:
        "benchmarks/completions/{run}/{prompt_set}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: workflow.cores  # torch intra-op threads; GPU jobs run one at a time (gpu=1)
    resources:
        gpu=1,
    params:
        target=target_dir,
        source=config["generation"]["source"],
        max_new_tokens=config["generation"]["max_new_tokens"],
        batch_size=config["generation"]["batch_size"],
        device=config["generation"]["device"],
        dtype=config["generation"]["dtype"],
        linear_attn_backend=config["target"]["linear_attn_backend"],
    shell:
        "python -m dflash_eval completions --target {params.target:q}"
        " --prompts {input.prompts:q} --source {params.source}"
        " --max-new-tokens {params.max_new_tokens} --batch-size {params.batch_size}"
        " --device {params.device:q} --dtype {params.dtype}"
        " --linear-attn-backend {params.linear_attn_backend}"
        " --target-fingerprint {input.fingerprint:q}"
        " --out {output:q} > {log:q} 2>&1"
