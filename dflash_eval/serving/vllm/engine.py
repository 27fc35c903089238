"""Acceptance as vLLM measures it: DFlash speculative decoding on a server, converted to the replay's convention.

A stripped drafter folder (``strip_drafter``'s output: ``config.json`` + ``model.safetensors``,
embedding and LM head taken from the target) runs as it is in vLLM's DFlash path
(:func:`dflash_args`: ``--speculative-config '{"method": "dflash", "model": DIR,
"num_speculative_tokens": B - 1}'``; ``vllm/v1/spec_decode/dflash.py``,
``vllm/model_executor/models/qwen3_dflash.py``). The prompt set is sent greedily
(:func:`run_requests`) and vLLM reports acceptance twice:

* Prometheus counters (``GET /metrics``, vLLM PR #16665; read before and after, :class:`SpecCounters`):
  ``vllm:spec_decode_num_drafts_total`` (verify steps), ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position=k}``
  (k = 0..B-2 is block slot k + 1). Mean acceptance length = 1 + accepted / drafts (PR #17908),
  pooled over every verify step of every request.
* Per request, with ``--per-request-spec-decode-metrics detailed``: the response's
  ``metrics.speculative_decoding.per_step_accepted`` / ``per_step_drafted``, one entry per verify step.

How vLLM counts, and the conversion (:func:`engine_acceptance_lengths`). The scheduler takes
a step's accepted drafts as ``len(sampled tokens) - 1`` *before* it cuts the output at a stop
token or at ``max_tokens`` (``vllm/v1/core/sched/scheduler.py``, ``update_from_output``, then
``_update_request_with_output`` / ``check_stop``), and the scheduler drafts a full block
(``num_speculative_tokens``) up to ``max_tokens`` too. So in the last step of a response,
drafts past the stop token that happen to equal the target's greedy continuation after it
are counted as accepted; dflash-eval's replay (as ``dflash==0.1.0``'s ``dflash_generate``)
commits ``min(a + 1, tokens left)`` and never compares a slot past the end. The conversion
walks a request's steps with the same cut: ``produced = min(a + 1, n - 1 - pos)`` (``n`` the
completion tokens, prefill token included; ``pos`` the tokens committed so far). On the
converted lists every :mod:`dflash_eval.replay.metrics` aggregate applies as on the replay's.

Per-position acceptance, two conventions (both shown, :func:`per_position`):
vLLM's ``unconditional[k] = P(slots 1..k all accepted)`` = ``accepted_per_pos[k-1] / drafts``
(speculators ``acceptance_at_pos_k`` reads it the same way), and dflash-eval's
``slot_acceptance[k] = P(slot k accepted | slots < k accepted)`` (:mod:`dflash_eval.replay.metrics`);
``conditional[k] = unconditional[k] / unconditional[k-1]`` up to the steps cut at the end
(which vLLM counts and the replay censors).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from dflash_eval.core.runtime import dtype_name, resolve_device, resolve_dtype
from dflash_eval.replay.metrics import aggregate
from dflash_eval.serving.clients import OpenAIClient, ServerError, VLLMServer, _neutral_sampling
from dflash_eval.serving.generation import stop_token_ids

log = logging.getLogger(__name__)

#: Prometheus counter names (vLLM ``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``)
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total", "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
            "accepted": "vllm:spec_decode_num_accepted_tokens_total"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*$')


def dflash_args(drafter_dir: str | Path, block_size: int, method: str = "dflash",
                draft_sample_method: str | None = None) -> list[str]:
    """vLLM flags that run a stripped DFlash drafter with block size ``block_size`` (B - 1 drafts per step).

    ``method``: ``dflash``. vLLM 0.32.0 also runs DFlash 2 drafters under ``dflash``: it picks
    ``qwen3_dflash2`` by the folder's ``architectures`` (``DFlash2DraftModel``, which strip writes),
    in its V2 model runner only, which needs Triton (``vllm/config/vllm.py``, ``_is_dflash_candidate_draft``).
    Prefix caching is off (a cached prompt prefix gives the drafter no context states for it) and the
    per-request step arrays are on. ``draft_sample_method``: vLLM's ``greedy`` (its default: argmax drafts, one-hot
    q) or ``probabilistic`` (``vllm/config/speculative.py``); None leaves vLLM's default.
    """
    spec = {"method": method, "model": str(drafter_dir), "num_speculative_tokens": int(block_size) - 1}
    if draft_sample_method:
        spec["draft_sample_method"] = draft_sample_method
    return ["--speculative-config", json.dumps(spec), "--no-enable-prefix-caching",
            "--per-request-spec-decode-metrics", "detailed"]


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode Prometheus counters (summed over engines); subtract two reads for one run."""

    drafts: float = 0.0  #: verify steps
    draft_tokens: float = 0.0
    accepted: float = 0.0  #: accepted drafts, counted before the stop / max_tokens cut
    accepted_per_pos: tuple[float, ...] = ()  #: index k: steps whose slot k + 1 was accepted (with every slot before)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda t: tuple(t) + (0.0,) * (n - len(t))  # noqa: E731
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            tuple(a - b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))))

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM PR #17908), NaN without a draft."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    def as_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "accepted_per_pos": list(self.accepted_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length}


