"""Stage ``engine_parity`` (rule ``engine_parity``): the run's cache against the other hidden-state source.

Fidelity across engines. ``cache.source`` fills a run's caches through transformers (``hf``) or through
a vLLM server in extract mode (``vllm``, :mod:`dflash_eval.serving.vllm.states`). On the first ``n_samples``
completions of one prompt set, :func:`engine_parity` extracts a temporary cache with the *other*
source. It uses the hidden_states stage's own dispatch
(:func:`dflash_eval.stages.hidden_states.extract_cache`) with the run's ``cache`` settings: the same
layers, ``final_hidden``, dtype and batching, and ``cache.vllm`` for the vLLM side. Then:

* It compares that cache with the run's cache of the prompt set. Per stored layer over all tokens it
  reports the kernel-parity statistics (:class:`dflash_eval.stages.kernel_parity.Parity`): ``cos_mean``
  and ``cos_min`` (per-token cosine), ``rel_l2`` = ``||vLLM - HF||_2 / ||HF||_2`` (Frobenius over tokens x
  hidden) and ``max_abs`` (units of the hidden state). Per sample it reports the same ``rel_l2`` per
  layer and the fraction of positions whose target argmax agrees. The token ids and prompt lengths must
  be equal, or the stage refuses.
* It replays each selected drafter on both caches (:func:`dflash_eval.stages.evaluate.evaluate`, the
  greedy chain). Per sample it reports tau on each, their difference (vLLM - HF) and whether the
  acceptance lists are identical. It also reports the macro tau on each (the mean over samples, as in
  tau.csv) and its difference.

HF is the reference of ``rel_l2`` and of every difference, whichever source the run uses. In float32 on
CPU the two sources agree to rounding (rel-L2 ~1e-6 per layer, the same tau: ``tests/serving/test_vllm_states.py``);
anything larger is what this stage exists to show. Output: JSON with ``title`` and ``markdown`` (picked up
by ``report --extra``) and the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from dflash_eval.core import options as options_mod
from dflash_eval.cache.reader import CacheReader
from dflash_eval.data.completions import read_completions, subset_text
from dflash_eval.core.errors import InputError
from dflash_eval.data.provenance import stage_block, write_json
from dflash_eval.stages.evaluate import evaluate
from dflash_eval.stages.hidden_states import extract_cache
from dflash_eval.stages.kernel_parity import Parity

STAGE = "engine_parity"
SOURCES = ("hf", "vllm")
LABEL = {"hf": "HF", "vllm": "vLLM"}

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--completions", required=True, help="completions JSONL of the prompt set; its first n_samples "
                                                        "rows are extracted again")
    p.add_argument("--cache", required=True, help="the run's HDF5 cache of the same prompt set (made by cache.source)")
    p.add_argument("--layer-ids", type=lambda t: [int(x) for x in t.split(",") if x], required=True,
                   help="comma-separated 0-based decoder layers, as the run's cache was extracted with")
    p.add_argument("--drafter", nargs="*", default=[], help="stripped drafter folders replayed on both caches")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint' (the weights are not hashed again while it matches)")
    p.add_argument("--server-log", default=None,
                   help="the job-owned vLLM server's log, when the other source is vllm (default <out>.vllm.log)")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the numbers")


def main(args, opts) -> None:
    engine_parity(args.target, args.completions, args.cache, args.layer_ids, args.out, opts, drafters=args.drafter,
                  target_fingerprint=args.target_fingerprint, server_log=args.server_log)


def other_source(source: str) -> str:
    """``vllm`` for ``hf`` and ``hf`` for ``vllm``.

    Raises:
        InputError: another value.
    """
    if source not in SOURCES:
        raise InputError("config", "cache.source", f"unknown value {source!r}", "use hf or vllm")
    return "vllm" if source == "hf" else "hf"


def cache_source(attrs: dict) -> str:
    """The source a cache was written by: ``vllm`` when its ``engine`` attribute says so, else ``hf``
    (caches from the HF path carry no ``engine``: docs/serving-engines.md, provenance)."""
    return "vllm" if attrs.get("engine") == "vllm" else "hf"


def extraction_options(opts, source: str):
    """The ``hidden_states`` stage's options for ``source``: this stage's options without ``n_samples``."""
    values = dataclasses.asdict(opts)
    values.pop("n_samples")
    values["source"] = source
    return options_mod.make("hidden_states", values)


def compare_caches(hf: CacheReader, vllm: CacheReader, n: int) -> dict:
    """vLLM vs HF states of the first ``n`` samples of two caches, per layer and per sample (float64 on CPU).

    Args:
        hf, vllm: open readers of two caches of the same completions (the HF one is the reference).
        n: samples compared (the first ``n`` of each).

    Returns:
        ``{"layers": [...], "samples": [...], "n_tokens", "argmax_agreement", "ids_identical"}``. ``layers``: per
        stored layer :meth:`Parity.rows` (``layer``, ``cos_mean``, ``cos_min``, ``rel_l2``, ``max_abs``) plus
        ``rel_l2_max_sample`` (the largest per-sample rel-L2). ``samples``: per sample ``id``, ``n_tokens``,
        ``rel_l2`` (per layer, cache order), ``max_abs`` (per layer) and ``argmax_agreement`` (fraction of
        positions whose target argmax is equal). ``argmax_agreement``: the same over all tokens.

    Raises:
        InputError: fewer than ``n`` samples, other sample ids, stored layers, token ids or prompt lengths.
    """
    if hf.layer_ids != vllm.layer_ids:
        raise InputError(hf.path, "target_layer_ids", f"{hf.layer_ids} here, {vllm.layer_ids} in {vllm.path}",
                         "extract both with the same cache.target_layer_ids and cache.final_hidden")
    ids = hf.sample_ids[:n], vllm.sample_ids[:n]
    if len(ids[0]) < n or ids[0] != ids[1]:
        raise InputError(hf.path, "sample_ids", f"its first {n} samples {ids[0]} are not those of {vllm.path} "
                         f"({ids[1]})", "extract both caches from the same completions file")
    par = Parity(len(hf.layer_ids))
    samples, agree = [], 0
    for i in range(n):
        a, b = hf.sample(i), vllm.sample(i)
        if not torch.equal(a.input_ids, b.input_ids) or a.prompt_len != b.prompt_len:
            raise InputError(hf.path, f"samples/{i:06d}/input_ids", f"sample {a.sample_id}: token ids or prompt "
                             f"length differ from {vllm.path}", "extract both caches from the same completions file")
        par.add(b.hidden, a.hidden)  # A = vLLM, B = HF: rel-L2 relative to HF
        x, y = a.hidden.detach().cpu().double(), b.hidden.detach().cpu().double()
        d = y - x
        rel = (d.pow(2).sum((0, 2)) / x.pow(2).sum((0, 2))).sqrt()
        same = int((a.target_argmax == b.target_argmax).sum())
        agree += same
        samples.append({"id": a.sample_id, "n_tokens": len(a.input_ids), "rel_l2": [float(v) for v in rel],
                        "max_abs": [float(v) for v in d.abs().amax((0, 2))],
                        "argmax_agreement": same / max(len(a.input_ids), 1)})
    layers = par.rows(list(hf.layer_ids))
    for k, row in enumerate(layers):
        row["rel_l2_max_sample"] = max((s["rel_l2"][k] for s in samples), default=0.0)
    return {"layers": layers, "samples": samples, "n_tokens": par.n_tok, "ids_identical": True,
            "argmax_agreement": agree / max(par.n_tok, 1)}


def drafter_parity(checkpoint: str, ev_hf: dict, ev_vllm: dict) -> dict:
    """Tau of one drafter on the HF and the vLLM cache, per sample and macro, from two ``evaluate`` results.

    Returns:
        ``checkpoint``; ``tau_hf``, ``tau_vllm`` (the macro tau of each: mean over samples with a verify
        step), ``diff`` = ``tau_vllm - tau_hf``; ``max_abs_sample_diff``; ``n_samples``;
        ``n_same_acceptance`` (samples whose acceptance lists are identical); ``samples``: per sample ``id``,
        ``tau_hf``, ``tau_vllm``, ``diff`` (None where a sample has no verify step), ``same_acceptance``.

    Raises:
        InputError: the two results hold other samples.
    """
    a, b = ev_hf["samples"], ev_vllm["samples"]
    if [s["id"] for s in a] != [s["id"] for s in b]:
        raise InputError(ev_hf.get("cache", {}).get("path"), "samples", "the two evaluations hold other samples",
                         "evaluate both caches with the same max_samples")
    per = []
    for x, y in zip(a, b):
        diff = y["tau"] - x["tau"] if x["tau"] is not None and y["tau"] is not None else None
        per.append({"id": x["id"], "tau_hf": x["tau"], "tau_vllm": y["tau"], "diff": diff,
                    "same_acceptance": x["acceptance_lengths"] == y["acceptance_lengths"]})
    return {"checkpoint": checkpoint, "tau_hf": ev_hf["tau"], "tau_vllm": ev_vllm["tau"],
            "diff": ev_vllm["tau"] - ev_hf["tau"],
            "max_abs_sample_diff": max((abs(p["diff"]) for p in per if p["diff"] is not None), default=0.0),
            "n_samples": len(per), "n_same_acceptance": sum(p["same_acceptance"] for p in per), "samples": per}


def _provenance(attrs: dict) -> dict:
    keys = ("dtype", "batching", "device_name", "engine", "engine_version", "engine_launch", "linear_attn_backend")
    return {k: attrs[k] for k in keys if k in attrs}


def engine_parity(target_dir, completions_path, cache_path, layer_ids: list[int], out, opts=None, *, drafters=(),
                  target_fingerprint=None, server_log=None, **overrides) -> dict:
    """Extract ``n_samples`` completions with the other source, compare with the run's cache, replay drafters on both.

    Args:
        target_dir: HF target folder.
        completions_path: the prompt set's completions JSONL; its first ``n_samples`` rows are extracted.
        cache_path: the run's cache of that prompt set, written by ``cache.source`` (its first ``n_samples``
            samples must be those rows).
        layer_ids: 0-based decoder layers the run's cache was extracted with (``cache.final_hidden`` adds the
            last one, as in the hidden_states stage).
        out: JSON path. Keys: ``title``, ``markdown``, ``run_source`` (``cache.source``), ``other_source``,
            ``target``, ``prompt_set``, ``n_samples``, ``n_tokens``, ``layers`` / ``samples`` /
            ``argmax_agreement`` / ``ids_identical`` (:func:`compare_caches`; each layer also has ``type``),
            ``caches`` (per source: dtype, batching, device, engine provenance), ``extraction`` (the other
            source's ``seconds`` and ``tokens_per_s``, model load or server start included), ``drafters``
            (:func:`drafter_parity` per drafter).
        opts: the stage's options (config ``engine_parity.n_samples``, >= 1; section ``cache`` and
            ``target.linear_attn_backend`` / ``devices`` / ``max_memory``, as for the hidden_states stage; the
            drafters are replayed on ``cache.device``).
        drafters: stripped drafter folders (their layers must be cached).
        target_fingerprint: a ``target-fingerprint`` record (the weights are not hashed again).
        server_log: the job-owned vLLM server's log when the other source is vllm (default ``<out>.vllm.log``).
        **overrides: option values, when ``opts`` is not given.

    Raises:
        InputError: the run's cache was written by another source than ``cache.source``; the caches do not
            hold the same samples (:func:`compare_caches`); what the extraction or ``evaluate`` raises (bad
            completions, layers, drafter/target mismatches, a vLLM server not in extract mode).
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    run_source = opts.source
    other = other_source(run_source)
    completions_path, cache_path, out = Path(completions_path), Path(cache_path), Path(out)
    with CacheReader(cache_path) as rd:
        got = cache_source(rd.attrs)
    if got != run_source:
        raise InputError(cache_path, "engine", f"the cache comes from source {got}, but cache.source is {run_source}",
                         "re-extract it (snakemake -R hidden_states), or set cache.source to the source it was made with")
    rows = read_completions(completions_path)[: opts.n_samples]
    result: dict = {"title": "Engine parity: vLLM vs HF hidden states", "run_source": run_source,
                    "other_source": other, "target": Path(target_dir).name, "prompt_set": completions_path.stem,
                    "n_samples": len(rows), "drafters": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".engine_parity.", dir=out.parent) as tmp:
        tmp = Path(tmp)
        sub = tmp / f"{completions_path.stem}.jsonl"  # same stem: the cache's prompt_set attribute
        sub.write_text(subset_text(rows), encoding="utf-8")
        t0 = time.perf_counter()
        made = extract_cache(target_dir, sub, tmp / f"{other}.h5", layer_ids, extraction_options(opts, other),
                             target_fingerprint=target_fingerprint, server_log=server_log or f"{out}.vllm.log")
        secs = time.perf_counter() - t0
        n_tok = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
        result["extraction"] = {"source": other, "seconds": round(secs, 3), "tokens_per_s": round(n_tok / secs, 1)}
        caches = {run_source: cache_path, other: Path(made)}
        with CacheReader(caches["hf"]) as hf, CacheReader(caches["vllm"]) as vl:
            result.update(compare_caches(hf, vl, len(rows)))
            types = json.loads(hf.attrs.get("layer_types") or "[]")
            result["caches"] = {"hf": _provenance(hf.attrs), "vllm": _provenance(vl.attrs)}
        for r in result["layers"]:
            r["type"] = types[r["layer"]] if r["layer"] < len(types) else None  # None: the target lists no layer types
        for d in drafters:
            ev = {src: evaluate(d, caches[src], target_dir, tmp / f"eval_{src}.json", device=opts.device,
                                max_samples=len(rows), ddtree_budgets=[], cross_temperature=True,
                                allow_backend_mismatch=True, allow_low_agreement=True,
                                target_fingerprint=target_fingerprint)
                  for src in SOURCES}
            # the chain walk at temperature 0 on both (cross_temperature: also on sampled completions, where
            # it is the greedy-draft walk of the cached trajectory); low agreement or another kernel label
            # is what this report shows, not a refusal
            result["drafters"].append(drafter_parity(Path(d).name, ev["hf"], ev["vllm"]))
    result["markdown"] = _markdown(result)
    result["provenance"] = stage_block(STAGE, opts)
    result.update(write_json(out, result))
    for line in result["markdown"].splitlines():
        log.info("%s", line)
    return result


