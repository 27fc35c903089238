"""Stage ``evaluate`` (rule ``evaluate``): one drafter replayed over one prompt set's cache -> per-sample acceptance JSON.

Reads a stripped drafter folder (``strip_drafter``), the prompt set's hidden-state cache
(``hidden_states``) and the target's ``embed_tokens`` / ``lm_head``; checks that they belong
together (:mod:`dflash_eval.drafter.compat`: layers, widths, mask token, the cache's target fingerprint,
the linear-attention kernel, the completions' argmax agreement with the target); replays
speculative decoding offline (:mod:`dflash_eval.replay.anchors` / :mod:`dflash_eval.replay.chain` for the
chain, :mod:`dflash_eval.replay.ddtree` for every DDTree budget, all from one all-anchor drafter pass);
aggregates tau (:mod:`dflash_eval.replay.metrics`) and writes the JSON atomically. Options: config
section ``evaluate`` and ``target.training_backend`` (:mod:`dflash_eval.core.options`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_eval.core import options as options_mod
from dflash_eval.replay.anchors import chain_walk, context_bytes_per_token, iter_anchor_drafts, length_groups
from dflash_eval.cache.format import completion_sampling, final_hidden_index
from dflash_eval.cache.reader import CacheReader
from dflash_eval.drafter.compat import check_agreement, check_cache_target, check_compat
from dflash_eval.drafter.families import DrafterFamily, family_of
from dflash_eval.replay.ddtree import replay_with_trees, walk_budgets
from dflash_eval.drafter.model import NONFINITE_FIX, load_drafter
from dflash_eval.drafter.files import read_strip_info
from dflash_eval.drafter.rope import check_rope_length
from dflash_eval.core.errors import InputError
from dflash_eval.replay.expected import response_expectations, target_token_probs
from dflash_eval.replay.metrics import aggregate, aggregate_expected, selector_stats
from dflash_eval.core.progress import Progress
from dflash_eval.replay.chain import SampleResult, replay
from dflash_eval.data.provenance import stage_block, write_json
from dflash_eval.data.repetition import repeated_ngram_fraction
from dflash_eval.report.records import evaluate_records, records_path, write_records
from dflash_eval.core.runtime import dtype_name, free_memory_bytes, resolve_device, resolve_dtype
from dflash_eval.replay.policies import DraftSetting
from dflash_eval.replay.sampling import SamplingSetting
from dflash_eval.replay.selector import walks
from dflash_eval.target.spec import TargetSpec, load_embed_and_head
from dflash_eval.stages.strip_drafter import SHARED_EQUAL_NOTE

log = logging.getLogger(__name__)

STAGE = "evaluate"


def add_arguments(p) -> None:
    """Files of the stage and the switches that are not config options (``--help`` lists both)."""
    p.add_argument("--drafter", required=True, help="stripped drafter folder (config.json + model.safetensors)")
    p.add_argument("--cache", required=True, help="HDF5 hidden-state cache of one prompt set")
    p.add_argument("--target", required=True, help="target HF folder (embed_tokens and lm_head are read from it)")
    p.add_argument("--block-size", type=int, default=0, help="override the drafter's block size (0 = from its config; >= 2)")
    p.add_argument("--checkpoint-name", default=None, help="row label in the tau table (default: the drafter folder name)")
    p.add_argument("--prompt-set", default=None, help="row label in the tau table (default: the cache file stem)")
    p.add_argument("--allow-backend-mismatch", action="store_true",
                   help="evaluate even if the cache's linear-attention kernel differs from the drafter's training backend")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint' (the weights are not hashed again while it matches)")
    p.add_argument("--out", required=True, help="per-sample results JSON")
    p.add_argument("--out-records", default=None,
                   help="per-request records (default: <out>.records.parquet beside --out; dflash_eval.report.records)")
    p.add_argument("--run", default=None, help="the run's name, the records' run column (the workflow passes it)")


def main(args, opts) -> None:
    evaluate(args.drafter, args.cache, args.target, args.out, opts, block_size=args.block_size or None,
             checkpoint_name=args.checkpoint_name, prompt_set=args.prompt_set,
             allow_backend_mismatch=args.allow_backend_mismatch, target_fingerprint=args.target_fingerprint,
             out_records=args.out_records, run=args.run)


def evaluate(drafter_dir, cache_path, target_dir, out, opts=None, *, block_size: int | None = None,
             checkpoint_name: str | None = None, prompt_set: str | None = None,
             allow_backend_mismatch: bool = False, target_fingerprint: str | Path | None = None,
             out_records=None, run: str | None = None, **overrides) -> dict:
    """Replay one drafter over one cache and write per-sample acceptance as JSON.

    Args:
        drafter_dir: stripped drafter folder.
        cache_path: the prompt set's HDF5 cache (:mod:`dflash_eval.cache.format`).
        target_dir: target HF folder.
        out: output JSON path (written atomically).
        opts: the stage's options (:func:`dflash_eval.core.options.make`): ``max_samples`` (0 = all),
            ``batch_size`` (samples handled together; 0 = as many as fit the device's free memory,
            :func:`dflash_eval.core.runtime.free_memory_bytes`), ``replay`` (``'batched'``: all-anchor,
            :func:`dflash_eval.replay.anchors.replay_batched`; ``'sequential'``: the reference,
            :func:`dflash_eval.replay.chain.replay_batch`; same acceptance), ``ddtree_budgets`` (with
            ``'batched'`` the chain and every budget come from one all-anchor pass keeping the
            top-``max(budgets)`` log-probs per slot, :func:`dflash_eval.replay.ddtree.replay_with_trees`),
            ``device``, ``dtype``, the agreement thresholds and ``allow_*`` switches,
            ``training_backend``, ``sampling`` (the settings; temperature > 0 needs the cache's final
            normed hidden state and runs the batched pass), ``cross_temperature``.
        block_size: override of the drafter's block size (>= 2).
        checkpoint_name, prompt_set: row labels (default: the drafter folder name, the cache file stem).
        allow_backend_mismatch: evaluate a cache made with another linear-attention kernel.
        target_fingerprint: the ``target-fingerprint`` record (the weights are not hashed again).
        out_records: the per-request records (:func:`dflash_eval.report.records.evaluate_records` of the JSON, with
            each completion's repeated 8-gram fraction measured on the cached tokens); None: ``<out stem>.records.parquet``
            beside ``out`` (:func:`dflash_eval.report.records.records_path`).
        run: the records' ``run`` column (None: null).
        **overrides: option values, when ``opts`` is not given (``evaluate(..., device="cpu")``).

    Output JSON keys: ``checkpoint``, ``prompt_set``, ``block_size``, ``replay``, ``samples`` (``id``,
    ``prompt_len``, ``n_tokens``, ``max_new_tokens``, ``steps``, ``tau``, ``acceptance_lengths``,
    ``argmax_agreement``), the :class:`~dflash_eval.replay.metrics.AcceptanceStats` fields (``tau`` macro,
    ``tau_tokens_per_step`` micro, ``tau_sglang``, ``histogram``, ``slot_acceptance`` /
    ``slot_compared``, ``position_tau`` / ``position_steps``, ``n_samples``, ``n_skipped``, ``tau_se``, ...);
    what it ran with (``step``, ``random_init``, ``trained_max_len``: the drafter's
    :attr:`~dflash_eval.drafter.config.DrafterConfig.trained_max_len` or None, ``device``, ``dtype``, ``cache``); ``argmax_agreement``
    (:func:`~dflash_eval.drafter.compat.check_agreement`) and ``target_check``
    (:func:`~dflash_eval.drafter.compat.check_cache_target`). With DDTree budgets: ``ddtree_budgets``,
    ``ddtree_elapsed_s``, per sample ``acceptance_lengths_ddtree`` (``{"<B>": [...]}``) and
    ``ddtree`` (``{"<B>": aggregate}``). Always ``variant`` (``'dflash'`` / ``'dflash2'``) and
    ``ddtree_applicable`` (False for DFlash 2: no serving engine defines a tree over the selector's
    path, so its ``ddtree`` entries are None and no per-sample tree lists are written). DFlash 2
    also: ``selector`` (:class:`~dflash_eval.replay.metrics.SelectorStats` of the selector's chain, from
    one all-anchor pass in either replay mode), ``tau_oracle`` (a perfect selector over the same
    top-K candidates, on its own trajectory), ``tau_unary`` (the per-slot argmax of the same
    logits) and per sample ``acceptance_lengths_oracle`` / ``acceptance_lengths_unary``. Sampling
    (``opts.sampling``, one :class:`~dflash_eval.replay.sampling.SamplingSetting` each): ``sampling_settings``
    (``label``, ``temperature``, ``top_p``, ``top_k``, ``draft`` (the draft policies evaluated, :func:`draft_settings`),
    ``engines`` and ``vllm_draft_sample_method`` per policy (:mod:`dflash_eval.replay.policies`); label ``T0`` is
    the greedy replay above), ``completion_sampling`` (how the cache's completions were drawn),
    ``cross_temperature``, and ``expected`` ``{key: aggregate + samples}`` per setting with temperature > 0 and
    draft policy (key: the setting's label for the reference, ``<label>:<policy>`` otherwise,
    :attr:`dflash_eval.replay.policies.DraftSetting.label`): the expected acceptance of the policy's
    speculative sampler (the reference: dflash==0.1.0's) given the cached trajectories
    (:mod:`dflash_eval.replay.expected`, :func:`dflash_eval.replay.metrics.aggregate_expected`), per sample the
    :meth:`~dflash_eval.replay.expected.ResponseExpectation.as_dict` entry (None without a verify step).
    The chain and DDTree need no setting: under target sampling they are the greedy walks on the
    sampled cache. DFlash 2 at temperature > 0: the selector's own sampled path, q on its candidates
    (:func:`dflash_eval.replay.expected.selector_survival`); its selector diagnostics are those of the greedy path.
    ``provenance``: the block of :mod:`dflash_eval.data.provenance` (the evaluate settings, which summary compares
    with the config's; the sha256 of the target, the drafter's weights, the completions and the cache header).

    Raises:
        InputError: drafter/cache/target mismatch (layer ids not cached, hidden size, vocab, mask
            token, kernel backend); a cache of another target (unless ``allow_foreign_cache``);
            greedy completions that are not the target's greedy output (mean agreement below
            ``agreement_min``, unless ``allow_low_agreement``; sampled completions are not checked); an option the schema refuses; a block
            size of 1; nothing to replay (no sample with a verify step); a sampling setting the cache
            cannot serve (:func:`sampling_settings`).
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    if block_size is not None and block_size < 2:
        raise InputError(None, "--block-size", f"must be >= 2 (or 0 = the drafter's), got {block_size}",
                         "a block holds the last committed token and at least one mask")
    inputs = _Inputs.load(drafter_dir, cache_path, target_dir, opts, allow_backend_mismatch, target_fingerprint)
    try:
        B = int(block_size or inputs.drafter.cfg.block_size)
        check_rope_length(inputs.drafter.cfg, max(inputs.reader.length(i) for i in range(inputs.n)) + B - 2,
                          Path(inputs.drafter_dir) / "config.json")
        settings = sampling_settings(opts, inputs.reader.attrs, inputs.cache_path)
        sampled = draft_settings(opts, settings, inputs.drafter.family)
        expectations: dict[str, list] = {st.label: [] for st in sampled}
        repetition: dict[int, float] = {}
        results, trees, elapsed, tree_s, n_comp, walked = _replay_all(inputs, opts, B, sampled, expectations,
                                                                      repetition)
        result = _result(inputs, opts, B, results, trees, elapsed, tree_s, checkpoint_name, prompt_set)
        if walked:
            _add_selector(result, walked, B, inputs.n)
        _add_sampling(result, inputs.reader.attrs, settings, expectations, B, opts)
    finally:
        inputs.reader.close()
    strip_info = read_strip_info(inputs.drafter_dir)
    result["provenance"] = stage_block(STAGE, opts, {
        "target": result["cache"]["target_sha256"],
        "drafter_weights": (strip_info.get("sha256") or {}).get("model.safetensors"),
        "completions": result["cache"]["completions_sha256"], "cache_header": result["cache"]["header_sha256"]})
    write_json(out, result)
    write_records(out_records or records_path(out), *_records(result, run, repetition))
    log.info("evaluate %s on %s: tau %.4f over %d samples (%d verify steps, %.1f s, %.0f tok/s, %s %s, %s replay)",
             result["checkpoint"], result["prompt_set"], result["tau"], result["n_samples"], result["verify_steps"],
             elapsed, n_comp / max(elapsed, 1e-9), result["device"], result["dtype"], opts.replay)
    return result


@dataclass
class _Inputs:
    """What the stage reads, loaded and checked against each other (:meth:`load`)."""

    drafter_dir: Path
    cache_path: str
    drafter: object
    reader: CacheReader
    embed: torch.Tensor
    head: torch.Tensor
    n: int
    agreement: dict
    target_check: dict
    device: torch.device

    @classmethod
    def load(cls, drafter_dir, cache_path, target_dir, opts, allow_backend_mismatch, target_fingerprint) -> "_Inputs":
        dev = resolve_device(opts.device)
        dt = resolve_dtype(opts.dtype, dev)
        drafter_dir = Path(drafter_dir)
        drafter = load_drafter(drafter_dir, device=dev, dtype=dt)
        reader = open_cache(cache_path, dev)
        try:
            a = reader.attrs
            spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
            embed, head = load_embed_and_head(spec)
            check_compat(drafter.cfg, drafter_dir / "config.json", target=spec, embed_rows=embed.shape[0],
                         cache_attrs=a, cache_path=cache_path)
            target_check = check_cache_target(spec, a, cache_path, opts.allow_foreign_cache)
            if target_check["allowed_mismatch"]:
                log.warning("%s: extracted from another target (sha256 %s, given %s); evaluated anyway "
                            "(--allow-foreign-cache)", cache_path, target_check["cache_target_sha256"],
                            target_check["target_sha256"])
            _check_backend(a, cache_path, opts.training_backend, allow_backend_mismatch)
            n = len(reader) if not opts.max_samples else min(opts.max_samples, len(reader))
            if n == 0:
                raise InputError(cache_path, "n_samples", "the cache holds no sample",
                                 "re-run the prompts/completions stages")
            # sampled completions (T > 0) are not the target's argmax: the thresholds apply to greedy ones only
            greedy = float(completion_sampling(a)["temperature"]) == 0
            agreement, lines = check_agreement([reader.argmax_agreement(i) for i in range(n)], reader.sample_ids[:n],
                                               cache_path, opts.agreement_warn if greedy else 0.0,
                                               opts.agreement_min if greedy else 0.0, opts.allow_low_agreement)
            for line in lines:
                log.warning("%s", line)
        except BaseException:
            reader.close()
            raise
        return cls(drafter_dir, str(cache_path), drafter, reader, embed.to(device=dev, dtype=dt),
                   head.to(device=dev, dtype=dt), n, agreement, target_check, dev)


def _check_backend(attrs: dict, cache_path, training_backend: str, allow_mismatch: bool) -> None:
    """Refuse a cache whose linear-attention kernel differs from the one the drafter was trained on."""
    cache_backend = json.loads(attrs.get("linear_attn_kernel", "{}") or "{}").get("backend", "none")
    if training_backend not in ("unknown", cache_backend) and cache_backend != "none" and not allow_mismatch:
        raise InputError(cache_path, "linear_attn_kernel",
                         f"cache made with the '{cache_backend}' kernel but the drafter was trained on "
                         f"'{training_backend}' states (fla and torch states differ by ~1-3 % per layer)",
                         "re-extract with target.linear_attn_backend matching training, or pass --allow-backend-mismatch")


def _replay_all(inputs: _Inputs, opts, B: int, sampled=(), expectations=None, repetition=None):
    """Replay every sample (longest first, in memory-sized groups); returns per-index results and trees.

    With ``sampled`` settings (temperature > 0; DFlash 1) the chain, every DDTree budget and every setting's
    expectation come from one all-anchor pass (:func:`_sampled_pass`); ``expectations[label]`` gets
    ``(index, ResponseExpectation | None)`` per sample; ``repetition[index]`` the repeated 8-gram fraction of each
    sample's cached completion (:func:`dflash_eval.data.repetition.repeated_ngram_fraction`)."""
    reader, drafter, n = inputs.reader, inputs.drafter, inputs.n
    cfg = drafter.cfg
    budgets = sorted({int(b) for b in opts.ddtree_budgets})
    lengths = [reader.length(i) for i in range(n)]
    order = sorted(range(n), key=lambda i: -lengths[i])  # similar lengths side by side
    mem = free_memory_bytes(inputs.device)
    # samples read from the cache at a time: what one batched group / sequential batch holds
    per_token = context_bytes_per_token(cfg, torch.finfo(inputs.embed.dtype).bits // 8)
    read_tokens = max(1, mem // 4 // per_token)
    if budgets and not drafter.family.ddtree_applicable:
        # info, not a warning: a run that evaluates DFlash 1 and DFlash 2 checkpoints (the demo) configures budgets
        # for the former; tau.csv's ddtree_applicable column says it per row
        log.info("DDTree budgets %s not applicable to the %s drafter %s: no serving engine builds a tree over its "
                 "drafts; chain only", budgets, drafter.family.label, inputs.drafter_dir)
        budgets = []
    results: dict[int, SampleResult] = {}
    trees: dict[int, dict[int, list[int]]] = {}
    walked: dict = {}  # DFlash 2: per sample index, selector_replay.Dflash2Walks
    tree_s = 0.0
    t0 = time.perf_counter()
    n_comp = sum(lengths[i] - int(reader.sample_attrs(i)["prompt_len"]) for i in range(n))  # completion tokens
    bar = Progress(n_comp, "replay", logger=log)
    for group in length_groups([lengths[i] for i in order], read_tokens, opts.batch_size):
        t1 = time.perf_counter()
        try:
            if sampled:  # chain, every budget (DFlash 1) or the selector diagnostics (DFlash 2), every setting: one pass
                samples, recs, tr = _sampled_pass(inputs, opts, B, [order[g] for g in group], budgets, mem, sampled,
                                                  expectations, walked)
                trees.update({s.index: t for s, t in zip(samples, tr)})
            else:
                samples, recs = _greedy_group(inputs, opts, B, [order[g] for g in group], budgets, mem, trees, walked)
        except torch.cuda.OutOfMemoryError as err:
            raise _too_large(inputs, [order[g] for g in group], lengths) from err
        tree_s += time.perf_counter() - t1 if budgets else 0.0
        if drafter.take_nonfinite():
            raise InputError(Path(inputs.drafter_dir) / "model.safetensors", None, "the drafter's states are not "
                             f"finite (NaN or inf) in its forward pass over samples {[s.sample_id for s in samples][:3]}"
                             "...: weights that overflow (a diverged checkpoint; finite weights can) or a config value "
                             "that breaks a norm; every draft would be rejected (tau 1.0)", NONFINITE_FIX)
        for s, rec in zip(samples, recs):
            results[s.index] = SampleResult(s.sample_id, s.prompt_len, len(s.input_ids) - s.prompt_len, rec,
                                            s.max_new_tokens)
            if repetition is not None:
                repetition[s.index] = repeated_ngram_fraction(s.input_ids[s.prompt_len:].tolist())
        bar.update(sum(len(s.input_ids) - s.prompt_len for s in samples))
        log.debug("replayed %d/%d samples", len(results), n)
    bar.close()
    return results, trees, time.perf_counter() - t0, tree_s, n_comp, walked


def _too_large(inputs: _Inputs, indices: list[int], lengths: list[int]) -> InputError:
    """The error of a replay group that ran out of device memory: names its longest sample and the fixes."""
    big = max(indices, key=lambda i: lengths[i])
    sid = inputs.reader.sample_ids[big]
    group = f" (in a group of {len(indices)} samples)" if len(indices) > 1 else ""
    return InputError(inputs.cache_path, f"id {sid}", f"the replay of the sample {sid!r} of {lengths[big]:,} tokens"
                      f"{group} ran out of memory on {inputs.device}",
                      "set evaluate.batch_size: 1 (one sample at a time), or leave such samples out of the prompt set "
                      "(a lower prompt_set.max_prompt_tokens or prompt_sets.<set>.max_prompt_tokens); nothing of this "
                      "job was written, so the rerun replays every sample")


def _greedy_group(inputs: _Inputs, opts, B: int, indices: list[int], budgets: list[int], mem: int, trees: dict,
                  walked: dict):
    """The greedy replay of the samples ``indices``: ``(samples, chains)``; fills ``trees`` (DDTree budgets) and
    ``walked`` (DFlash 2's selector walks)."""
    reader, drafter = inputs.reader, inputs.drafter
    # verified while read and replayed: the checks run in threads beside the device's work, and leaving the
    # block raises the first bad sample's error before any result of this group is kept
    with reader.verified_samples(indices, drafter.cfg.target_layer_ids) as samples:
        return samples, _greedy_replay(inputs, opts, B, samples, budgets, mem, trees, walked)


def _greedy_replay(inputs: _Inputs, opts, B: int, samples, budgets: list[int], mem: int, trees: dict, walked: dict):
    """The chains of ``samples`` (see :func:`_greedy_group`); fills ``trees`` and ``walked``."""
    drafter = inputs.drafter
    if budgets:  # one all-anchor pass with the top-max(budgets) log-probs: chain + every budget's tree
        both = replay_with_trees(drafter, inputs.embed, inputs.head, samples, budgets, B, mem, opts.batch_size)
        for s, (_, tr) in zip(samples, both):
            trees[s.index] = tr
    if drafter.family.selects_candidates:  # one all-anchor pass: the walk's chain, the oracle and unary chains, the diagnostics
        for s, d in zip(samples, iter_anchor_drafts(drafter, inputs.embed, inputs.head, samples, B,
                                                    memory_bytes=mem, max_group_samples=opts.batch_size)):
            walked[s.index] = _selector_walks(d)
    if budgets and opts.replay == "batched":
        return [chain for chain, _ in both]
    if drafter.family.selects_candidates and opts.replay == "batched":
        return [walked[s.index].chain for s in samples]
    return replay(drafter, inputs.embed, inputs.head, samples, B, opts.replay, mem, opts.batch_size)


def _selector_walks(d):
    """DFlash 2's chains and diagnostics of one sample's all-anchor drafts (:func:`dflash_eval.replay.selector.walks`)."""
    return walks(d.accepted.tolist(), d.oracle.tolist(), d.unary_accepted.tolist(), d.limit.tolist(),
                 d.in_candidates.tolist(), d.prompt_len, d.n_tokens)


def open_cache(cache_path, dev: torch.device) -> CacheReader:
    """The verified reader of ``cache_path`` for a replay on ``dev``: on a CUDA device an FP8 cache's stored bytes
    (half of bf16's) cross to it and are dequantised there (``CacheReader(dequant_device=...)``, 0.55x bf16's read
    time on an H100: docs/measurements.md, "FP8 caches"); on the CPU they are dequantised on the host."""
    return CacheReader(cache_path, dequant_device=dev if dev.type == "cuda" else None)


def sampling_settings(opts, cache_attrs: dict, cache_path) -> list[SamplingSetting]:
    """``evaluate.sampling`` as settings, checked against the cache.

    Raises:
        InputError: a setting at a temperature, or with a top-p / top-k, other than those the cache's
            completions were drawn at (``completion_sampling``, :mod:`dflash_eval.cache.format`) unless
            ``cross_temperature``; a temperature > 0 on a cache without the final normed hidden state (the target's p).
    """
    settings = [SamplingSetting(float(e.get("temperature", 0)), float(e.get("top_p", 1.0)), int(e.get("top_k", 0)))
                for e in opts.sampling]
    drawn = completion_sampling(cache_attrs)
    for st in settings:
        same = (float(drawn["temperature"]), float(drawn.get("top_p", 1.0)), int(drawn.get("top_k", 0))) == (
            st.temperature, st.top_p, st.top_k)
        if float(drawn["temperature"]) == st.temperature and not st.greedy and not same and not opts.cross_temperature:
            raise InputError(cache_path, "completion_sampling",
                             f"completions drawn at {_drawn_label(drawn)}, but evaluate.sampling asks for {st.label}: "
                             "the expectation is exact only on trajectories drawn at the setting's temperature, "
                             "top-p and top-k",
                             f"add a prompt set drawn at {st.label} (prompt_sets.<name>.sampling), evaluate "
                             f"{_drawn_label(drawn)} on this set, or set evaluate.cross_temperature: true (rows then "
                             "are marked as not an expectation)")
        if float(drawn["temperature"]) != st.temperature and not opts.cross_temperature:
            raise InputError(cache_path, "completion_sampling",
                             f"completions drawn at temperature {drawn['temperature']:g}, but evaluate.sampling "
                             f"asks for {st.label} (the expectation holds on trajectories drawn at its temperature)",
                             "evaluate this cache at its completions' temperature, or set "
                             "evaluate.cross_temperature: true (rows then name the trajectory)")
        if not st.greedy and final_hidden_index(cache_attrs) is None:
            raise InputError(cache_path, "target_layer_ids",
                             f"{st.label} needs the target's probabilities, but the cache (format "
                             f"{cache_attrs.get('format_version')}) holds no final normed hidden state",
                             "set cache.final_hidden: true and rerun (re-extracts the cache with the last layer), "
                             "or evaluate temperature 0 only")
    return settings


def _drawn_label(drawn: dict) -> str:
    return SamplingSetting(float(drawn["temperature"]), float(drawn.get("top_p", 1.0)), int(drawn.get("top_k", 0))).label


def draft_settings(opts, settings: list[SamplingSetting], family: DrafterFamily) -> list[DraftSetting]:
    """Every (setting, draft policy) evaluated above temperature 0, in the configured order: each
    ``evaluate.sampling`` entry's ``draft`` list, or every policy that applies to the drafter's ``family``
    (:meth:`dflash_eval.drafter.families.DrafterFamily.draft_policies`).

    Raises:
        InputError: a policy that does not apply to the family (:meth:`~dflash_eval.drafter.families.DrafterFamily.check_policy`).
    """
    out = []
    for i, (entry, st) in enumerate(zip(opts.sampling, settings)):
        if st.greedy:
            continue
        policies = entry.get("draft") or family.draft_policies(st)
        for pol in policies:
            family.check_policy(st, pol, None, f"evaluate.sampling[{i}]")
            out.append(DraftSetting(st, pol))
    return out


def _sampled_pass(inputs: _Inputs, opts, B: int, indices: list[int], budgets: list[int], mem: int, sampled,
                  expectations: dict, walked: dict):
    """One all-anchor pass over the samples ``indices``: the chain, every DDTree budget (greedy walks on the
    cache: DDTree under target sampling, :mod:`dflash_eval.replay.expected`), DFlash 2's selector walks (into
    ``walked``) and every sampled setting's expectation. Returns ``(samples, chains, trees)``."""
    reader, drafter = inputs.reader, inputs.drafter
    layers = list(drafter.cfg.target_layer_ids)
    final = reader.layer_ids[final_hidden_index(reader.attrs)]
    samples, p_tokens = [], []
    for i in indices:
        s = reader.sample(i, layers + [final])
        fh = s.hidden[:, -1].to(device=inputs.device, dtype=inputs.embed.dtype)
        p_tokens.append(target_token_probs(fh, inputs.head, s.input_ids, list({d.setting: 0 for d in sampled})))
        samples.append(dataclasses.replace(s, hidden=s.hidden[:, :-1]))
    if opts.replay != "batched":
        log.warning("evaluate.replay %s: temperature > 0 uses the batched all-anchor pass (same chain)", opts.replay)
    chains, trees = [], []
    for s, d in zip(samples, iter_anchor_drafts(drafter, inputs.embed, inputs.head, samples, B,
                                                topk=budgets[-1] if budgets else 0, memory_bytes=mem,
                                                max_group_samples=opts.batch_size, sampling=sampled,
                                                p_tokens=p_tokens)):
        chains.append(chain_walk(d.accepted.tolist(), d.prompt_len, d.n_tokens))
        if d.oracle is not None:  # DFlash 2
            walked[s.index] = _selector_walks(d)
        trees.append(walk_budgets(d.topk_logp.cpu(), d.topk_ids.cpu(), s.input_ids, s.prompt_len, s.max_new_tokens,
                                  B, budgets) if budgets and len(d.anchors) else {b: [] for b in budgets})
        for st in sampled:
            if len(d.anchors) == 0:
                expectations[st.label].append((s.index, None))
                continue
            surv = d.survival[st.label].cpu()
            expectations[st.label].append(
                (s.index, response_expectations([surv], [d.prompt_len], [d.n_tokens], B)[0]))
    return samples, chains, trees


def _add_sampling(result: dict, cache_attrs: dict, settings, expectations: dict, B: int, opts) -> None:
    """The output's sampling part (see :func:`evaluate`): ``sampling_settings``, ``completion_sampling``,
    ``cross_temperature`` and per sampled setting ``expected`` (aggregate + per-sample expectations)."""
    n = len(result["samples"])
    family = family_of(result.get("variant"))
    policies: dict[str, list[str]] = {}
    for d in expectations_order(expectations):
        policies.setdefault(d[0], []).append(d[1])
    result["sampling_settings"] = [
        {"label": st.label, "temperature": st.temperature, "top_p": st.top_p, "top_k": st.top_k,
         "draft": policies.get(st.label, ["reference"]),
         "engines": {p: family.engine_settings(st, p) for p in policies.get(st.label, ["reference"])},
         "vllm_draft_sample_method": {p: family.vllm_draft_sample_method(st, p)
                                      for p in policies.get(st.label, ["reference"])}}
        for st in settings]
    result["completion_sampling"] = completion_sampling(cache_attrs)
    result["cross_temperature"] = bool(opts.cross_temperature)
    lens = [row["prompt_len"] for row in result["samples"]]
    result["expected"] = {}
    for label, pairs in expectations.items():
        per = dict(pairs)
        resp = [per.get(i) for i in range(n)]
        stats = aggregate_expected(resp, B, lens)
        result["expected"][label] = {**stats.as_dict(),
                                     "samples": [r.as_dict() if r is not None else None for r in resp]}
        log.info("expected tau at %s (given the cached trajectories): %.4f", label, stats.tau)


def expectations_order(expectations: dict) -> list[tuple[str, str]]:
    """``(setting label, policy)`` of each key of ``expectations`` (:attr:`DraftSetting.label`), in order."""
    return [(k.split(":")[0], k.split(":")[1] if ":" in k else "reference") for k in expectations]


def _result(inputs: _Inputs, opts, B: int, results, trees, elapsed, tree_s, checkpoint_name, prompt_set) -> dict:
    """The output JSON (see :func:`evaluate`)."""
    reader, n = inputs.reader, inputs.n
    a = reader.attrs
    per = [results[i] for i in range(n)]
    stats = aggregate([r.acceptance_lengths for r in per], B)
    if stats.n_samples == 0:
        raise InputError(inputs.cache_path, "samples", f"none of the {n} samples has a verify step (every response "
                         "ended at its first token), so tau is undefined", "check the completions (max_new_tokens, "
                         "stop tokens) of this prompt set")
    strip_info = read_strip_info(inputs.drafter_dir)  # its step labels the row
    result = {
        "checkpoint": checkpoint_name or inputs.drafter_dir.name,
        "prompt_set": prompt_set or str(a.get("prompt_set") or Path(inputs.cache_path).stem),
        "block_size": B,
        **stats.as_dict(),
        "step": strip_info.get("step"),
        "random_init": bool(strip_info.get("random_init", False)),
        "trained_max_len": inputs.drafter.cfg.trained_max_len,  # the report marks prompts beyond it
        # what strip noted that needs a look (layer types derived, large weights, ...): the report lists them
        "drafter_notes": [n for n in strip_info.get("notes") or [] if not str(n).endswith(SHARED_EQUAL_NOTE)],
        "device": str(inputs.device),
        "dtype": dtype_name(inputs.embed.dtype),
        "replay": opts.replay,
        "cache": {"path": inputs.cache_path, "dtype": a.get("dtype"), "target_sha256": a.get("target_sha256"),
                  "linear_attn_kernel": a.get("linear_attn_kernel"), "completions_sha256": a.get("completions_sha256"),
                  "header_sha256": a.get("header_sha256")},
        "argmax_agreement": inputs.agreement,
        "target_check": inputs.target_check,
        "elapsed_s": round(elapsed, 3),
        "samples": [
            {"id": r.sample_id, "prompt_len": r.prompt_len, "n_tokens": r.n_tokens, "max_new_tokens": r.max_new_tokens,
             "steps": r.steps, "tau": r.tau if r.steps else None, "acceptance_lengths": r.acceptance_lengths,
             "argmax_agreement": reader.argmax_agreement(i)}
            for i, r in enumerate(per)
        ],
    }
    budgets = sorted({int(b) for b in opts.ddtree_budgets})
    result["variant"] = inputs.drafter.family.name
    result["ddtree_applicable"] = inputs.drafter.family.ddtree_applicable
    if budgets and not result["ddtree_applicable"]:
        result["ddtree_budgets"] = budgets
        result["ddtree"] = {str(b): None for b in budgets}
    elif budgets:
        result["ddtree_budgets"] = budgets
        # the shared all-anchor pass + the tree walks (batched: the chain's time too); included in elapsed_s
        result["ddtree_elapsed_s"] = round(tree_s, 3)
        result["ddtree"] = {str(b): aggregate([trees[i][b] for i in range(n)], B).as_dict() for b in budgets}
        for i, row in enumerate(result["samples"]):
            row["acceptance_lengths_ddtree"] = {str(b): trees[i][b] for b in budgets}
        log.info("DDTree tau by node budget: %s", {b: round(result["ddtree"][str(b)]["tau"], 3) for b in budgets})
    return result


def _records(result: dict, run: str | None, repetition: dict) -> tuple:
    """The per-request records and job object of the output ``result`` (:func:`dflash_eval.report.records.evaluate_records`)."""
    df, job = evaluate_records(result, run, repetition)
    return df, [job]


def _add_selector(result: dict, walked: dict, B: int, n: int) -> None:
    """DFlash 2: the selector diagnostics, ``tau_oracle`` / ``tau_unary`` and their per-sample chains (see :func:`evaluate`)."""
    per = [walked[i] for i in range(n)]
    result["selector"] = selector_stats([st for w in per for st in w.steps], B).as_dict()
    result["tau_oracle"] = aggregate([w.oracle for w in per], B).tau
    result["tau_unary"] = aggregate([w.unary for w in per], B).tau
    for row, w in zip(result["samples"], per):
        row["acceptance_lengths_oracle"] = w.oracle
        row["acceptance_lengths_unary"] = w.unary
