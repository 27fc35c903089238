# Per checkpoint: training checkpoint -> stripped bf16 drafter folder.
# Demo checkpoints (checkpoints.demo) are written first by demo_checkpoint.


def strip_inputs(wildcards):
    row = CHECKPOINTS[wildcards.ckpt]
    files = {
        "checkpoint": row["files"],  # plan.checkpoint_files, checked at parse time
        **target_model_files(wildcards),
    }
    if row.get("drafter_config"):
        files["drafter_config"] = row["drafter_config"]
    return files


def strip_args(wildcards):
    """--drafter-config / --override flags: a params value, so editing them reruns the job."""
    return " ".join(map(shlex.quote, plan.strip_args(CHECKPOINTS[wildcards.ckpt])))


rule strip_drafter:
    input:
        unpack(strip_inputs),
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
        extra=strip_args,
        out_dir=output_dir,
    shell:
        "python -m dflash_eval strip --checkpoint {params.checkpoint:q}"
        " --target {params.target:q} {params.extra}"
        " --out-dir {params.out_dir:q} > {log:q} 2>&1"


def demo_inputs(wildcards):
    files = target_model_files(wildcards)
    drafter = DEMO_CHECKPOINTS[wildcards.name].get("drafter")
    if drafter:
        files["drafter"] = [
            os.path.join(drafter, "config.json"),
            os.path.join(drafter, "model.safetensors"),
        ]
    return files


rule demo_checkpoint:
    input:
        unpack(demo_inputs),
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
        args=lambda wildcards: " ".join(
            map(shlex.quote, plan.demo_args(DEMO_CHECKPOINTS[wildcards.name]))
        ),
    shell:
        "python -m dflash_eval demo-checkpoint --target {params.target:q} {params.args}"
        " --out {output:q} > {log:q} 2>&1"
