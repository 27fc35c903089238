"""Stage ``fp8_parity`` (rule ``fp8_parity``): what FP8 storage does to a prompt set's states and tau, on a few samples.

With ``cache.storage: fp8`` every prompt set's report states, on its first ``fp8_parity.n_samples`` completions,
the FP8 cache against the cache the run would otherwise store (``cache.dtype``: bf16 on CUDA, float32 on the
CPU; ``fp8_parity.reference`` may name bfloat16 instead), as kernel_parity does for kernels: both caches are
written by the real extraction (:func:`dflash_eval.stages.hidden_states.extract_hidden_states`, one with
``storage: fp8``), compared per stored layer (:func:`dflash_eval.stages.kernel_parity.layer_stats`: cosine,
rel-L2, max abs, over every token), and every configured drafter is replayed on both
(:func:`dflash_eval.stages.evaluate.evaluate`, greedy chain), its tau on each and the difference reported, with
each cache's bytes per token. Output: JSON with ``title`` and ``markdown`` (``report --extra``) and the numbers.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch

from dflash_eval.cache.disk_room import bytes_per_token
from dflash_eval.cache.format import (SCALE_DATASET, STORAGE_BF16, STORAGE_F32, STORAGE_FP8, h5py_module, py_value,
                                      quantize_fp8, sample_sha256, to_storage, write_header)
from dflash_eval.cache.reader import CacheReader
from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError
from dflash_eval.core.runtime import dtype_name, resolve_device, resolve_dtype
from dflash_eval.data.completions import read_completions, subset_text
from dflash_eval.data.provenance import stage_block, write_json
from dflash_eval.stages.evaluate import evaluate
from dflash_eval.stages.hidden_states import extract_hidden_states
from dflash_eval.stages.kernel_parity import layer_stats

STAGE = "fp8_parity"

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--completions", required=True, help="completions JSONL of the prompt set; its first n_samples "
                                                        "rows are used")
    p.add_argument("--layer-ids", type=lambda t: [int(x) for x in t.split(",") if x], required=True,
                   help="comma-separated 0-based decoder layers the run's cache stores")
    p.add_argument("--drafter", nargs="*", default=[], help="stripped drafter folders replayed on both caches")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint' (the weights are not hashed again while it matches)")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the numbers")


def main(args, opts) -> None:
    fp8_parity(args.target, args.completions, args.layer_ids, args.out, opts, drafters=args.drafter,
               target_fingerprint=args.target_fingerprint)


def fp8_parity(target_dir, completions_path, layer_ids: list[int], out, opts=None, *, drafters=(),
               target_fingerprint=None, **overrides) -> dict:
    """The first ``n_samples`` completions extracted twice (reference storage, FP8), compared, drafters replayed.

    Args:
        target_dir: HF target folder.
        completions_path: completions JSONL; its first ``n_samples`` rows are used.
        layer_ids: 0-based decoder layers to store (the run's cache's).
        out: JSON path (keys ``title``, ``markdown``, ``prompt_set``, ``reference`` (its dtype), ``layers``
            (:func:`~dflash_eval.stages.kernel_parity.layer_stats` rows: FP8 = A, reference = B),
            ``argmax_agreement``, ``n_samples``, ``n_tokens``, ``bytes_per_token`` (``{"reference", "fp8"}``),
            ``drafters`` (``checkpoint``, ``tau_reference``, ``tau_fp8``, ``tau_diff`` = fp8 - reference, per sample
            ``steps_reference`` / ``steps_fp8`` (verify steps of the chain), ``samples_changed`` (samples whose
            acceptance lengths differ))).
        opts: the stage's options (config ``fp8_parity``: ``n_samples`` >= 1, ``reference`` (``dtype`` = the
            run's ``cache.dtype``, or ``bfloat16``); and ``cache``, ``target.*`` as for the hidden_states stage).
        drafters: stripped drafter folders to replay on both caches.
        target_fingerprint: a ``target-fingerprint`` record (the weights are then not hashed again).

    Raises:
        InputError: ``n_samples < 1``; what the extraction and evaluate raise (bad completions, layer ids,
            drafter/target mismatches).
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    if opts.n_samples < 1:
        raise InputError("config", "fp8_parity.n_samples", f"{opts.n_samples} < 1", "set at least 1")
    dev = resolve_device(opts.device)
    run_dtype = dtype_name(resolve_dtype(opts.dtype, dev))
    ref_dtype = "bfloat16" if opts.reference == "bfloat16" else run_dtype
    rows = read_completions(Path(completions_path))[: opts.n_samples]
    prompt_set = Path(completions_path).stem
    result: dict = {"title": f"FP8 cache parity: {prompt_set}", "prompt_set": prompt_set, "target": Path(target_dir).name,
                    "reference": ref_dtype, "drafters": []}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    common = dict(batch_tokens=opts.batch_tokens, device=opts.device, packing=opts.packing,
                  linear_attn_backend=opts.linear_attn_backend, devices=opts.devices, max_memory=opts.max_memory,
                  final_hidden=opts.final_hidden, target_fingerprint=target_fingerprint, disk_check="warn")
    with tempfile.TemporaryDirectory(prefix=".fp8_parity.", dir=Path(out).parent) as tmp:
        tmp = Path(tmp)
        sub = tmp / f"{prompt_set}.jsonl"
        sub.write_text(subset_text(rows), encoding="utf-8")
        # FP8 from the states the run computes (cache.dtype), as its hidden_states jobs do
        caches = {"reference": extract_hidden_states(target_dir, sub, tmp / "run.h5", layer_ids, dtype=run_dtype,
                                                     storage="dtype", **common),
                  "fp8": extract_hidden_states(target_dir, sub, tmp / "fp8.h5", layer_ids, dtype=run_dtype,
                                               storage="fp8", **common)}
        if ref_dtype != run_dtype:  # float32 states rounded to bf16: a bf16 cache of the same forward
            caches["reference"] = restored_copy(caches["reference"], tmp / "reference.h5", "bfloat16")
        with CacheReader(caches["fp8"]) as ra, CacheReader(caches["reference"]) as rb:
            stored = [int(i) for i in rb.layer_ids]
            stats, agree, n_tok = layer_stats(ra, rb, stored)
            H = int(rb.attrs["hidden_size"])
        result.update(layers=stats, argmax_agreement=agree, n_samples=len(rows), n_tokens=n_tok,
                      bytes_per_token={"reference": bytes_per_token(ref_dtype, len(stored), H),
                                       "fp8": bytes_per_token("fp8", len(stored), H)})
        for d in drafters:
            # the chain's tau (no DDTree budgets: the chain is what the states decide first, and it is cheap)
            # greedy on every set, also one drawn at T > 0 (cross_temperature: the comparison is of two caches)
            ev = {k: evaluate(d, caches[k], target_dir, tmp / f"eval_{k}.json", device=opts.device,
                              allow_low_agreement=True, ddtree_budgets=[], sampling=[{"temperature": 0.0}],
                              cross_temperature=True) for k in ("reference", "fp8")}
            steps = {k: [int(x["steps"]) for x in ev[k]["samples"]] for k in ev}
            result["drafters"].append({
                "checkpoint": Path(d).name, "tau_reference": ev["reference"]["tau"], "tau_fp8": ev["fp8"]["tau"],
                "tau_diff": ev["fp8"]["tau"] - ev["reference"]["tau"], "steps_reference": steps["reference"],
                "steps_fp8": steps["fp8"], "samples_changed": sum(
                    a["acceptance_lengths"] != b["acceptance_lengths"]
                    for a, b in zip(ev["reference"]["samples"], ev["fp8"]["samples"]))})
    result["markdown"] = markdown(result)
    result["provenance"] = stage_block(STAGE, opts)
    result.update(write_json(out, result))
    for line in result["markdown"].splitlines():
        log.info("%s", line)
    return result


