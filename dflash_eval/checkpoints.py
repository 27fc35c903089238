"""Drafter checkpoints: read training checkpoints, validate them, strip them to a z-lab DFlash folder.

Output of :func:`strip_checkpoint` (what the reference loads, shared/reference/dflash.md §1.7)::

    <out_dir>/config.json          HF Qwen3-style config with dflash_config
                                   {target_layer_ids, mask_token_id, block_size}
    <out_dir>/model.safetensors    bf16 drafter body only: fc, hidden_norm, norm, layers.*
    <out_dir>/strip_info.json      provenance: source path, detected format, step, dropped keys, notes

No optimizer state and no shared target tensors (``embed_tokens``, ``lm_head``)
are kept; the drafter always uses the target's own. Every key of the source is
accounted for: drafter keys are kept, known shared/target keys are dropped
(and compared with the target's when it is given), anything else is an error.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .drafter import DFlashDrafter, DrafterConfig, check_state_dict
from .errors import InputError, atomic_dir

log = logging.getLogger(__name__)

NEST_KEYS = ("draft_state_dict", "draft_model", "model", "state_dict", "module")
PREFIXES = ("_orig_mod.", "module.", "draft_model.", "model.")
# target tensors some trainers save beside the drafter (dropped after comparison with the target)
SHARED_KEYS = {
    "embed_tokens.weight": "embed",
    "lm_head.weight": "head",
    "verifier_lm_head.weight": "head",
    "target_embed_tokens.weight": "embed",
    "target_lm_head.weight": "head",
}
# non-trained buffers that may appear in state dicts
IGNORABLE_BUFFERS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$")
STEP_PATTERNS = (r"(?:global_step|step|iter|checkpoint)[_-]?(\d+)", r"epoch_\d+_step_(\d+)")


@dataclass
class LoadedCheckpoint:
    """A checkpoint read into memory: ``state`` holds tensors with prefixes removed."""

    path: Path
    format: str
    state: dict[str, torch.Tensor]
    config: dict | None = None
    meta: dict = field(default_factory=dict)


def parse_step(name: str) -> int | None:
    """Training step from a checkpoint name (``step1500``, ``global_step_400``, ``epoch_0_step_100``, ``-step900``)."""
    for pat in STEP_PATTERNS[::-1]:
        m = re.search(pat, name)
        if m:
            return int(m.group(1))
    return None


def _strip_prefixes(state: dict, source) -> dict:
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, val in state.items():
        k = key
        changed = True
        while changed:
            changed = False
            for p in PREFIXES:
                if k.startswith(p):
                    k = k[len(p):]
                    changed = True
        if k in out:
            raise InputError(source, key, f"duplicate key after prefix stripping (also from '{origin[k]}')",
                             "save one copy of the drafter weights per checkpoint")
        out[k] = val
        origin[k] = key
    return out


def _find_state_dict(obj: dict, source) -> tuple[dict, list[str]]:
    """Descend through known nesting keys to the dict of tensors; returns (state, path)."""
    path: list[str] = []
    while True:
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) >= len(obj) // 2 and any("fc" in k or "layers." in k for k in tensors):
            return obj, path
        for k in NEST_KEYS:
            if isinstance(obj.get(k), dict):
                obj = obj[k]
                path.append(k)
                break
        else:
            raise InputError(source, None,
                             f"no drafter state dict found (top-level keys: {sorted(obj)[:12]})",
                             f"save the drafter weights under one of {list(NEST_KEYS)} or at the top level")


def load_checkpoint(path, drafter_config=None) -> LoadedCheckpoint:
    """Read a checkpoint file/folder. Formats: torch ``.pt``/``.bin`` dict (nested, prefixed),
    z-lab/HF folder (``config.json`` + ``model.safetensors``).

    Raises:
        InputError: unreadable file, not a dict, unknown pickled classes (loaded with
            ``weights_only=True``), or no drafter keys.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(path, None, "checkpoint not found", "fix the path in the checkpoints section of the config")
    if path.is_dir():
        from safetensors.torch import load_file

        st = sorted(path.glob("*.safetensors"))
        if not st:
            raise InputError(path, None, "folder has no *.safetensors", "point at a z-lab/HF drafter folder")
        state = {}
        for f in st:
            state.update(load_file(str(f)))
        cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else None
        return LoadedCheckpoint(path, "hf-folder", _strip_prefixes(state, path), cfg, {"step": parse_step(path.name)})
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # pickle errors come in many types
        raise InputError(path, None, f"cannot be read with torch.load(weights_only=True): {err}",
                         "save plain tensors/dicts (no custom classes); dflash-eval never unpickles arbitrary code") from None
    if not isinstance(obj, dict):
        raise InputError(path, None, f"top level is a {type(obj).__name__}, not a dict", "save a state dict or a dict holding one")
    state, nest = _find_state_dict(obj, path)
    cfg = None
    for key in ("draft_config", "config", "dflash_config_full"):
        if isinstance(obj.get(key), dict):
            cfg = obj[key]
            break
    meta = {k: obj[k] for k in ("step", "global_step", "epoch", "random_init") if k in obj and not isinstance(obj[k], torch.Tensor)}
    if "step" not in meta and "global_step" in meta:
        meta["step"] = meta["global_step"]
    meta.setdefault("step", parse_step(path.stem))
    fmt = "torch-dict" + (f"[{'/'.join(nest)}]" if nest else "")
    return LoadedCheckpoint(path, fmt, _strip_prefixes(state, path), cfg, meta)


