"""Stage ``hidden_states`` (rule ``hidden_states``): the target over every completion -> the prompt set's HDF5 cache.

Reads the completions file (:mod:`dflash_eval.data.completions`) and the target; runs the target
forward of :mod:`dflash_eval.cache.extract` (hooks on the stored layers, packed or padded batches);
writes the cache with :mod:`dflash_eval.cache.writer` (format: :mod:`dflash_eval.cache.format`),
resumably: a killed run continues its ``.partial`` sidecar. With ``cache.source: vllm`` the states
come from a vLLM server in extract mode instead (:mod:`dflash_eval.serving.vllm.states`, same format).
Options: config section ``cache`` and ``target.linear_attn_backend`` (:mod:`dflash_eval.core.options`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from dflash_eval.cache.disk_room import bytes_per_token, check_free_space, no_room_error
from dflash_eval.cache.extract import (check_layers, check_packing, device_free_bytes, forward_batch, forward_bytes,
                                      packing_support, too_large_error, versions)
from dflash_eval.cache.format import (FORMAT, FORMAT_VERSION, LAYER_CONVENTION, STORAGE_BF16, STORAGE_F32, STORAGE_FP8,
                                      completions_sampling, is_no_space, quantize_fp8)
from dflash_eval.cache.shards import parse_shard, shard_plan
from dflash_eval.cache.writer import Batch, PartialCache, SampleMeta, StreamingWriter
from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError, reused_sidecar_note
from dflash_eval.core.io import sha256_file
from dflash_eval.core.progress import Progress
from dflash_eval.core.runtime import dtype_name, length_batches, resolve_device, resolve_dtype
from dflash_eval.data.completions import read_completions
from dflash_eval.data.provenance import meta_path, read_meta, settings_of, stage_block
from dflash_eval.serving.vllm.states import extract_hidden_states_vllm
from dflash_eval.target.hybrid import ENV_NOT_RECORDED, bind_linear_attention
from dflash_eval.target.model import load_target, target_info
from dflash_eval.target.spec import TargetSpec

log = logging.getLogger(__name__)

STAGE = "hidden_states"


def _layer_ids(text: str) -> list[int]:
    """Comma-separated 0-based decoder layers: at least one, none negative."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"expected at least one 0-based layer id (e.g. 1,8,15), got {text!r}")
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"layer ids are 0-based decoder layers (>= 0), got {text!r}")
    return ids


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--completions", required=True, help="completions JSONL of the prompt set")
    p.add_argument("--layer-ids", type=_layer_ids, required=True,
                   help="comma-separated 0-based target decoder layers to store (HF hidden_states[i+1]); the union "
                        "of every configured drafter's dflash_config.target_layer_ids")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint' (the weights are not hashed again while it matches)")
    p.add_argument("--keep-partial", action="store_true",
                   help="keep the finished sidecar <out>.partial as a hard link of the output, so that a rerun "
                        "that finds the output deleted (Snakemake after a lost run) verifies and reuses it")
    p.add_argument("--server-log", default=None,
                   help="source vllm: the job-owned vLLM server's log (default <out>.vllm.log)")
    p.add_argument("--shard", type=parse_shard, default=None, metavar="K/N",
                   help="compute only shard K of N of the prompt set (its batches K, K+N, ... of the one-job batch "
                        "plan, so each sample's states equal a one-job extraction's); merge the N shard caches "
                        "with 'merge-cache-shards' (dflash_eval/cache/shards.py)")
    p.add_argument("--out", required=True, help="HDF5 cache path; built in the resumable sidecar <out>.partial, "
                                                "renamed when complete")


def main(args, opts) -> None:
    weights = (TargetSpec.read(args.target, fingerprint_file=args.target_fingerprint).weights_sha256()
               if args.target_fingerprint else None)  # from the record: not hashed again
    check_completions_target(args.completions, weights)
    extract_cache(args.target, args.completions, args.out, args.layer_ids, opts,
                  target_fingerprint=args.target_fingerprint, keep_partial=args.keep_partial,
                  server_log=args.server_log, shard=args.shard)


