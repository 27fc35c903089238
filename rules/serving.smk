# Settings of the completions rule for serving-engine sources (generation.source openai /
# sglang, generation.serve vllm): parse-time checks, inputs and CLI flags. Torch-free.


GEN = config["generation"]
SERVED = GEN["source"] != "transformers"
SERVE_VLLM = GEN["serve"] == "vllm"

if SERVE_VLLM and GEN["source"] != "openai":
    raise WorkflowError(
        f"config generation.serve: vllm serves the 'openai' protocol, but generation.source is "
        f"{GEN['source']!r}. Fix: set generation.source: openai."
    )
if SERVE_VLLM and GEN["endpoint"]["url"]:
    raise WorkflowError(
        "config generation: both serve: vllm and endpoint.url are set. Fix: use your server "
        "(endpoint.url, serve: none) or let the workflow start vLLM (serve: vllm, no url)."
    )
if SERVED and not SERVE_VLLM and not GEN["endpoint"]["url"]:
    raise WorkflowError(
        f"config generation.source {GEN['source']!r} needs a server. Fix: set "
        "generation.endpoint.url (e.g. http://gpu-host:8000), or generation.serve: vllm."
    )
if GEN["endpoint"].get("api_key"):
    # Handed to the jobs through the environment only: never a param, a shell word or a log line.
    os.environ[GEN["endpoint"]["api_key_env"]] = GEN["endpoint"]["api_key"]


def completions_inputs(wildcards):
    """Target files the job reads: a remote server needs only config + tokenizer."""
    files = target_all_files(wildcards)
    if SERVED and not SERVE_VLLM:
        files.pop("target_weights")
    return files


def completions_server_args(wildcards):
    """Flags of the server sources ('' for transformers). Never the API key."""
    if not SERVED:
        return ""
    args = ["--concurrency", GEN["concurrency"], "--timeout-s", GEN["timeout_s"]]
    args += ["--retries", GEN["retries"]]
    if GEN["allow_retokenize"]:
        args.append("--allow-retokenize")
    if SERVE_VLLM:
        vllm = GEN["vllm"]
        args += ["--serve", "vllm", "--vllm-python", vllm["python"]]
        args += ["--vllm-max-model-len", vllm["max_model_len"]]
        args += ["--vllm-start-timeout-s", vllm["start_timeout_s"]]
        args += [f"--vllm-arg={a}" for a in vllm["args"]]
        args += [f"--vllm-env={k}={v}" for k, v in sorted(vllm["env"].items())]
    else:
        args += ["--endpoint-url", GEN["endpoint"]["url"]]
        args += ["--model", GEN["endpoint"]["model"]]
        args += ["--api-key-env", GEN["endpoint"]["api_key_env"]]
    return " ".join(shlex.quote(str(a)) for a in args)