def parse_counters(text: str) -> SpecCounters:
    """:class:`SpecCounters` from a Prometheus text exposition (``GET /metrics``); absent counters are 0."""
    tot = {k: 0.0 for k in COUNTERS}
    per: dict[int, float] = {}
    names = {v: k for k, v in COUNTERS.items()}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in names:
            tot[names[name]] += value
        elif name == PER_POS:
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per[int(pos.group(1))] = per.get(int(pos.group(1)), 0.0) + value
    return SpecCounters(tot["drafts"], tot["draft_tokens"], tot["accepted"],
                        tuple(per.get(k, 0.0) for k in range(max(per) + 1)) if per else ())


def read_counters(client) -> SpecCounters:
    """The server's counters now (``client``: :class:`dflash_eval.serving.clients.ServerClient`)."""
    r = client._http.get("/metrics")
    r.raise_for_status()
    return parse_counters(r.text)


@dataclass
class EngineRequest:
    """One prompt as the engine served it."""

    sample_id: str
    completion_ids: list[int]
    finish: str
    latency_s: float  #: request sent -> response received, seconds
    per_step_accepted: list[int] = field(default_factory=list)  #: vLLM's accepted drafts per verify step
    per_step_drafted: list[int] = field(default_factory=list)
    seed: int | None = None  #: the request's sampling seed (temperature > 0), else None
    error: str | None = None  #: why the engine did not serve it (temperature > 0 runs record it, not raise)


def run_requests(client, rows: Sequence[dict], max_new_tokens: int, stop_ids: Sequence[int],
                 concurrency: int = 1, sampling: dict | None = None,
                 seeds: int = 1) -> tuple[list[EngineRequest], float]:
    """Send every prompt (token ids in, token ids out); the requests and the wall time in seconds.

    ``rows``: prompts or completions rows (``id``, ``prompt_ids``). Greedy (``sampling`` None or at temperature 0):
    every knob pinned as in :meth:`dflash_eval.serving.clients.OpenAIClient.complete`. With ``sampling``
    (``temperature``, ``top_p``, ``top_k``) above temperature 0: each prompt ``seeds`` times, with vLLM's per-request
    ``seed`` 0 .. seeds - 1; a request the engine fails to serve is returned with its ``error``, not raised.
    """
    sampled = bool(sampling) and float(sampling["temperature"]) > 0
    jobs = [(row, k) for row in rows for k in range(seeds if sampled else 1)]

    def one(job) -> EngineRequest:
        row, k = job
        knobs = _neutral_sampling({**sampling, "seed": k}) if sampled else _neutral_sampling()
        body = {"model": client.model or None, "prompt": [int(t) for t in row["prompt_ids"]],
                "max_tokens": int(max_new_tokens), "n": 1, "stream": False, "return_token_ids": True,
                "stop_token_ids": [int(t) for t in stop_ids], "skip_special_tokens": False, "ignore_eos": False,
                "min_tokens": 0, **knobs}
        t0 = time.perf_counter()
        if sampled:
            try:
                out = client.request("POST", "/v1/completions", body)
            except Exception as err:  # noqa: BLE001 -- a dead or failing server: recorded per request, named later
                return EngineRequest(str(row["id"]), [], "error", time.perf_counter() - t0, seed=k,
                                     error=f"{type(err).__name__}: {str(err)[:300]}")
        else:
            out = client.request("POST", "/v1/completions", body)
        dt = time.perf_counter() - t0
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"{client.url}/v1/completions: no choices: {str(out)[:300]}") from None
        sd = ((out.get("metrics") or {}).get("speculative_decoding") or {})
        return EngineRequest(str(row["id"]), [int(t) for t in choice.get("token_ids") or []],
                             "length" if choice.get("finish_reason") == "length" else "stop", dt,
                             list(sd.get("per_step_accepted") or []), list(sd.get("per_step_drafted") or []),
                             seed=k if sampled else None)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="dflash-engine") as pool:
        reqs = list(pool.map(one, jobs))
    return reqs, time.perf_counter() - t0