def restored_copy(src: Path, dst: Path, storage: str, quantize=quantize_fp8) -> Path:
    """A float32 cache ``src`` stored otherwise at ``dst``: every sample's states rounded to bf16 (``storage``
    ``"bfloat16"``: torch's round-to-nearest-even cast; ``dtype`` becomes bfloat16) or quantised to FP8
    (``"fp8"``: ``quantize``, by default :func:`~dflash_eval.cache.format.quantize_fp8`, what ``cache.storage:
    fp8`` stores of the same float32 states; another function of the same signature stores its own ``(q,
    scale)``), its checksum, ``storage`` and the header rewritten. The file is a copy (repacked: HDF5
    does not return the space of the replaced datasets).

    Raises:
        ValueError: ``src`` is not a float32 cache, or another storage name.
    """
    if storage not in ("bfloat16", "fp8"):
        raise ValueError(f"storage {storage!r}: bfloat16 or fp8")
    h5py = h5py_module()
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    with h5py.File(tmp, "r+") as f:
        if f.attrs["dtype"] != "float32" or f.attrs["storage"] != STORAGE_F32:
            raise ValueError(f"{src}: dtype {f.attrs['dtype']}, not float32")
        for name in f["samples"]:
            g = f["samples"][name]
            x = torch.from_numpy(g["hidden"][()])
            del g["hidden"]
            if storage == "fp8":
                q, scale = quantize(x)
                q, scale = q.numpy(), scale.numpy()
                g.create_dataset("hidden", data=q)
                g.create_dataset(SCALE_DATASET, data=scale)
                g.attrs["sha256"] = sample_sha256(g["input_ids"][()], g["target_argmax"][()], q,
                                                  py_value(g.attrs.get("meta")), scale)
            else:
                bits, _ = to_storage(x.to(torch.bfloat16))
                g.create_dataset("hidden", data=bits)
                g.attrs["sha256"] = sample_sha256(g["input_ids"][()], g["target_argmax"][()], bits,
                                                  py_value(g.attrs.get("meta")))
        if storage == "fp8":
            f.attrs["storage"] = STORAGE_FP8
        else:
            f.attrs["dtype"], f.attrs["storage"] = "bfloat16", STORAGE_BF16
        write_header(f.attrs)
    _repack(tmp, dst)
    tmp.unlink(missing_ok=True)
    return dst