def _markdown(r: dict) -> str:
    other = LABEL[r["other_source"]]
    c = r["caches"]
    vinfo = f"vLLM {c['vllm'].get('engine_version', '?')}"
    lines = [f"The run's caches come from **{LABEL[r['run_source']]}** (`cache.source: {r['run_source']}`); the first "
             f"{r['n_samples']} completions of `{r['prompt_set']}`",
             f"({r['n_tokens']} tokens) were extracted again with **{other}** and compared with the run's cache of "
             f"that set. Target `{r['target']}`;",
             f"HF {c['hf'].get('dtype', '?')} on {c['hf'].get('device_name', '?')} ({c['hf'].get('batching', '?')}), "
             f"{vinfo} {c['vllm'].get('dtype', '?')}; {other} extraction {r['extraction']['seconds']:.1f} s "
             "(model load or server start, if any, included).",
             "rel-L2 = ‖vLLM − HF‖ / ‖HF‖ over tokens × hidden (HF is the reference of every difference).", "",
             "| layer | type | cos mean | cos min | rel-L2 | worst sample rel-L2 | max abs |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {s['layer']} | {s['type'] or 'attention'} | {s['cos_mean']:.6f} | {s['cos_min']:.6f} | "
              f"{s['rel_l2']:.2e} | {s['rel_l2_max_sample']:.2e} | {s['max_abs']:.2e} |" for s in r["layers"]]
    lines += ["", f"Token ids identical in every sample; target argmax agreement vLLM vs HF: "
                  f"{r['argmax_agreement']:.4f}."]
    if r["drafters"]:
        lines += ["", "| drafter | tau HF | tau vLLM | vLLM − HF | samples with identical acceptance | "
                      "max abs per-sample diff |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {d['checkpoint']} | {d['tau_hf']:.4f} | {d['tau_vllm']:.4f} | {d['diff']:+.4f} | "
                  f"{d['n_same_acceptance']}/{d['n_samples']} | {d['max_abs_sample_diff']:.4f} |" for d in r["drafters"]]
    head = "| sample | tokens | max rel-L2 over layers | argmax agreement |"
    rule = "|---|---:|---:|---:|"
    for d in r["drafters"]:
        head += f" {d['checkpoint']}: tau HF / vLLM (diff) |"
        rule += "---:|"
    lines += ["", "Per sample:", "", head, rule]
    for i, s in enumerate(r["samples"]):
        row = f"| {s['id']} | {s['n_tokens']} | {max(s['rel_l2'], default=0.0):.2e} | {s['argmax_agreement']:.4f} |"
        for d in r["drafters"]:
            p = d["samples"][i]
            row += (" no verify step |" if p["diff"] is None
                    else f" {p['tau_hf']:.4f} / {p['tau_vllm']:.4f} ({p['diff']:+.4f}) |")
        lines.append(row)
    return "\n".join(lines)