def _resolve_config(ck: LoadedCheckpoint, drafter_config, overrides) -> tuple[DrafterConfig, str]:
    cfg, src = ck.config, f"{ck.path} (embedded config)"
    if cfg is None and drafter_config:
        cfg, src = json.loads(Path(drafter_config).read_text()), str(drafter_config)
    if cfg is None:
        side = (ck.path if ck.path.is_dir() else ck.path.parent) / "config.json"
        if side.exists():
            cfg, src = json.loads(side.read_text()), str(side)
    if cfg is None:
        raise InputError(ck.path, "config", "no drafter config found (embedded, sidecar config.json or --drafter-config)",
                         "give the checkpoint entry a drafter_config: path/to/config.json")
    return DrafterConfig.from_dict(cfg, source=src, overrides=overrides), src


def strip_checkpoint(
    checkpoint,
    out_dir,
    target_dir=None,
    drafter_config=None,
    overrides: dict | None = None,
    allow_fp16: bool = False,
    allow_shared_mismatch: bool = False,
) -> Path:
    """Checkpoint -> ``out_dir`` with ``config.json``, bf16 ``model.safetensors``, ``strip_info.json``.

    Args:
        checkpoint: file or folder (format auto-detected, see :func:`load_checkpoint`).
        out_dir: output folder (replaced atomically).
        target_dir: target HF folder; when given, ``target_layer_ids`` must be < its layer count,
            ``fc.in_features == len(target_layer_ids) * hidden_size``, ``mask_token_id`` a row of its
            embedding, and shared ``embed_tokens``/``lm_head`` copies equal to its own.
        drafter_config: config.json for checkpoints without one.
        overrides: ``dflash_config`` fields the checkpoint lacks (``target_layer_ids``, ...).
        allow_fp16: accept fp16 weights (acceptance collapses in fp16: vLLM #55250, lmdeploy #4991).
        allow_shared_mismatch: accept shared tensors that differ from the target's.

    Raises:
        InputError: with the file, key and fix, for every validation failure; nothing is written.
    """
    from safetensors.torch import save_file

    ck = load_checkpoint(checkpoint, drafter_config)
    cfg, cfg_src = _resolve_config(ck, drafter_config, overrides)
    notes = list(cfg.notes)
    state = dict(ck.state)
    shared = {k: state.pop(k) for k in list(state) if k in SHARED_KEYS}
    buffers = [k for k in list(state) if IGNORABLE_BUFFERS.search(k)]
    for k in buffers:
        state.pop(k)
    if buffers:
        notes.append(f"dropped non-persistent rotary buffers {buffers}")
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    check_state_dict(state, model, str(ck.path))
    dtypes = {v.dtype for v in state.values()}
    if torch.float16 in dtypes and not allow_fp16:
        raise InputError(ck.path, "dtype", "fp16 drafter weights (acceptance collapses to ~0 in fp16: vLLM #55250)",
                         "convert from the bf16/fp32 master weights, or pass --allow-fp16")
    if target_dir is not None:
        _check_against_target(ck, cfg, shared, target_dir, allow_shared_mismatch, notes)
    elif shared:
        notes.append(f"dropped shared tensors {sorted(shared)} without comparison (no target given)")
    out_state = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())}
    config_out = dict(cfg.raw)
    dcfg = dict(config_out.get("dflash_config") or {})
    dcfg.update(target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id, block_size=cfg.block_size)
    config_out["dflash_config"] = dcfg
    config_out["block_size"] = cfg.block_size  # z-lab HEAD reads the top level
    config_out.setdefault("architectures", ["DFlashDraftModel"])
    config_out.setdefault("model_type", "qwen3")
    config_out["torch_dtype"] = "bfloat16"
    info = {
        "source": str(ck.path),
        "format": ck.format,
        "config_source": cfg_src,
        "step": ck.meta.get("step"),
        "random_init": bool(ck.meta.get("random_init", False)),
        "dropped_shared": sorted(shared),
        "source_dtypes": sorted(str(d).replace("torch.", "") for d in dtypes),
        "notes": notes,
    }
    for note in notes:
        log.warning("%s: %s", ck.path, note)
    with atomic_dir(out_dir) as tmp:
        save_file(out_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_out, indent=2, sort_keys=True))
        (tmp / "strip_info.json").write_text(json.dumps(info, indent=2))
    log.info("stripped %s (%s, step %s) -> %s: %d tensors, %.1f MB bf16", ck.path, ck.format, info["step"], out_dir,
             len(out_state), sum(v.numel() for v in out_state.values()) * 2 / 1e6)
    return Path(out_dir)