def engine_acceptance_lengths(per_step_accepted: Sequence[int], n_completion: int) -> tuple[list[int], int]:
    """vLLM's per-step accepted drafts -> the replay's committed tokens per verify step.

    Args:
        per_step_accepted: accepted drafts per verify step as vLLM counts them (before the end cut).
        n_completion: completion tokens of the response (prefill token and stop token included).

    Returns:
        ``(lengths, past_end)``: ``lengths[s] = min(a_s + 1, n_completion - 1 - pos_s)``, walking
        ``pos`` from 0 (the prefill token) as :func:`dflash_eval.replay.chain.chain_walk` does; ``past_end`` =
        the accepted drafts vLLM counted past the stop token / ``max_tokens`` (``sum(a + 1) - sum(lengths)``).

    Raises:
        ValueError: the steps do not commit exactly ``n_completion - 1`` tokens (the trace does not
            belong to this response).
    """
    out, pos, last = [], 0, n_completion - 1
    for a in per_step_accepted:
        if pos >= last:
            raise ValueError(f"{len(per_step_accepted)} steps for {n_completion} tokens: steps left after the end")
        produced = min(int(a) + 1, last - pos)
        out.append(produced)
        pos += produced
    if pos != last:
        raise ValueError(f"the steps commit {pos} tokens after the prefill token, the response has {last}")
    return out, sum(int(a) + 1 for a in per_step_accepted) - sum(out)


def per_position(lengths: Sequence[Sequence[int]], block_size: int) -> dict:
    """Both per-position conventions from committed-token lists (the replay's or converted engine ones).

    Returns:
        ``{"unconditional": {k: P(slots 1..k accepted)}, "conditional": {k: P(slot k | slots < k)}}``,
        ``k = 1..B-1``; unconditional over every verify step (vLLM's ``accepted_per_pos / drafts``
        on converted counts), conditional as :attr:`dflash_eval.replay.metrics.AcceptanceStats.slot_acceptance`.
    """
    steps = [n for r in lengths for n in r]
    stats = aggregate(lengths, block_size)
    return {"unconditional": {k: sum(n > k for n in steps) / len(steps) if steps else float("nan")
                              for k in range(1, block_size)},
            "conditional": dict(stats.slot_acceptance)}


def raw_per_position(per_step_accepted: Sequence[Sequence[int]], block_size: int) -> dict[int, float]:
    """vLLM's unconditional per-position rate from raw per-step counts (equals its Prometheus vector)."""
    steps = [a for r in per_step_accepted for a in r]
    return {k: sum(a >= k for a in steps) / len(steps) if steps else float("nan") for k in range(1, block_size)}


