# Prompt set -> chat-templated prompts (text + token ids) as JSONL, and <set>.meta.json beside it
# (what was skipped and why; read by the report).


def prompt_set_param(key):
    """params function: one option of the job's prompt set (entry keys over `prompt_set`)."""

    def get(wildcards):
        return PLAN.prompt_set_options(wildcards.prompt_set).get(key)

    get.__name__ = f"prompt_set_{key}"
    return get


def prompts_inputs(wildcards):
    """Tokenizer files, plus the prompt file when the entry names one."""
    files = {"tokenizer": TARGET.tokenizer}
    path = PLAN.prompt_set_options(wildcards.prompt_set).get("path")
    if path:
        files["prompt_file"] = path
    return files


def prompts_path_arg(wildcards, input):
    if "prompt_file" in input.keys():
        return f"--path {shlex.quote(input.prompt_file)}"
    return ""


rule prompts:
    input:
        unpack(prompts_inputs),
    output:
        prompts="results/{run}/prompts/{prompt_set}.jsonl",
        meta="results/{run}/prompts/{prompt_set}.meta.json",  # skip counts per reason (report)
    log:
        "logs/prompts/{run}/{prompt_set}.log",
    conda:
        "../envs/cpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        source=prompt_set_param("source"),
        path=prompts_path_arg,
        n=prompt_set_param("n"),
        seed=prompt_set_param("seed"),
        max_prompt_tokens=prompt_set_param("max_prompt_tokens"),
        thinking=(
            "--enable-thinking"
            if config["generation"]["enable_thinking"]
            else "--no-enable-thinking"
        ),
        tokenizer=target_dir,
    shell:
        "python -m dflash_eval prompts --source {params.source} {params.path}"
        " --tokenizer {params.tokenizer:q} --n {params.n} --seed {params.seed}"
        " --max-prompt-tokens {params.max_prompt_tokens} {params.thinking}"
        " --out {output.prompts:q} > {log:q} 2>&1"
