"""Offline replay of greedy DFlash speculative decoding -> acceptance length (tau).

What online greedy DFlash does (z-lab/dflash ``dflash/model.py`` ``dflash_generate``),
and what :func:`replay_batch` reproduces from the cache, per sample with prompt
length P, committed sequence ``x`` (prompt + greedy completion, length T) and
``max_length = P + max_new_tokens``:

* Prefill produces ``x[P]`` (not counted in tau). ``start = P`` is the index of
  the last committed token; the drafter's context is the target states of
  positions ``< start``.
* Verify step: block ``[x[start], MASK x (vs-1)]`` at positions
  ``start .. start+vs-1`` with ``vs = min(B, max_length - start)`` (the reference
  shortens the last block). Drafts ``d_j`` (j >= 1) are the greedy argmax of
  ``lm_head(drafter(block))[j]``; ``d_j`` predicts position ``start + j``.
* The target accepts the longest prefix with ``d_j == x[start + j]`` — with
  greedy verification the target's continuation *is* the greedy completion —
  giving ``a`` accepted drafts, then the bonus token: ``a + 1`` tokens per
  target forward. The step records ``produced = min(a + 1, T - 1 - start)``
  (cut at the stop token / ``max_new_tokens``, as ``dflash==0.1.0`` does).
* ``start += produced``; the context grows by the target states of the
  committed positions. Stop when ``start == T - 1``.

tau (reference definition, ``dflash/benchmark.py`` ``_print_decode_summary``):
mean over responses of (mean over verify steps of ``produced``). Also reported:
``tokens / verify steps`` pooled over responses (micro average).

Cost: the context K/V of every position are computed once per sample
(:meth:`DFlashDrafter.context_kv`); per verify step the drafter runs one block
per active sample (samples are replayed side by side), and LM-head logits are
computed lazily, a few slots at a time, only while all earlier drafts still
match — later drafts cannot change ``a``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InputError, atomic_path
from .metrics import aggregate, sample_tau
from .progress import Progress

log = logging.getLogger(__name__)

SLOT_CHUNK = 4  # LM-head slots evaluated per pass while drafts keep matching


@dataclass
class SampleResult:
    """Per-sample replay result. ``acceptance_lengths[s]`` = tokens committed by verify step s (1..B)."""

    sample_id: str
    prompt_len: int
    n_tokens: int  # completion length, prefill token included
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        return sample_tau(self.acceptance_lengths)


@torch.inference_mode()
def replay_batch(
    drafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    samples: list,
    block_size: int | None = None,
) -> list[list[int]]:
    """Replay greedy speculative decoding for several cached samples side by side.

    Args:
        drafter: :class:`~dflash_eval.drafter.DFlashDrafter` on the compute device/dtype.
        embed_weight: target ``embed_tokens`` ``[V, H]`` (compute device/dtype).
        head_weight: target ``lm_head`` ``[V, H]`` (compute device/dtype).
        samples: :class:`~dflash_eval.cache.CacheSample` list; ``hidden`` holds exactly the
            drafter's ``target_layer_ids`` in order, ``[T, K, H]``.
        block_size: B (default: the drafter's).

    Returns:
        per sample, the list of tokens committed per verify step (``min(a+1, tokens left)``).
    """
    cfg = drafter.cfg
    B = int(block_size or cfg.block_size)
    dev = embed_weight.device
    dt = embed_weight.dtype
    S = len(samples)
    T = torch.tensor([len(s.input_ids) for s in samples], device=dev)
    P = torch.tensor([s.prompt_len for s in samples], device=dev)
    max_len = P + torch.tensor([s.max_new_tokens for s in samples], device=dev)
    Tmax = int(T.max())
    ids = torch.full((S, Tmax + B), -1, dtype=torch.long, device=dev)  # -1 pads never match a draft
    hidden = torch.zeros((S, Tmax, len(cfg.target_layer_ids) * cfg.hidden_size), dtype=dt, device=dev)
    for r, s in enumerate(samples):
        ids[r, : len(s.input_ids)] = s.input_ids.to(dev)
        hidden[r, : len(s.input_ids)] = s.hidden.reshape(len(s.input_ids), -1).to(device=dev, dtype=dt)
    positions = torch.arange(Tmax, device=dev)
    ctx_kv = drafter.context_kv(hidden, positions[None].expand(S, -1))
    del hidden

    start = P.clone()
    records: list[list[int]] = [[] for _ in range(S)]
    slot = torch.arange(B, device=dev)
    mask_id = cfg.mask_token_id
    while True:
        rows = torch.nonzero(start < T - 1).flatten()
        if rows.numel() == 0:
            break
        st = start[rows]
        tc = int(st.max())
        kv = [(k[rows, :, :tc], v[rows, :, :tc]) for k, v in ctx_kv]
        ctx_valid = positions[None, :tc] < st[:, None]
        vs = torch.clamp(max_len[rows] - st, max=B)
        block_valid = slot[None] < vs[:, None]
        block_ids = torch.full((len(rows), B), mask_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = ids[rows, st]
        emb = embed_weight[block_ids]
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        block_pos = st[:, None] + slot[None]
        h = drafter(emb, block_pos, kv, positions[None, :tc].expand(len(rows), -1), ctx_valid, block_valid)
        # verify: longest prefix of drafts equal to the committed continuation
        left = T[rows] - 1 - st  # tokens still to commit
        limit = torch.minimum(vs - 1, left)  # comparable draft slots
        want = ids[rows[:, None], block_pos]  # x[start + j]
        acc = torch.zeros(len(rows), dtype=torch.long, device=dev)
        alive = torch.ones(len(rows), dtype=torch.bool, device=dev)
        for j0 in range(1, B, SLOT_CHUNK):
            j1 = min(j0 + SLOT_CHUNK, B)
            sel = torch.nonzero(alive & (limit >= j0)).flatten()
            if sel.numel() == 0:
                break
            draft = drafter.logits(h[sel, j0:j1], head_weight).argmax(-1)
            ok = (draft == want[sel, j0:j1]) & (slot[None, j0:j1] <= limit[sel, None])
            run = ok.long().cumprod(-1)
            acc[sel] += run.sum(-1)
            alive[:] = False
            alive[sel] = run[:, -1].bool()
        produced = torch.minimum(acc + 1, left)
        start[rows] = st + produced
        for r, p in zip(rows.tolist(), produced.tolist()):
            records[r].append(p)
    return records


def evaluate(
    drafter_dir,
    cache_path,
    target_dir,
    out,
    block_size: int | None = None,
    max_samples: int = 0,
    batch_size: int = 16,
    device: str = "auto",
    dtype: str = "auto",
    allow_backend_mismatch: bool = False,
    training_backend: str = "unknown",
    checkpoint_name: str | None = None,
    prompt_set: str | None = None,
    allow_foreign_cache: bool = False,
    agreement_warn: float = 0.99,
    agreement_min: float = 0.9,
    allow_low_agreement: bool = False,
    target_fingerprint: str | Path | None = None,
) -> dict:
    """Replay one drafter over one cache and write per-sample acceptance as JSON.

    Output JSON keys: ``checkpoint`` (``checkpoint_name``, default the drafter folder name),
    ``prompt_set`` (``prompt_set``, default the cache file stem),
    ``block_size``, ``samples`` (``id``, ``prompt_len``, ``n_tokens``, ``steps``, ``tau``,
    ``acceptance_lengths``), ``histogram`` (verify steps per committed count 1..B),
    ``tau`` (macro), ``tau_tokens_per_step`` (micro), ``n_samples`` (samples with >= 1 verify
    step), ``n_skipped`` (no verify step: the prefill token ended the response), provenance;
    ``argmax_agreement`` (min/mean of the samples' target agreement and the thresholds,
    :func:`~dflash_eval.compat.check_agreement`; each sample also carries its own) and
    ``target_check`` (the target's and the cache's weight fingerprints,
    :func:`~dflash_eval.compat.check_cache_target`; ``target_fingerprint`` is the
    ``target-fingerprint`` record, so the weights are not hashed again by every evaluate job).

    Raises:
        InputError: drafter/cache/target mismatch (layer ids not cached, hidden size, vocab,
            mask token, kernel backend); a cache of another target (unless ``allow_foreign_cache``);
            completions that are not the target's greedy output (mean agreement below
            ``agreement_min``, unless ``allow_low_agreement``); ``max_samples < 0``, a block size
            of 1, or nothing to replay (no sample with a verify step).
    """
    from .compat import check_agreement, check_cache_target

    if max_samples < 0:
        raise InputError(None, "--max-samples", f"must be >= 0 (0 = all), got {max_samples}", "pass 0 or a sample count")
    if block_size is not None and block_size < 2:
        raise InputError(None, "--block-size", f"must be >= 2 (or 0 = the drafter's), got {block_size}",
                         "a block holds the last committed token and at least one mask")
    from .cache import CacheReader
    from .compat import check_compat
    from .drafter import load_drafter
    from .runtime import dtype_name, resolve_device, resolve_dtype
    from .target import TargetSpec, load_embed_and_head

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    drafter_dir = Path(drafter_dir)
    drafter = load_drafter(drafter_dir, device=dev, dtype=dt)
    cfg = drafter.cfg
    reader = CacheReader(cache_path)
    a = reader.attrs
    spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
    embed, head = load_embed_and_head(spec)
    check_compat(cfg, drafter_dir / "config.json", target=spec, embed_rows=embed.shape[0], cache_attrs=a,
                 cache_path=cache_path)
    target_check = check_cache_target(spec, a, cache_path, allow_foreign_cache)
    if target_check["allowed_mismatch"]:
        log.warning("%s: extracted from another target (sha256 %s, given %s); evaluated anyway (--allow-foreign-cache)",
                    cache_path, target_check["cache_target_sha256"], target_check["target_sha256"])
    cache_backend = json.loads(a.get("linear_attn_kernel", "{}") or "{}").get("backend", "none")
    if (training_backend not in ("unknown", cache_backend) and cache_backend != "none"
            and not allow_backend_mismatch):
        raise InputError(cache_path, "linear_attn_kernel",
                         f"cache made with the '{cache_backend}' kernel but the drafter was trained on "
                         f"'{training_backend}' states (fla and torch states differ by ~1-3 % per layer)",
                         "re-extract with target.linear_attn_backend matching training, or pass --allow-backend-mismatch")
    embed = embed.to(device=dev, dtype=dt)
    head = head.to(device=dev, dtype=dt)

    n = len(reader) if not max_samples else min(max_samples, len(reader))
    if n == 0:
        raise InputError(cache_path, "n_samples", "the cache holds no sample", "re-run the prompts/completions stages")
    agreement, agreement_warnings = check_agreement([reader.argmax_agreement(i) for i in range(n)],
                                                    reader.sample_ids[:n], cache_path, agreement_warn, agreement_min,
                                                    allow_low_agreement)
    for line in agreement_warnings:
        log.warning("%s", line)
    lengths = [reader.length(i) for i in range(n)]
    order = sorted(range(n), key=lambda i: -lengths[i])  # similar lengths side by side
    results: dict[int, SampleResult] = {}
    t0 = time.perf_counter()
    n_comp = sum(lengths[i] - int(reader.sample_attrs(i)["prompt_len"]) for i in range(n))  # completion tokens
    bar = Progress(n_comp, "replay", logger=log)
    for b0 in range(0, n, batch_size):
        idx = order[b0 : b0 + batch_size]
        samples = [reader.sample(i, cfg.target_layer_ids) for i in idx]
        recs = replay_batch(drafter, embed, head, samples, block_size)
        for s, rec in zip(samples, recs):
            results[s.index] = SampleResult(s.sample_id, s.prompt_len, len(s.input_ids) - s.prompt_len, rec)
        bar.update(sum(len(s.input_ids) - s.prompt_len for s in samples))
        log.debug("replayed %d/%d samples", len(results), n)
    bar.close()
    elapsed = time.perf_counter() - t0
    B = int(block_size or cfg.block_size)
    per = [results[i] for i in range(n)]
    stats = aggregate([r.acceptance_lengths for r in per], B)
    if stats.n_samples == 0:
        raise InputError(cache_path, "samples", f"none of the {n} samples has a verify step (every response ended "
                         "at its first token), so tau is undefined", "check the completions (max_new_tokens, stop "
                         "tokens) of this prompt set")
    strip_info = {}
    if (drafter_dir / "strip_info.json").exists():
        strip_info = json.loads((drafter_dir / "strip_info.json").read_text())
    result = {
        "checkpoint": checkpoint_name or drafter_dir.name,
        "prompt_set": prompt_set or Path(cache_path).stem,
        "block_size": B,
        **stats.as_dict(),
        "step": strip_info.get("step"),
        "random_init": bool(strip_info.get("random_init", False)),
        "device": str(dev),
        "dtype": dtype_name(dt),
        "cache": {"path": str(cache_path), "dtype": a.get("dtype"), "target_sha256": a.get("target_sha256"),
                  "linear_attn_kernel": a.get("linear_attn_kernel")},
        "argmax_agreement": agreement,
        "target_check": target_check,
        "elapsed_s": round(elapsed, 3),
        "samples": [
            {"id": r.sample_id, "prompt_len": r.prompt_len, "n_tokens": r.n_tokens, "steps": r.steps,
             "tau": r.tau if r.steps else None, "acceptance_lengths": r.acceptance_lengths,
             "argmax_agreement": reader.argmax_agreement(i)}
            for i, r in enumerate(per)
        ],
    }
    reader.close()
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    log.info("evaluate %s on %s: tau %.4f over %d samples (%d verify steps, %.1f s, %.0f tok/s, %s %s)",
             result["checkpoint"], result["prompt_set"], stats.tau, stats.n_samples, stats.verify_steps, elapsed,
             n_comp / max(elapsed, 1e-9), dev, result["dtype"])
    return result
