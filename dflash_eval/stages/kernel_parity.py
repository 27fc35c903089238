"""Stage ``kernel_parity`` (rule ``kernel_parity``): the same samples extracted with two linear-attention backends, compared per layer.

The diagnosis users otherwise do by hand when a drafter trained on fla states
(GPU) is evaluated on states from transformers' torch GDN fallback: on the first
``n_samples`` completions, :func:`kernel_parity` writes two temporary caches
through the real extraction (:func:`dflash_eval.stages.hidden_states.extract_hidden_states`),

* **A** = fla and **B** = torch, both in the cache dtype (bf16 on GPU), when the
  device is CUDA and ``fla.ops.gated_delta_rule`` imports;
* otherwise (CPU, or fla missing) **A** = torch in bfloat16 and **B** = torch in
  float32 — the bf16 noise floor, which on a random-init model is the same size
  as fla-vs-torch (measured with ``bench/gpu_hybrid_parity.py``, README) — and the report says
  in its first line that fla was unavailable and why;

then compares them per stored layer over all tokens of all samples:
``cos_mean`` / ``cos_min`` (per-token cosine of A and B), ``rel_l2`` =
``||A - B||_2 / ||B||_2`` (Frobenius over tokens x hidden), ``max_abs`` =
``max |A - B|`` (units of the hidden state), plus the fraction of positions
where the target's teacher-forced argmax agrees. With drafters, each is
replayed (:func:`dflash_eval.stages.evaluate.evaluate`) on both caches and the tau each
gives is reported. Output: JSON with ``title`` and ``markdown`` (picked up by
``report --extra``) and the numbers.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from dflash_eval.cache.reader import CacheReader
from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError
from dflash_eval.core.runtime import dtype_name, resolve_device, resolve_dtype
from dflash_eval.data.completions import read_completions, subset_text
from dflash_eval.data.provenance import stage_block, write_json
from dflash_eval.stages.evaluate import evaluate
from dflash_eval.stages.hidden_states import extract_hidden_states
from dflash_eval.target.hybrid import bind_linear_attention, check_bound_kernel, fla_status, target_has_linear_attention
from dflash_eval.target.model import load_target
from dflash_eval.target.spec import TargetSpec

STAGE = "kernel_parity"

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--completions", required=True, help="completions JSONL; its first n_samples rows are used")
    p.add_argument("--layer-ids", type=lambda t: [int(x) for x in t.split(",") if x], required=True,
                   help="comma-separated 0-based decoder layers to compare")
    p.add_argument("--drafter", nargs="*", default=[], help="stripped drafter folders replayed on both caches")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint' (the weights are not hashed again while it matches)")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the numbers")


def main(args, opts) -> None:
    kernel_parity(args.target, args.completions, args.layer_ids, args.out, opts, drafters=args.drafter,
                  target_fingerprint=args.target_fingerprint)



def plan(device: str, dtype: str, target_dir) -> dict:
    """Decide the two extractions. Returns ``{"a": {...}, "b": {...}, "fla_available", "note"}``.

    ``a``/``b`` hold ``backend`` (``fla``/``torch``) and ``dtype`` (``bfloat16``/``float32``).
    """
    dev = resolve_device(device)
    dt = dtype_name(resolve_dtype(dtype, dev))
    if not target_has_linear_attention(target_dir):
        return {"a": None, "b": None, "fla_available": None,
                "note": "target has no linear-attention layers: nothing depends on the GDN kernel"}
    ok, why = fla_status()
    if dev.type == "cuda" and ok:
        return {"a": {"backend": "fla", "dtype": dt}, "b": {"backend": "torch", "dtype": dt}, "fla_available": True,
                "note": f"fla {why} vs transformers' torch GDN path, both {dt} on {dev}"}
    reason = f"the device is {dev} (fla has GPU Triton kernels only)" if dev.type != "cuda" else f"fla is not importable ({why})"
    return {"a": {"backend": "torch", "dtype": "bfloat16"}, "b": {"backend": "torch", "dtype": "float32"},
            "fla_available": False,
            "note": (f"fla unavailable: {reason}. Compared torch bfloat16 (A) with torch float32 (B) instead: the "
                     "bf16 noise floor, not fla vs torch. Run this stage on a CUDA GPU with fla-core installed.")}


class Parity:
    """Running per-layer comparison of hidden states A vs B (float64 on CPU).

    :meth:`add` takes one sample's ``[T, K, H]`` tensors (any float dtype/device); :meth:`rows`
    gives per layer ``cos_mean`` / ``cos_min`` (per-token cosine), ``rel_l2`` = ``||A-B|| / ||B||``
    over all tokens, ``max_abs`` = ``max |A-B|``, ``zero_tokens`` (tokens whose state is exactly zero
    in A and in B: their cosine is undefined and counted as 1, the states being equal),
    ``zero_one_side`` (exactly zero in one of them only: cosine 0, a real difference) and
    ``cos_min_at`` (``[sample index, position]`` of the lowest cosine).

    Exactly-zero states are real: a token equal to the pad id has an all-zero embedding when the
    embedding's ``padding_idx`` row is zero (random-init targets; transformers' ``nn.Embedding(...,
    pad_token_id)``), and every Gated DeltaNet layer maps it to zero again (its output is
    gated-RMS-normed by ``silu(z)``, ``z`` a projection of the token's own input, and the MLP of a zero
    input is zero), up to the first full-attention layer. Counted as cosine 0 they read as
    "orthogonal states" (``cos_min 0.0``).
    """

    def __init__(self, n_layers: int):
        z = lambda: torch.zeros(n_layers, dtype=torch.float64)  # noqa: E731
        self.d2, self.r2, self.max_abs, self.cos_sum = z(), z(), z(), z()
        self.cos_min = torch.full((n_layers,), float("inf"), dtype=torch.float64)
        self.cos_min_at = [[-1, -1] for _ in range(n_layers)]
        self.zero_both = torch.zeros(n_layers, dtype=torch.long)
        self.zero_one = torch.zeros(n_layers, dtype=torch.long)
        self.n_tok = 0
        self.n_samples = 0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape != b.shape:
            raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
        a, b = a.detach().cpu().double(), b.detach().cpu().double()
        diff = a - b
        self.d2 += diff.pow(2).sum((0, 2))
        self.r2 += b.pow(2).sum((0, 2))
        self.max_abs = torch.maximum(self.max_abs, diff.abs().amax((0, 2)))
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30)  # [T, K]
        za, zb = (a == 0).all(-1), (b == 0).all(-1)  # [T, K]
        both = za & zb
        cos = torch.where(both, torch.ones_like(cos), cos)  # equal (zero) states
        self.zero_both += both.sum(0)
        self.zero_one += (za ^ zb).sum(0)
        self.cos_sum += cos.sum(0)
        low, pos = cos.min(0)
        for k in range(cos.shape[1]):
            if low[k] < self.cos_min[k]:
                self.cos_min[k] = low[k]
                self.cos_min_at[k] = [self.n_samples, int(pos[k])]
        self.n_tok += a.shape[0]
        self.n_samples += 1

    def rows(self, layer_ids: list[int]) -> list[dict]:
        return [{"layer": lid, "cos_mean": float(self.cos_sum[k] / self.n_tok), "cos_min": float(self.cos_min[k]),
                 "cos_min_at": self.cos_min_at[k], "rel_l2": float((self.d2[k] / self.r2[k]).sqrt()),
                 "max_abs": float(self.max_abs[k]), "zero_tokens": int(self.zero_both[k]),
                 "zero_one_side": int(self.zero_one[k])}
                for k, lid in enumerate(layer_ids)]


def layer_stats(reader_a, reader_b, layer_ids: list[int]) -> tuple[list[dict], float, int]:
    """Per-layer parity of two caches of the same samples (:class:`Parity`).

    Returns:
        (rows, argmax_agreement, n_tokens): :meth:`Parity.rows`; the fraction of positions whose
        teacher-forced argmax is equal in A and B; tokens compared.

    Raises:
        InputError: the caches hold different samples or token ids.
    """
    if reader_a.sample_ids != reader_b.sample_ids:
        raise InputError(reader_a.path, "sample_ids", f"differ from {reader_b.path}", "extract both from one completions file")
    par = Parity(len(layer_ids))
    agree = 0
    for i in range(len(reader_a)):
        sa, sb = reader_a.sample(i, layer_ids), reader_b.sample(i, layer_ids)
        if not torch.equal(sa.input_ids, sb.input_ids):
            raise InputError(reader_a.path, f"samples/{i:06d}/input_ids", "differ between the two caches", "re-run")
        par.add(sa.hidden, sb.hidden)
        agree += int((sa.target_argmax == sb.target_argmax).sum())
    return par.rows(layer_ids), agree / max(par.n_tok, 1), par.n_tok


def kernel_parity(target_dir, completions_path, layer_ids: list[int], out, opts=None, *, drafters=(),
                  target_fingerprint=None, **overrides) -> dict:
    """Extract ``n_samples`` completions with two backends, compare per layer, replay drafters on both.

    Args:
        target_dir: HF target folder.
        completions_path: completions JSONL; its first ``n_samples`` rows are used.
        layer_ids: 0-based decoder layers to compare (HF ``hidden_states[i+1]``).
        out: JSON path (keys ``title``, ``markdown``, ``plan``, ``layers``, ``argmax_agreement``,
            ``n_samples``, ``n_tokens``, ``extractions`` (backend, dtype, seconds, tokens/s,
            ``linear_attn_kernel``), ``drafters`` (``checkpoint``, ``tau_a``, ``tau_b``)).
        drafters: stripped drafter folders to replay on both caches (their layers must be in ``layer_ids``).
        opts: the stage's options (config ``kernel_parity.n_samples``: samples to extract, >= 1; and
            ``cache.batch_tokens``, ``cache.device``, ``cache.dtype``, as for the hidden_states stage;
            the dtype applies on the fla path, see :func:`plan`).
        target_fingerprint: a ``target-fingerprint`` record (the weights are then not hashed again).

    Raises:
        InputError: ``n_samples < 1``, bad completions, layer ids, or drafter/target mismatches.
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    n_samples, device = opts.n_samples, opts.device
    p = plan(device, opts.dtype, target_dir)
    result: dict = {"title": "Linear-attention kernel parity", "plan": p, "target": Path(target_dir).name,
                    "layers": [], "drafters": [], "extractions": {}}
    if p["a"] is None:
        result["markdown"] = f"Skipped: {p['note']}."
        _write(out, result, opts)
        return result
    rows = read_completions(Path(completions_path))[:n_samples]
    label = {k: f"{p[k]['backend']} {p[k]['dtype']}" for k in ("a", "b")}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kernel_parity.", dir=Path(out).parent) as tmp:
        tmp = Path(tmp)
        sub = tmp / f"{Path(completions_path).stem}.jsonl"
        sub.write_text(subset_text(rows), encoding="utf-8")
        caches = {}
        shared = None
        t_load = 0.0
        if p["a"]["dtype"] == p["b"]["dtype"]:  # fla vs torch: one model, the kernel rebound between the two
            t0 = time.perf_counter()
            spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
            dev = resolve_device(device)
            model, tok, _ = load_target(spec, device=dev, dtype=resolve_dtype(p["a"]["dtype"], dev),
                                        backend=p["a"]["backend"], devices=opts.devices, max_memory=opts.max_memory)
            shared = (spec, dev, model, tok)
            t_load = time.perf_counter() - t0
            result["model_loads"] = 1
            result["load_seconds"] = round(t_load, 3)
        for k in ("a", "b"):
            t0 = time.perf_counter()
            loaded = None
            if shared:
                spec, dev, model, tok = shared
                loaded = (model, tok, check_bound_kernel(model, bind_linear_attention(p[k]["backend"], dev, spec)))
            caches[k] = extract_hidden_states(target_dir, sub, tmp / f"{k}.h5", layer_ids,
                                              batch_tokens=opts.batch_tokens, device=device, dtype=p[k]["dtype"],
                                              linear_attn_backend=p[k]["backend"], devices=opts.devices,
                                              max_memory=opts.max_memory, target_fingerprint=target_fingerprint,
                                              loaded=loaded)
            secs = time.perf_counter() - t0
            n_tok = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
            with CacheReader(caches[k]) as rd:
                result["extractions"][k] = {**p[k], "seconds": round(secs, 3), "tokens_per_s": round(n_tok / secs, 1),
                                            "linear_attn_kernel": json.loads(rd.attrs["linear_attn_kernel"])}
                types = json.loads(rd.attrs.get("layer_types") or "[]")
        with CacheReader(caches["a"]) as ra, CacheReader(caches["b"]) as rb:
            stats, agree, n_tok = layer_stats(ra, rb, layer_ids)
        for r in stats:
            r["type"] = types[r["layer"]] if r["layer"] < len(types) else "?"
        result.update(layers=stats, argmax_agreement=agree, n_samples=len(rows), n_tokens=n_tok)
        shared = loaded = model = tok = None  # the target's memory, before the drafters' replays
        for d in drafters:
            taus = {}
            for k in ("a", "b"):
                # Both backends on purpose; a backend whose states drift far enough to lower the
                # argmax agreement is what this report shows (argmax_agreement above), not refused.
                ev = evaluate(d, caches[k], target_dir, tmp / f"eval_{k}.json", device=device,
                              allow_backend_mismatch=True, allow_low_agreement=True)
                taus[k] = ev["tau"]
            result["drafters"].append({"checkpoint": Path(d).name, "tau_a": taus["a"], "tau_b": taus["b"]})
    result["title"] = f"Linear-attention kernel parity: A = {label['a']}, B = {label['b']}"
    result["markdown"] = _markdown(result, label)
    _write(out, result, opts)
    for line in result["markdown"].splitlines():
        log.info("%s", line)
    return result