def _check_against_target(ck, cfg: DrafterConfig, shared, target_dir, allow_shared_mismatch, notes) -> None:
    from .target import load_embed_and_head

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg) if "text_config" in tcfg else tcfg
    n_layers, hidden = int(tcfg["num_hidden_layers"]), int(tcfg["hidden_size"])
    bad = [i for i in cfg.target_layer_ids if i >= n_layers]
    if bad:
        raise InputError(ck.path, "dflash_config.target_layer_ids", f"{bad} out of range for the {n_layers}-layer target {target_dir}",
                         "use the layer ids the drafter was trained with (0-based decoder layers)")
    if cfg.hidden_size != hidden:
        raise InputError(ck.path, "hidden_size", f"drafter {cfg.hidden_size} != target {hidden}", "evaluate against the right target")
    embed, head = load_embed_and_head(target_dir)
    if not 0 <= cfg.mask_token_id < embed.shape[0]:
        raise InputError(ck.path, "dflash_config.mask_token_id", f"{cfg.mask_token_id} is not a row of the target embedding ({embed.shape[0]} rows)",
                         "use the mask token id the drafter was trained with")
    for key, tensor in shared.items():
        ref = embed if SHARED_KEYS[key] == "embed" else head
        same = tuple(tensor.shape) == tuple(ref.shape) and torch.equal(tensor.to(ref.dtype), ref)
        if not same:
            close = tuple(tensor.shape) == tuple(ref.shape) and torch.allclose(tensor.float(), ref.float(), rtol=1e-2, atol=1e-3)
            msg = f"shared tensor differs from the target's {'(close: dtype rounding?)' if close else ''}".strip()
            if not allow_shared_mismatch:
                raise InputError(ck.path, key, f"{msg}: checkpoint {tuple(tensor.shape)} vs target {tuple(ref.shape)} ({target_dir}) — "
                                 "a different target", "evaluate against the target it was trained with, or pass --allow-shared-mismatch")
            notes.append(f"{key}: {msg} (allowed by --allow-shared-mismatch)")
        else:
            notes.append(f"{key}: equal to the target's; dropped")