# --------------------------------------------------------------------------- server set-up
def cpu_fix_dir(work_dir: str | Path) -> Path:
    """Copy :mod:`dflash_eval.serving.vllm.sitecustomize` to ``<work_dir>/pyfix/sitecustomize.py``; that directory.

    On the ``PYTHONPATH`` of a CPU vLLM server it fixes the grouped ``rms_norm`` of vLLM's DFlash drafter
    (see that module); nothing else of dflash-eval is importable from it.
    """
    d = Path(work_dir) / "pyfix"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("sitecustomize.py"), d / "sitecustomize.py")
    return d


def server_env(env: dict, work_dir: str | Path, cpu_fix: bool) -> dict:
    """The server's environment: ``env`` plus, with ``cpu_fix``, :func:`cpu_fix_dir` first on ``PYTHONPATH``."""
    out = dict(env)
    if cpu_fix:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(cpu_fix_dir(work_dir)), out.get("PYTHONPATH", "")) if p)
    return out


# --------------------------------------------------------------------------- engine vs offline
#: divergence kinds of one request (:func:`compare`), in the order they are checked
DIVERGENCES = {
    "none": "the converted engine steps equal the replay's, step for step",
    "stop-counting": "equal after conversion; vLLM counted accepted drafts past the stop token / max_tokens",
    "generation": "the engine generated other tokens than the completion (the replay follows the completion)",
    "last-block": "same tokens; the drafts differ first in a block that max_new_tokens shortens: the replay, like "
                  "dflash 0.1.0's dflash_generate (verify_size = min(block_size, max_length - start)), drafts that "
                  "block with fewer mask tokens, vLLM with its full num_speculative_tokens (then drops what passes "
                  "max_tokens), and the block's bidirectional attention makes the drafts differ: a convention",
    "drafts": "same tokens, other drafts: the engine's drafter computed something else at some anchor",
    "no-trace": "the server returned no per-step arrays (--per-request-spec-decode-metrics detailed)",
}


