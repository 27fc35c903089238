"""Server sources against a stand-in server (tests/standin_server.py: a small stdlib HTTP server that speaks
SGLang's documented native schema and vLLM's OpenAI-compatible subset, backed by a tiny HF model; it is not
SGLang or vLLM). Completions equal the transformers source's token for token; faults are retried; a server
without ids, with another tokenizer, too short a max length or that ignores stop ids is refused clearly;
the API key never reaches a file; a job-owned server (a fake vLLM entry point with an engine-core child) is
stopped with its whole process group, also when the job is killed with SIGKILL. The real vLLM: test_vllm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dflash_eval.stages.completions import generate_completions
from dflash_eval.core.errors import InputError
from dflash_eval.data.prompts import build_prompt_set, write_prompts
from dflash_eval.serving.clients import ServerError, ServerUnavailable
from standin_server import StandIn
from tiny import make_tiny_target, make_tiny_tokenizer

pytestmark = pytest.mark.slow  # a stand-in server process per test and a reference generation (minutes in all)

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
MAX_NEW = 16
PROMPTS = ["hi", "What is the capital of France? Paris.", "def add(a, b): return a + b",
           "The quick brown fox jumps over the lazy dog. " * 3, "Summarize the text.", "Write a function.",
           "Tell me about Paris.", "Explain bullet points."]


def _rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    target = make_tiny_target(root / "target", arch="llama", seed=3)
    txt = root / "p.txt"
    txt.write_text("\n".join(PROMPTS) + "\n")
    prompts = write_prompts(build_prompt_set("file", target, n=0, seed=0, path=txt), root / "prompts.jsonl")
    # The random model rarely emits <|im_end|>: declare a second stop id that some completions contain and others
    # do not, so that both kinds of stop (a stop id, max_new_tokens) are exercised.
    free = _rows(generate_completions(target, prompts, root / "free.jsonl", max_new_tokens=MAX_NEW, batch_size=1,
                                      device="cpu", dtype="float32"))
    seen = [set(r["completion_ids"][2:MAX_NEW - 2]) for r in free]
    stop = min((t for t in set().union(*seen) if 0 < sum(t in x for x in seen) < len(seen)),
               key=lambda t: (abs(sum(t in x for x in seen) - len(seen) / 2), t))
    gen = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, stop]}))
    ref = _rows(generate_completions(target, prompts, root / "ref.jsonl", max_new_tokens=MAX_NEW, batch_size=1,
                                     device="cpu", dtype="float32"))
    assert {r["stop_reason"] for r in ref} == {"eos", "length"}
    return root, target, prompts, ref


def _ids(rows):
    return [(r["id"], r["completion_ids"], r["stop_reason"]) for r in rows]


def test_sglang_source_equals_transformers(env, tmp_path):
    root, target, prompts, ref = env
    with StandIn(target, mode="sglang", trim_matched=True) as s:  # SGLang may leave the matched stop id out
        got = _rows(generate_completions(target, prompts, tmp_path / "c.jsonl", source="sglang", max_new_tokens=MAX_NEW,
                                         endpoint={"url": s.url + "/"}, concurrency=3))
    assert _ids(got) == _ids(ref)
    assert [g["text"] for g in got] == [r["text"] for r in ref]
    gen = got[0]["generation"]
    assert gen == {"source": "sglang", "engine": "sglang", "model": str(target), "server_version": "0.5.23-standin",
                   "stop_ids": ref[0]["generation"]["stop_ids"]}
    assert len(gen["stop_ids"]) == 2
    assert all(g["generation"] == gen for g in got)


def test_openai_text_only_server_refused_unless_allowed(env, tmp_path, caplog):
    root, target, prompts, ref = env
    with StandIn(target, mode="openai", openai_ids=False) as s:
        with pytest.raises(InputError, match="returned no token ids.*allow_retokenize"):
            generate_completions(target, prompts, tmp_path / "a.jsonl", source="openai", max_new_tokens=MAX_NEW,
                                 endpoint={"url": s.url})
        assert not (tmp_path / "a.jsonl").exists()
        with caplog.at_level("WARNING", logger="dflash_eval.stages.completions"):
            got = _rows(generate_completions(target, prompts, tmp_path / "b.jsonl", source="openai",
                                             max_new_tokens=MAX_NEW, endpoint={"url": s.url}, allow_retokenize=True))
    assert all(g["retokenized"] is True for g in got)
    bad = sum(g["retokenize_mismatch"] for g in got)
    msg = next(r.getMessage() for r in caplog.records if "round-trip mismatch rate" in r.getMessage())
    assert f"re-tokenized {len(got)} completions" in msg and f"rate {bad / len(got):.3f} ({bad} of them" in msg
    # where the round trip held, the ids are the model's
    for g, r in zip(got, ref):
        if not g["retokenize_mismatch"]:
            assert (g["completion_ids"], g["stop_reason"]) == (r["completion_ids"], r["stop_reason"])


def test_retries_on_errors_and_dropped_connections(env, tmp_path, caplog):
    root, target, prompts, ref = env
    faults = [500, None, 429, "drop", None, 503, "drop", 502]
    with StandIn(target, mode="sglang", faults=faults) as s, caplog.at_level("INFO"):
        got = _rows(generate_completions(target, prompts, tmp_path / "c.jsonl", source="sglang",
                                         max_new_tokens=MAX_NEW, endpoint={"url": s.url}, concurrency=2, retries=4))
        assert s.n_generate == len(PROMPTS) + 6  # every fault cost one extra request
    assert _ids(got) == _ids(ref)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("server requests retried"))
    counts = json.loads(line.split(": ", 1)[1])
    assert counts.pop("HTTP 500") == counts.pop("HTTP 429") == counts.pop("HTTP 503") == counts.pop("HTTP 502") == 1
    assert sum(counts.values()) == 2  # the dropped connections (httpx RemoteProtocolError / ReadError)


def test_server_down_mid_run_then_resumed(env, tmp_path):
    """Every request fails once the server 'dies' (after 3 completions): the job fails after its retries, the 3
    completions are kept; the rerun against the restarted server generates only the other prompts."""
    root, target, prompts, ref = env
    out = tmp_path / "c.jsonl"
    opts = {"concurrency": 1, "retries": 1}
    with StandIn(target, mode="sglang", faults=[None] * 3 + ["drop"] * 50) as s:
        with pytest.raises(ServerUnavailable, match="failed after 2 attempts"):
            generate_completions(target, prompts, out, source="sglang", max_new_tokens=MAX_NEW,
                                 endpoint={"url": s.url}, **opts)
    partial = tmp_path / ".c.jsonl.partial"
    assert not out.exists() and len(partial.read_text().splitlines()) == 1 + 3
    with StandIn(target, mode="sglang") as s:
        # restarted elsewhere: the URL is not part of what must match
        got = _rows(generate_completions(target, prompts, out, source="sglang", max_new_tokens=MAX_NEW,
                                         endpoint={"url": s.url}, **opts))
        assert s.n_generate == len(PROMPTS) - 3
    assert _ids(got) == _ids(ref) and not partial.exists()


def test_api_key_is_sent_and_never_written(env, tmp_path):
    root, target, prompts, ref = env
    secret = "sk-dflash-test-7f3a9c"
    envv = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "dflash_eval", "completions", "--target", str(target), "--prompts", str(prompts),
           "--source", "openai", "--max-new-tokens", str(MAX_NEW), "--endpoint-api-key-env", "MY_KEY"]
    with StandIn(target, mode="openai", api_key=secret) as s:
        p = subprocess.run(cmd + ["--endpoint-url", s.url, "--out", str(tmp_path / "no.jsonl")], env=envv,
                           capture_output=True, text=True, cwd=tmp_path)
        assert p.returncode == 3 and "HTTP 401" in p.stderr  # no key: a clear server error
        p = subprocess.run(cmd[:3] + ["-v"] + cmd[3:] + ["--endpoint-url", s.url, "--out", str(tmp_path / "c.jsonl")],
                           env={**envv, "MY_KEY": secret}, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _ids(_rows(tmp_path / "c.jsonl")) == _ids(ref)
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert secret not in f.read_text(errors="replace"), f
    assert secret not in p.stdout + p.stderr


def test_wrong_tokenizer_short_max_length_and_ignored_stops_are_refused(env, tmp_path):
    root, target, prompts, ref = env
    other = tmp_path / "other_tok"
    make_tiny_tokenizer(other, vocab_size=300)
    with StandIn(target, mode="sglang", tokenizer_dir=other) as s:
        with pytest.raises(InputError, match="the server's tokenizer differs from the target's.*first difference") as ei:
            generate_completions(target, prompts, tmp_path / "c.jsonl", source="sglang", max_new_tokens=MAX_NEW,
                                 endpoint={"url": s.url})
        assert ei.value.field == "tokenizer" and "--tokenizer" in ei.value.fix
    longest = max(len(r["prompt_ids"]) for r in _rows(prompts))
    with StandIn(target, mode="openai", max_model_len=longest + MAX_NEW - 1) as s:
        with pytest.raises(InputError, match=f"max length is {longest + MAX_NEW - 1} tokens, below the longest prompt"):
            generate_completions(target, prompts, tmp_path / "c.jsonl", source="openai", max_new_tokens=MAX_NEW,
                                 endpoint={"url": s.url})
    with StandIn(target, mode="sglang", ignore_stop=True) as s:
        with pytest.raises(ServerError, match="ignores stop_token_ids"):
            generate_completions(target, prompts, tmp_path / "c.jsonl", source="sglang", max_new_tokens=MAX_NEW,
                                 endpoint={"url": s.url})
    assert not (tmp_path / "c.jsonl").exists()


# --------------------------------------------------------------------------- a server owned by the job

def _fake_vllm(tmp_path) -> dict:
    """A 'vllm' package whose api_server module is the stand-in (plus an engine-core child process)."""
    pkg = tmp_path / "fakevllm" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                       "from standin_server import main\nmain()\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "fakevllm"), str(REPO)])}


def _procs_with(marker: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                out.append(int(pid))
        except OSError:
            pass
    return out


def _wait_gone(marker: str, timeout: float = 60) -> list[int]:
    t0 = time.time()
    while _procs_with(marker) and time.time() - t0 < timeout:
        time.sleep(0.2)
    return _procs_with(marker)


def test_served_vllm_is_stopped_with_its_process_group(env, tmp_path):
    root, target, prompts, ref = env
    fake = _fake_vllm(tmp_path)
    vllm = {"python": sys.executable, "env": fake}
    got = _rows(generate_completions(target, prompts, tmp_path / "c.jsonl", source="openai", max_new_tokens=MAX_NEW,
                                     device="cpu", dtype="float32", serve="vllm", vllm=vllm,
                                     server_log=str(tmp_path / "v.log")))
    assert _ids(got) == _ids(ref)
    assert got[0]["generation"]["served_by"] == {"serve": "vllm", "dtype": "float32", "enforce_eager": True,
                                                 "extra_args": [], "max_model_len": 256}
    assert "stand-in vLLM serving" in (tmp_path / "v.log").read_text()
    assert _wait_gone(str(tmp_path / "fakevllm"), 5) == [] and _wait_gone("standin-engine-core", 5) == []
    # a failing job (here: the server answers with another model's max length) stops its server too
    with pytest.raises(InputError, match="max length is 8 tokens"):
        generate_completions(target, prompts, tmp_path / "d.jsonl", source="openai", max_new_tokens=MAX_NEW,
                             device="cpu", serve="vllm", vllm={**vllm, "max_model_len": 8},
                             server_log=str(tmp_path / "v.log"))
    assert _wait_gone("standin-engine-core", 5) == []
    with pytest.raises(InputError, match="vLLM is not importable"):
        generate_completions(target, prompts, tmp_path / "d.jsonl", source="openai", max_new_tokens=MAX_NEW,
                             serve="vllm", vllm={"python": sys.executable})


def test_sigkill_of_the_job_stops_its_vllm(env, tmp_path):
    """SIGKILL leaves no chance to clean up: the watchdog stops the server's process group."""
    root, target, prompts, ref = env
    fake = _fake_vllm(tmp_path)
    envv = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "dflash_eval", "completions", "--target", str(target), "--prompts", str(prompts),
           "--source", "openai", "--serve", "vllm", "--vllm-python", sys.executable,
           f"--vllm-env={json.dumps({'PYTHONPATH': fake['PYTHONPATH']})}", "--max-new-tokens", str(MAX_NEW), "--concurrency", "1",
           "--out", str(tmp_path / "c.jsonl")]
    p = subprocess.Popen(cmd, env=envv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not _procs_with("standin-engine-core"):
        assert p.poll() is None and time.time() - t0 < 300
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert _wait_gone(str(tmp_path / "fakevllm"), 60) == []
    assert _wait_gone("standin-engine-core", 10) == []


# --------------------------------------------------------------------------- workflow wiring (dry runs)

def test_dry_run_server_sources(tmp_path, monkeypatch):
    """endpoint: the job gets the URL and the key's variable name, needs no weights and no GPU; the key itself is
    in no command; inconsistent settings stop the workflow at parse time."""
    import yaml
    from test_workflow import copy_workflow, dflash_eval_argv, shell_commands, smk

    from dflash_eval.cli import build_parser

    wd = copy_workflow(tmp_path / "wf")
    cfg_path = wd / "config" / "config.yaml"
    base = yaml.safe_load(cfg_path.read_text())
    secret = "sk-never-printed-41d2"

    def run(gen, check=True):
        cfg_path.write_text(yaml.safe_dump({**base, "generation": gen}, sort_keys=False))
        return smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", check=check)

    out = run({"source": "openai", "endpoint": {"url": "http://gpu-host:8000", "api_key": secret}, "concurrency": 32})
    text = out.stdout + out.stderr
    assert secret not in text
    cmds = [c for c in shell_commands(out.stdout) if " completions " in c]
    assert len(cmds) == 4  # the demo's humaneval, sharegpt, sharegpt-t1 and long-chat
    args = build_parser().parse_args(dflash_eval_argv(cmds[0]))
    assert (args.source, args.endpoint__url, args.serve) == ("openai", "http://gpu-host:8000", "none")
    # requests in flight, timeouts, retries and the key's variable cannot change the completions: they travel in the
    # jobs' environment (options.RUNTIME_ENV), not as rerun-triggering params
    assert args.concurrency is None and args.endpoint__api_key_env is None and "--concurrency" not in cmds[0]
    from dflash_eval.core.options import runtime_env

    assert json.loads(runtime_env({"generation": {"concurrency": 32}}))["completions"]["concurrency"] == 32
    job = text[text.index("rule completions:"):].split("\n\n")[0]
    assert "model.safetensors" not in job and "tokenizer.json" in job  # no weights needed
    assert "resources: tmpdir=<TBD>, gpu=0" in job or "gpu=0" in job

    out = run({"source": "openai", "serve": "vllm", "vllm": {"python": "/opt/vllm/bin/python", "args": ["--seed", "0"]}})
    args = build_parser().parse_args(dflash_eval_argv(next(c for c in shell_commands(out.stdout) if " completions " in c)))
    assert (args.serve, args.vllm__python, args.vllm__args, args.vllm__env) == (
        "vllm", "/opt/vllm/bin/python", ["--seed", "0"], {"VLLM_CPU_KVCACHE_SPACE": "2"})

    for gen, msg in [({"source": "sglang", "serve": "vllm"}, "serves the 'openai' protocol"),
                     ({"source": "openai"}, "needs a server"),
                     ({"source": "openai", "serve": "vllm", "endpoint": {"url": "http://x:1"}}, "both serve: vllm and")]:
        proc = run(gen, check=False)
        assert proc.returncode != 0 and msg in proc.stdout + proc.stderr, gen