# --------------------------------------------------------------------------- demo checkpoints
def demo_drafter_config(target_dir, layer_ids, block_size: int, num_layers: int, mask_token_id: int | None = None) -> dict:
    """A drafter config for the target (hidden size and head layout copied from it)."""
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    n_target = int(tcfg["num_hidden_layers"])
    if layer_ids is None:
        layer_ids = [round(1 + i * (n_target - 4) / 4) for i in range(5)]
    heads = int(tcfg["num_attention_heads"])
    if mask_token_id is None:
        mask_token_id = int(tcfg.get("vocab_size")) - 1
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(tcfg["hidden_size"]),
        "intermediate_size": int(tcfg["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(tcfg.get("num_key_value_heads", heads)),
        "head_dim": int(tcfg.get("head_dim") or int(tcfg["hidden_size"]) // heads),
        "num_hidden_layers": num_layers,
        "num_target_layers": n_target,
        "rms_norm_eps": float(tcfg.get("rms_norm_eps", 1e-5)),
        "rope_theta": float(tcfg.get("rope_theta", (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        "max_position_embeddings": int(tcfg.get("max_position_embeddings", 8192)),
        "vocab_size": int(tcfg["vocab_size"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id, "block_size": block_size},
    }


def write_demo_checkpoint(target_dir, out, drafter_dir=None, random_init=False, layer_ids=None, block_size=16,
                          num_layers=1, step=0, seed=0) -> Path:
    """Write a training-style ``.pt`` checkpoint, as real trainers save them.

    Layout: ``{"step", "random_init", "draft_config", "model": {drafter keys..., "embed_tokens.weight",
    "lm_head.weight"} (copies of the target's shared tensors), "optimizer": AdamW state dict}``.
    Either wraps a committed stripped drafter (``drafter_dir``, trained demo drafters) or
    random-initialises one (``random_init``; labelled so in the checkpoint and every table).
    """
    from safetensors.torch import load_file

    from .errors import atomic_path
    from .target import load_embed_and_head

    if drafter_dir:
        cfg_dict = json.loads((Path(drafter_dir) / "config.json").read_text())
        state = load_file(str(Path(drafter_dir) / "model.safetensors"))
        model = DFlashDrafter(DrafterConfig.from_dict(cfg_dict, source=str(drafter_dir)))
        model.load_state_dict(state, strict=True)
    elif random_init:
        cfg_dict = demo_drafter_config(target_dir, layer_ids, block_size, num_layers)
        torch.manual_seed(seed)
        model = DFlashDrafter(DrafterConfig.from_dict(cfg_dict))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 2:
                    torch.nn.init.normal_(p, std=0.02)
    else:
        raise InputError(None, "checkpoints.demo", "entry has neither drafter nor random_init", "set one of them")
    model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # realistic optimizer state without a training step
        opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                        "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
    embed, head = load_embed_and_head(target_dir)
    model_state = dict(model.state_dict())
    model_state["embed_tokens.weight"] = embed.clone()
    model_state["lm_head.weight"] = head.clone()
    ckpt = {"step": step, "random_init": bool(random_init and not drafter_dir), "draft_config": cfg_dict,
            "model": model_state, "optimizer": opt.state_dict()}
    with atomic_path(out) as tmp:
        torch.save(ckpt, tmp)
    return Path(out)