def check_completions_target(completions, target_sha256: str | None) -> None:
    """Refuse completions generated by another model than the target whose states are extracted: the
    ``target_sha256`` of the completions' ``<set>.meta.json`` (null for a server's, not compared) against
    ``target_sha256`` (the target's weights; None: not compared). A file without a meta is not checked.

    Raises:
        InputError: ``(<set>.meta.json, "target_sha256", ...)`` naming both.
    """
    meta = meta_path(completions)
    made = read_meta(meta, "completions").get("target_sha256") if meta.is_file() else None
    if target_sha256 is not None and made is not None and made != target_sha256:
        raise InputError(meta, "target_sha256", f"{str(made)[:16]}... is not the target's weights ({target_sha256[:16]}"
                         "...): the completions were generated by another model (target.path changed under the same "
                         "target.name)", "regenerate the completions (snakemake -R completions)")


def extract_cache(target_dir, completions_path, out, layer_ids: list[int], opts, *, target_fingerprint=None,
                  keep_partial: bool = False, server_log: str | None = None, shard=None) -> Path:
    """The cache of ``completions_path`` from the source ``opts.source`` names (config ``cache.source``).

    ``hf``: :func:`extract_hidden_states` (the target's HF forward in this process); ``vllm``:
    :func:`dflash_eval.serving.vllm.states.extract_hidden_states_vllm` (a vLLM server in extract mode; ``server_log``
    is the job-owned server's log, ``shard`` is refused there). The one dispatch of the two sources, used by
    this stage and by ``engine_parity``. Arguments, return value and errors: those two functions.

    Raises:
        InputError: ``shard`` with source ``vllm`` (one server per prompt set), and what the source raises.
    """
    if opts.source == "vllm":  # a vLLM server in extract mode (dflash_eval.serving.vllm.states)

        if shard is not None:
            raise InputError("config", "cache.shards", "shards split the HF forward, but cache.source is 'vllm'",
                             "drop cache.shards, or use cache.source: hf")
        return extract_hidden_states_vllm(target_dir, completions_path, out, layer_ids, opts,
                                          target_fingerprint=target_fingerprint, keep_partial=keep_partial,
                                          server_log=server_log)
    return extract_hidden_states(target_dir, completions_path, out, layer_ids, opts,
                                 target_fingerprint=target_fingerprint, keep_partial=keep_partial, shard=shard)


def _storage_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view as stored (bf16 -> uint16 bits), no copy."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


class _HostBuffers:
    """Two reusable pinned host buffers (states + argmax, + FP8 scales) for device-to-host copies on a side stream."""

    def __init__(self, tokens: int, K: int, H: int, dtype: torch.dtype, n: int = 2, fp8: bool = False):
        self.free = [(torch.empty((tokens, K, H), dtype=torch.uint8 if fp8 else dtype, pin_memory=True),
                      torch.empty(tokens, dtype=torch.int32, pin_memory=True),
                      torch.empty((tokens, K), dtype=torch.float32, pin_memory=True) if fp8 else None)
                     for _ in range(n)]

    def take(self):
        return self.free.pop()

    def give(self, buf) -> None:
        self.free.append(buf)