def _repack(src: Path, dst: Path) -> None:
    """Copy every object and attribute of ``src`` into a new file ``dst`` (what h5repack does: no unused space)."""
    h5py = h5py_module()
    with h5py.File(src, "r") as a, h5py.File(dst, "w") as b:
        for k, v in a.attrs.items():
            b.attrs[k] = v
        for name in a:
            a.copy(a[name], b, name=name)


def markdown(r: dict) -> str:
    """The report section of one prompt set's :func:`fp8_parity` result."""
    b = r["bytes_per_token"]
    head = (f"Prompt set `{r['prompt_set']}`, first {r['n_samples']} samples ({r['n_tokens']} tokens): the FP8 "
            f"cache (float8_e4m3fn, one scale per token and layer) against a {r['reference']} cache of the same "
            f"completions; {b['fp8']} vs {b['reference']} bytes per token ({b['reference'] / b['fp8']:.2f}x "
            "smaller). Per stored layer over every token; rel-L2 = ||FP8 - ref|| / ||ref||.")
    lines = [head, "",
             "| layer | cos mean | cos min | rel-L2 | max abs |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {s['layer']} | {s['cos_mean']:.6f} | {s['cos_min']:.6f} | {s['rel_l2']:.2e} | {s['max_abs']:.2e} |"
              for s in r["layers"]]
    lines += ["", f"Target teacher-forced argmax in both caches (same forward): agreement {r['argmax_agreement']:.4f}."]
    if r["drafters"]:
        lines += ["", f"| drafter | tau on {r['reference']} | tau on FP8 | FP8 - {r['reference']} | samples changed |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {d['checkpoint']} | {d['tau_reference']:.4f} | {d['tau_fp8']:.4f} | {d['tau_diff']:+.4f} | "
                  f"{d['samples_changed']} of {r['n_samples']} |" for d in r["drafters"]]
        lines += ["", "Part of such a difference is rounding luck: other, equally good FP8 encodings of the same "
                  "states give other taus (scripts/fp8_rounding_spread.py measures the spread; docs/measurements.md, "
                  "\"FP8 caches\", gives it for the demo drafters)."]
    return "\n".join(lines)