def _markdown(r: dict, label: dict) -> str:
    p = r["plan"]
    fn = {k: r["extractions"][k]["linear_attn_kernel"].get("functions", {}) for k in ("a", "b")}
    chunk = {k: sorted({f.get("chunk_rule", "?") for f in fn[k].values()}) for k in ("a", "b")}
    lines = [f"**{p['note']}**" if p["fla_available"] is False else p["note"], "",
             f"Target `{r['target']}`, {r['n_samples']} samples, {r['n_tokens']} tokens (right-padded batches, "
             "as in the cache stage). A vs B per stored layer over all tokens; rel-L2 = ||A-B|| / ||B||.", ""]
    for k in ("a", "b"):
        e = r["extractions"][k]
        lines.append(f"- **{k.upper()}** = {label[k]}: chunk rule `{', '.join(chunk[k])}`; "
                     f"{e['seconds']:.1f} s, {e['tokens_per_s']:.0f} tok/s "
                     + (f"(the model loaded once for both, {r['load_seconds']:.1f} s, not included)"
                        if r.get("model_loads") == 1 else "(including model load)"))
    lines += ["", "| layer | type | cos mean | cos min | rel-L2 | max abs |", "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {s['layer']} | {s['type']} | {s['cos_mean']:.6f} | {s['cos_min']:.6f} | {s['rel_l2']:.2e} | "
              f"{s['max_abs']:.2e} |" for s in r["layers"]]
    zero = sum(s.get("zero_tokens", 0) for s in r["layers"])
    one = sum(s.get("zero_one_side", 0) for s in r["layers"])
    if zero or one:
        lines += ["", f"{zero} token state(s) over the stored layers are exactly zero in both A and B (cosine counted "
                  "as 1): tokens equal to the pad id whose embedding row is zero, which Gated DeltaNet layers keep at "
                  "zero up to the first attention layer (random-init targets)"
                  + (f"; {one} are zero in one cache only (cosine 0: a real difference)" if one else "") + "."]
    lines += ["", f"Target teacher-forced argmax agreement A vs B: {r['argmax_agreement']:.4f}."]
    if r["drafters"]:
        lines += ["", "| drafter | tau on A | tau on B | A - B |", "|---|---:|---:|---:|"]
        lines += [f"| {d['checkpoint']} | {d['tau_a']:.3f} | {d['tau_b']:.3f} | {d['tau_a'] - d['tau_b']:+.3f} |"
                  for d in r["drafters"]]
    return "\n".join(lines)


def _write(out, result: dict, opts=None) -> None:
    result["provenance"] = stage_block(STAGE, opts)
    result.update(write_json(out, result))