def extract_hidden_states(target_dir, completions_path, out, layer_ids: list[int], opts=None, *,
                          target_fingerprint=None, keep_partial: bool = False, shard=None, loaded=None,
                          **overrides) -> Path:
    """Run the target over every completion and write the cache (format, memory, resume: :mod:`dflash_eval.cache.format`).

    Args:
        target_dir: HF target folder.
        completions_path: JSONL from the completions stage (``id``, ``prompt_ids``, ``completion_ids``,
            ``stop_reason``, ``max_new_tokens``).
        out: cache path; built in ``<out>.partial``, which a rerun with the same settings resumes.
        layer_ids: 0-based decoder layers to store (order kept), HF ``hidden_states[i+1]`` (the plan's
            union of every configured drafter's ``target_layer_ids``); with ``final_hidden`` the last
            layer (final-normed) is appended when absent.
        opts: the stage's options (:func:`dflash_eval.core.options.make`; config section ``cache`` and
            ``target.linear_attn_backend``): ``batch_tokens`` (tokens per forward: real tokens when
            packed, padded tokens otherwise), ``packing`` (``'auto'``: packed where
            :func:`dflash_eval.cache.extract.packing_support` allows; ``'off'``: right-padded), ``device``,
            ``dtype`` (float32 on CPU by default; the cache stores bfloat16 or float32),
            ``linear_attn_backend`` (kernel of hybrid targets' linear-attention layers), ``final_hidden``
            (also store the final normed hidden state, the target's p at temperature > 0), ``storage``
            (``fp8``: float8_e4m3fn with a per-token, per-layer scale, quantised on the device:
            :func:`dflash_eval.cache.format.quantize_fp8`; ``dtype``: as computed).
        target_fingerprint: a ``target-fingerprint`` record (avoids re-hashing the weights).
        keep_partial: keep the finished sidecar as a hard link of ``out`` (see :mod:`dflash_eval.cache.format`).
        shard: ``(K, N)``: only shard K of N (:func:`dflash_eval.cache.shards.shard_plan`); ``out`` then holds
            those samples, in the completions file's order.
        loaded: ``(model, tokenizer, KernelBinding)`` of :func:`dflash_eval.target.model.load_target` for this
            target, device, dtype and backend, used instead of loading it again (the ``kernel_parity`` stage
            extracts the same samples twice with one model, rebinding the kernel in between).
        **overrides: option values, when ``opts`` is not given.

    Returns:
        ``Path(out)``.

    Raises:
        InputError: layer id out of range or duplicated; empty or malformed completions file; a dtype
            other than bfloat16/float32; a partial cache written with other settings, or in use; the disk
            (or quota) full while writing (what was committed stays in the partial for the rerun).
        InputError: the samples left cannot fit in the free space of ``out``'s folder (``cache.disk_check:
            refuse``, checked before the target loads).
        Interrupted: SIGTERM/SIGINT (the batches already on the host are written and committed first).
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    batch_tokens, device, dtype = opts.batch_tokens, opts.device, opts.dtype
    linear_attn_backend, packing = opts.linear_attn_backend, opts.packing
    t_start = time.perf_counter()
    completions_path, out = Path(completions_path), Path(out)
    if not layer_ids:
        raise InputError(None, "--layer-ids", "no layer given", "pass comma-separated 0-based decoder layers, e.g. 1,8,15")
    rows = read_completions(completions_path)
    spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
    if spec.num_layers is not None:  # checked before anything is loaded or written
        check_layers(layer_ids, spec.num_layers, target_dir)
    if len(set(layer_ids)) != len(layer_ids):
        raise InputError("config", "cache.target_layer_ids", f"duplicate ids in {layer_ids}", "list each layer once")
    if opts.final_hidden:  # the p information of temperature > 0 (cache_format: last_layer_normed)
        if spec.num_layers is None:
            raise InputError(target_dir, "num_hidden_layers", "unknown, so the final normed hidden state (the last "
                             "layer) cannot be added to the cached layers", "give the target a config.json with "
                             "num_hidden_layers, or set cache.final_hidden: false (greedy evaluation only)")
        layer_ids = list(layer_ids) + ([spec.num_layers - 1] if spec.num_layers - 1 not in layer_ids else [])
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dt not in (torch.bfloat16, torch.float32):
        raise InputError("config", "cache.dtype", f"{dtype_name(dt)} cannot be stored in the cache", "use bfloat16 or float32")
    fp8 = getattr(opts, "storage", "dtype") == "fp8"
    storage = "fp8" if fp8 else dtype_name(dt)  # bytes_per_token's name
    binding = bind_linear_attention(linear_attn_backend, dev, spec)
    can_pack, why = packing_support(spec)
    packed = packing == "auto" and can_pack
    log.info("batching: %s (%s)", "packed" if packed else "right-padded",
             why if packing == "auto" else "cache.packing: off")

    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    meta = [SampleMeta(str(r["id"]), np.asarray(s, dtype=np.int32), len(r["prompt_ids"]),
                       str(r.get("stop_reason", "unknown")), int(r["max_new_tokens"])) for r, s in zip(rows, seqs)]
    batches = length_batches([len(s) for s in seqs], max_tokens=batch_tokens, packed=packed)
    if shard is not None:  # the whole set's plan, cut by batches: each sample keeps its one-job batch
        keep, batches = shard_plan(batches, *shard)
        seqs, meta = [seqs[i] for i in keep], [meta[i] for i in keep]
        log.info("shard %d/%d: %d of %d samples in %d batches", shard[0], shard[1], len(keep), len(rows), len(batches))
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    identity = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "target_sha256": spec.weights_sha256(),
        "target_layer_ids": list(layer_ids), "completions_sha256": sha256_file(completions_path).hexdigest(),
        "hidden_size": spec.hidden_size, "dtype": dtype_name(dt),
        "storage": STORAGE_FP8 if fp8 else STORAGE_BF16 if dt == torch.bfloat16 else STORAGE_F32,
        "batching": "packed" if packed else "right-padded", "batch_tokens": int(batch_tokens),
        "device_name": device_name, "linear_attn_backend": binding.backend, **versions(),
    }
    cache = PartialCache(out, identity, meta, keep_link=keep_partial)
    try:
        done = cache.resume() or set()
        todo = [b for b in batches if any(i not in done for i in b)]
        n_todo = sum(1 for b in todo for i in b if i not in done)
        log.info("%s: %d samples in %d batches; %d verified in the partial file and kept, %d to compute in %d batches",
                 out, len(seqs), len(batches), len(done), n_todo, len(todo))
        if done and not todo:
            log.warning(reused_sidecar_note(out, len(done)))
        if todo and spec.hidden_size and getattr(opts, "disk_check", "refuse") == "refuse":
            check_free_space(cache.path, _bytes_needed(seqs, done, len(layer_ids), spec.hidden_size, storage), n_todo,
                             storage)  # before the target loads: the token counts are exact here
        if todo:
            model, tok, kernel = loaded or load_target(spec, device=dev, dtype=dt, backend=linear_attn_backend,
                                                        devices=opts.devices, max_memory=opts.max_memory)
            pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
            info = target_info(model)
            check_layers(layer_ids, info["num_hidden_layers"], target_dir)
            if not cache.is_open:
                cache.create({
                    **identity,
                    "target_name": Path(target_dir).name,
                    "target_model_type": info.get("model_type", ""),
                    "num_target_layers": info["num_hidden_layers"],
                    "vocab_size": info["vocab_size"],
                    "layer_convention": LAYER_CONVENTION,
                    "last_layer_normed": (info["num_hidden_layers"] - 1) in layer_ids,
                    "device": str(dev),
                    "linear_attn_kernel": kernel.describe(),
                    "layer_types": json.dumps(info.get("layer_types", [])),
                    "image": os.environ.get("DFLASH_EVAL_IMAGE", ""),
                    "env": {k: v for k, v in os.environ.items()
                            if k.startswith(("FLA_", "TRITON_", "CUDA_VISIBLE", "USE_HUB_KERNELS", "DFLASH_EVAL_"))
                            and k not in ENV_NOT_RECORDED},
                    "padding_side": "none" if packed else "right",
                    "prompt_set": completions_path.stem,
                    "completion_sampling": json.dumps(completions_sampling(rows)),
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "provenance": json.dumps(stage_block(STAGE, opts, {
                        "target": identity["target_sha256"], "completions": identity["completions_sha256"]}) | {
                        "settings": {STAGE: {**settings_of(STAGE, opts), "layer_ids": list(layer_ids)}}}),
                })
            if packed:
                check_packing(model, [seqs[i] for b in todo[-1:] for i in b] or seqs[:3], layer_ids, dev, pad_id)
            stats = _run_batches(model, cache, seqs, todo, layer_ids, dev, dt, pad_id, packed, fp8, completions_path)
            n_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
            log.info("computed %d samples, %d tokens in %.3f s: %.0f tok/s, ~%.1f TFLOP/s (2 x %.0fM non-embedding "
                     "params per token; attention scores not counted) on %s, %s, %s; peak host memory: states of %d "
                     "samples (%d tokens) at once", stats["samples"], stats["tokens"], stats["seconds"],
                     stats["tokens"] / max(stats["seconds"], 1e-9),
                     2 * n_params * stats["tokens"] / max(stats["seconds"], 1e-9) / 1e12, n_params / 1e6,
                     device_name, dtype_name(dt), identity["batching"], stats["max_held_samples"],
                     stats["max_held_tokens"])
        elif not cache.is_open:  # no samples at all cannot happen (read_completions refuses); keep it safe
            raise RuntimeError("nothing to compute and no partial file")
        cache.finish()
    except (OSError, RuntimeError) as err:
        cache.close()
        if is_no_space(err):
            raise no_room_error(cache.path, err, len(cache.done), len(seqs),
                                _bytes_needed(seqs, cache.done, len(layer_ids), spec.hidden_size, storage)) from err
        raise
    except BaseException:
        cache.close()
        raise
    log.info("wrote %s: %d samples (%d reused, %d computed) in %.1f s in total", out, len(seqs), len(done),
             len(seqs) - len(done), time.perf_counter() - t_start)
    return out


def _bytes_needed(seqs, done, K: int, H: int | None, storage: str) -> int:
    """Bytes the hidden states of the samples not in ``done`` take as stored (0 when ``H`` is unknown)."""
    tokens = sum(len(s) for i, s in enumerate(seqs) if i not in done)
    return 0 if not H else tokens * bytes_per_token(storage, K, H)


@torch.inference_mode()
def _run_batches(model, cache: PartialCache, seqs, todo, layer_ids, dev, dt, pad_id, packed, fp8: bool = False,
                 completions=None) -> dict:
    """Forward every batch of ``todo`` and stream its new samples into ``cache`` (see the module docstring).

    A batch whose forward cannot fit the device (:func:`dflash_eval.cache.extract.forward_bytes` above
    :func:`~dflash_eval.cache.extract.device_free_bytes`, checked before it runs) or runs out of device memory
    (``torch.cuda.OutOfMemoryError``) stops the stage with :func:`~dflash_eval.cache.extract.too_large_error`
    (InputError naming its longest sample, the sample's tokens and the fixes) after the batches before it are
    written and committed: the partial cache keeps them and a rerun resumes.
    """
    K, H = len(layer_ids), model.config.get_text_config().hidden_size
    cuda = dev.type == "cuda"
    total = {"n": len(cache.done), "of": len(cache.meta)}
    # tqdm bar of committed tokens on a terminal; off a terminal the INFO line per commit below is the
    # progress (tests/cache/test_extract_resume.py reads it), so the bar logs none of its own.
    bar = Progress(sum(len(seqs[i]) for b in todo for i in b if i not in cache.done), "hidden states",
                   logger=log, log_every=float("inf"))

    def progress(n, tokens):  # called by the writer thread after each commit
        total["n"] += n
        bar.update(tokens)
        log.info("committed %d samples (%d tokens); %d/%d samples in the file", n, tokens, total["n"], total["of"])

    writer = StreamingWriter(cache, max_batches=2, progress=progress)
    buffers = _HostBuffers(max(sum(len(seqs[i]) for i in b) for b in todo), K, H, dt, fp8=fp8) if cuda else None
    copy_stream = torch.cuda.Stream(dev) if cuda else None
    logical = "float8_e4m3fn" if fp8 else "bfloat16" if dt == torch.bfloat16 else "float32"
    n_samples = n_tokens = 0
    t0 = time.perf_counter()
    try:
        for b in todo:
            batch_seqs = [seqs[i] for i in b]
            N = sum(len(s) for s in batch_seqs)
            free = device_free_bytes(dev)
            need = forward_bytes(model.config.get_text_config(), [len(s) for s in batch_seqs], K, dt.itemsize, packed)
            if free is not None and need > free:
                raise _TooLarge(b, need, free)
            writer.reserve()
            try:
                hidden, argmax = forward_batch(model, batch_seqs, layer_ids, dev, pad_id, packed, out_dtype=dt)
                scale = None
                if fp8:  # quantised where the states are (the device): half the bytes cross to the host
                    hidden, scale = quantize_fp8(hidden)
            except torch.cuda.OutOfMemoryError as err:
                raise _TooLarge(b) from err
            if cuda:
                buf = buffers.take()
                copy_stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(copy_stream):
                    buf[0][:N].copy_(hidden, non_blocking=True)
                    buf[1][:N].copy_(argmax, non_blocking=True)
                    if fp8:
                        buf[2][:N].copy_(scale, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(copy_stream)
                for t in (hidden, argmax) + ((scale,) if fp8 else ()):
                    t.record_stream(copy_stream)
                host_h, host_a, host_s = buf[0][:N], buf[1][:N], buf[2][:N] if fp8 else None
                ready, release = event.synchronize, (lambda buf=buf: buffers.give(buf))
            else:
                host_h, host_a, host_s, ready, release = hidden, argmax, scale, None, None
            h_np, a_np = _storage_view(host_h), host_a.numpy()
            s_np = host_s.numpy() if fp8 else None
            samples, scales, o = [], [], 0
            for i, s in zip(b, batch_seqs):
                if i not in cache.done:
                    samples.append((i, h_np[o : o + len(s)], a_np[o : o + len(s)]))
                    scales.append(s_np[o : o + len(s)] if fp8 else None)
                o += len(s)
            writer.hold(len(b), N)
            writer.submit(Batch(samples, logical, ready, release, held=(len(b), N), scales=scales if fp8 else None))
            n_samples += len(samples)
            n_tokens += N
    except BaseException as err:
        try:
            writer.close()  # what is already on the host is written and committed
        except BaseException as werr:  # noqa: BLE001 - the first error is the one to report
            log.error("cache writer: %s", werr)
        finally:
            bar.close()
        if isinstance(err, _TooLarge):
            big = max(err.batch, key=lambda i: len(seqs[i]))
            lens = [len(seqs[i]) for i in err.batch]
            raise too_large_error(completions, cache.meta[big].sample_id, len(seqs[big]), len(lens),
                                  sum(lens) if packed else len(lens) * max(lens), dev, len(cache.done),
                                  len(cache.meta), cache.path, err.need, err.free) from err.__cause__
        raise
    try:
        writer.close()
    finally:
        bar.close()
    log.info("cache writer thread: %s", ", ".join(f"{k} {v:.1f} s" for k, v in writer.timings.items()))
    return {"samples": n_samples, "tokens": n_tokens, "seconds": time.perf_counter() - t0,
            "max_held_samples": writer.max_held_samples, "max_held_tokens": writer.max_held_tokens}



class _TooLarge(Exception):
    """A batch (sample indices) whose forward does not fit the device: ``need``/``free`` bytes from the pre-check,
    None after an out-of-memory; turned into the stage's InputError once the batches before it are committed."""

    def __init__(self, batch: list[int], need: int | None = None, free: int | None = None):
        super().__init__(batch)
        self.batch, self.need, self.free = batch, need, free