def compare(rows: Sequence[dict], offline: dict, requests: Sequence[EngineRequest], block_size: int) -> dict:
    """Engine requests next to the offline replay of the same completions, per request and pooled.

    Args:
        rows: completions rows (``id``, ``completion_ids``): what the replay replayed.
        offline: the ``evaluate`` JSON of the same checkpoint and prompt set (``samples[].acceptance_lengths``).
        requests: :func:`run_requests` output, in any order.
        block_size: B.

    Returns:
        ``{"requests": [...], "kinds": {kind: count}, "offline": {...}, "engine": {...}}`` where each
        request has ``id``, ``kind`` (:data:`DIVERGENCES`), ``tokens_equal``, ``first_token_diff``,
        ``steps_offline`` / ``steps_engine``, ``accepted_offline`` / ``accepted_engine_raw``,
        ``past_end``, ``first_step_diff`` (index of the first differing step, else None), and the three
        lists; ``offline`` / ``engine`` hold ``tau``, ``tau_tokens_per_step``, ``per_position``
        (both conventions, :func:`per_position`) of the replay and of the converted engine steps, and
        ``engine`` also ``mean_acceptance_length_raw`` (vLLM's 1 + accepted / drafts on its own counts)
        and ``per_position_raw``.
    """
    by_id = {str(r["id"]): r for r in rows}
    off = {str(s["id"]): s["acceptance_lengths"] for s in offline["samples"]}
    out, kinds = [], {k: 0 for k in DIVERGENCES}
    conv_all, off_all, raw_all = [], [], []
    for req in requests:
        row = by_id[req.sample_id]
        want = list(row["completion_ids"])
        tok_eq = req.completion_ids == want
        first_tok = None if tok_eq else next((j for j, (a, b) in enumerate(zip(req.completion_ids, want)) if a != b),
                                             min(len(want), len(req.completion_ids)))
        o = off[req.sample_id]
        rec = {"id": req.sample_id, "tokens_equal": tok_eq, "first_token_diff": first_tok, "steps_offline": len(o),
               "steps_engine": len(req.per_step_accepted), "accepted_offline": sum(o) - len(o),
               "accepted_engine_raw": sum(req.per_step_accepted), "offline": o, "engine_raw": req.per_step_accepted,
               "latency_s": round(req.latency_s, 4)}
        conv, past = None, None
        if req.per_step_accepted:
            try:
                conv, past = engine_acceptance_lengths(req.per_step_accepted, len(req.completion_ids))
            except ValueError:
                conv = None
        rec.update(engine=conv, past_end=past,
                   first_step_diff=None if conv == o or conv is None else
                   next((k for k, (a, b) in enumerate(zip(conv, o)) if a != b), min(len(conv), len(o))))
        if not req.per_step_accepted and len(req.completion_ids) > 1:
            kind = "no-trace"
        elif not tok_eq:
            kind = "generation"
        elif conv != o:
            # the reference shortens the block at an anchor whose committed completion tokens leave fewer than B
            # to max_new_tokens; a first difference there is the block-length convention (DIVERGENCES)
            limit, k = row.get("max_new_tokens"), rec["first_step_diff"]
            short = limit is not None and k is not None and sum(o[:k]) > int(limit) - block_size
            kind = "last-block" if short else "drafts"
        elif past:
            kind = "stop-counting"
        else:
            kind = "none"
        rec["kind"] = kind
        kinds[kind] += 1
        if conv is not None and tok_eq:
            conv_all.append(conv)
            off_all.append(o)
            raw_all.append(req.per_step_accepted)
        out.append(rec)

    def summary(lists):
        st = aggregate(lists, block_size)
        return {"tau": st.tau, "tau_tokens_per_step": st.tau_tokens_per_step, "verify_steps": st.verify_steps,
                "per_position": per_position(lists, block_size)}

    eng = summary(conv_all)
    steps = sum(len(r) for r in raw_all)
    eng["mean_acceptance_length_raw"] = 1 + sum(map(sum, raw_all)) / steps if steps else float("nan")
    eng["per_position_raw"] = raw_per_position(raw_all, block_size)
    return {"requests": out, "kinds": kinds, "offline": summary(off_all), "engine": eng,
            "n_compared": len(conv_all)}


def latency_summary(requests: Sequence[EngineRequest], wall_s: float) -> dict:
    """Output tokens / s over the run (completion tokens / wall time) and per-request latency (seconds)."""
    lat = sorted(r.latency_s for r in requests)
    toks = sum(len(r.completion_ids) for r in requests)

    def q(p):
        return lat[min(len(lat) - 1, int(round(p * (len(lat) - 1))))] if lat else float("nan")

    return {"requests": len(requests), "output_tokens": toks, "wall_s": round(wall_s, 3),
            "output_tok_per_s": toks / wall_s if wall_s else float("nan"),
            "latency_s": {"mean": sum(lat) / len(lat) if lat else float("nan"), "p50": q(0.5), "p90": q(0.9)}}


# --------------------------------------------------------------------------- one validation run
@dataclass
class EngineOptions:
    """The job-owned vLLM server of ``validate_engine`` (config section ``validate_engine``).

    Attributes:
        python, args, env, max_model_len, start_timeout_s: :class:`dflash_eval.serving.clients.VLLMServer`
            (``max_model_len`` 0 = the longest prompt + ``max_new_tokens``, rounded up to 256).
        dtype: ``--dtype`` (``auto``: bfloat16 with CUDA, float32 without).
        tensor_parallel_size: ``--tensor-parallel-size``.
        concurrency: requests in flight (1 = one request at a time: per-request latency without queueing).
        cpu_fix: ``auto`` (on where this host has no CUDA), ``on``, ``off``: :mod:`dflash_eval.serving.vllm.sitecustomize`.
        method: vLLM's speculative method for the drafter (``dflash``, also for DFlash 2 drafters: see :func:`dflash_args`).
        timeout_s, retries: per request.
    """

    python: str = ".venv-vllm/bin/python"
    args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    max_model_len: int = 0
    start_timeout_s: float = 900.0
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    concurrency: int = 1
    cpu_fix: str = "auto"
    method: str = "dflash"
    timeout_s: float = 600.0
    retries: int = 2


