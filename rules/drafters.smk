# Per checkpoint: training checkpoint -> stripped bf16 drafter folder.
# Demo checkpoints (checkpoints.demo) are written first by demo_checkpoint.


rule strip_drafter:
    input:
        unpack(lambda wildcards: PLAN.strip_inputs(wildcards.ckpt)),
    output:
        weights="results/{run}/drafters/{ckpt}/model.safetensors",
        config="results/{run}/drafters/{ckpt}/config.json",
        info="results/{run}/drafters/{ckpt}/strip_info.json",
    log:
        "logs/strip_drafter/{run}/{ckpt}.log",
    benchmark:
        "benchmarks/strip_drafter/{run}/{ckpt}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        checkpoint=lambda wildcards: CHECKPOINTS[wildcards.ckpt]["path"],
        target=target_dir,
        extra=lambda wildcards: PLAN.strip_args(wildcards.ckpt),
        out_dir=output_dir,
    shell:
        "python -m dflash_eval strip-drafter --checkpoint {params.checkpoint:q}"
        " --target {params.target:q} {params.extra}"
        " --out-dir {params.out_dir:q} > {log:q} 2>&1"


rule demo_checkpoint:
    input:
        unpack(lambda wildcards: PLAN.demo_inputs(wildcards.name)),
    output:
        "resources/demo/checkpoints/{name}.pt",
    log:
        "logs/demo_checkpoint/{name}.log",
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        target=target_dir,
        args=lambda wildcards: PLAN.demo_args(wildcards.name),
    shell:
        "python -m dflash_eval demo-checkpoint --target {params.target:q} {params.args}"
        " --out {output:q} > {log:q} 2>&1"