def device_label(cuda: bool) -> str:
    """What the engine ran on, for the report: the GPU name(s), else the CPU model."""
    if cuda:
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}" if n > 1 else torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name} ({os.cpu_count()} cores)"


def serve_and_measure(target_dir, rows: Sequence[dict], max_new_tokens: int, work_dir, log_path,
                      opts: EngineOptions, drafter_dir=None, block_size: int = 0,
                      draft_sample_method: str | None = None, sampling: dict | None = None, seeds: int = 1,
                      more_concurrencies: Sequence[int] = ()) -> dict:
    """Start vLLM (plain, or with the drafter when ``drafter_dir``), send ``rows``, stop it.

    Greedy by default; with ``sampling`` above temperature 0 each prompt ``seeds`` times (:func:`run_requests`),
    the drafter served with ``draft_sample_method`` (:func:`dflash_args`). ``more_concurrencies``: after the measured
    run (at ``opts.concurrency``; the counters are read around it only) the same prompts again on the same server at
    each of these concurrencies (those other than ``opts.concurrency``).

    Returns:
        ``{"requests": [EngineRequest], "counters": SpecCounters | None, "timing": latency_summary(...),
        "server": {...}, "device": device_label(...), "extra": {concurrency: {"requests", "timing"}}}``;
        ``counters`` = after - before (DFlash only).

    Raises:
        InputError / ServerUnavailable: as :class:`dflash_eval.serving.clients.VLLMServer`; ServerError from requests.
    """
    cuda = torch.cuda.is_available()
    dt = dtype_name(resolve_dtype(opts.dtype, resolve_device("cuda" if cuda else "cpu")))
    fix = opts.cpu_fix == "on" or (opts.cpu_fix == "auto" and not cuda)
    extra = (dflash_args(drafter_dir, block_size, opts.method, draft_sample_method) if drafter_dir
             else ["--no-enable-prefix-caching"])
    if opts.tensor_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(int(opts.tensor_parallel_size))]
    need = max(len(r["prompt_ids"]) for r in rows) + max_new_tokens
    mml = opts.max_model_len or -(-need // 256) * 256
    server = VLLMServer(opts.python, target_dir, dtype=dt, max_model_len=mml, enforce_eager=not cuda,
                        extra_args=extra + list(opts.args), env=server_env(opts.env, work_dir, fix and bool(drafter_dir)),
                        log_path=log_path, start_timeout_s=opts.start_timeout_s)
    stop = stop_token_ids(target_dir)[0]
    more = sorted({int(c) for c in more_concurrencies} - {int(opts.concurrency)})
    more_runs = {}
    with server, OpenAIClient(server.url, timeout_s=opts.timeout_s, retries=opts.retries,
                              concurrency=max([opts.concurrency, *more])) as client:
        info = client.info()
        before = read_counters(client) if drafter_dir else None
        reqs, wall = run_requests(client, rows, max_new_tokens, stop, opts.concurrency, sampling, seeds)
        try:
            after = read_counters(client) if drafter_dir else None
        except Exception:  # noqa: BLE001 -- sampled runs: a server that died mid-run is named by its requests
            if not (sampling and float(sampling["temperature"]) > 0):
                raise
            after = before = None
        for c in more:
            more_reqs, more_wall = run_requests(client, rows, max_new_tokens, stop, c, sampling, seeds)
            more_runs[c] = {"requests": more_reqs, "timing": latency_summary(more_reqs, more_wall)}
    return {"requests": reqs, "counters": (after - before) if after is not None else None, "extra": more_runs,
            "timing": latency_summary(reqs, wall), "device": device_label(cuda),
            "server": {"engine": "vllm", "version": info.version, "dtype": dt, "max_model_len": mml,
                       "flags": extra + list(opts.args), "cpu_fix": bool(fix and drafter_dir),
                       "concurrency": opts.concurrency}}
