"""Stage ``strip_drafter`` (rule ``strip_drafter``): a training checkpoint -> the folder the reference loads, after validating everything.

Formats are detected and read by :mod:`dflash_eval.drafter.checkpoints`; this stage resolves the
drafter config, validates the weights against it (and against the target,
:func:`dflash_eval.drafter.compat.check_compat`) and writes the stripped folder that z-lab/dflash
``dflash/model.py`` ``DFlashDraftModel.from_pretrained`` loads. Each failure is an
:class:`~dflash_eval.core.errors.InputError`; nothing is written.

Every check and the output folder: docs/checkpoint-formats.md, "Validation in detail, and the stripped folder".
"""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_eval.core.errors import InputError, atomic_dir
from dflash_eval.core.io import read_json_object
from dflash_eval.core.runtime import dtype_name
from dflash_eval.data.provenance import block
from dflash_eval.drafter.checkpoints import (IGNORABLE_BUFFERS, RESAVE, SHARED_KEYS, LoadedCheckpoint,
                                             load_checkpoint, unread_step)
from dflash_eval.drafter.compat import check_compat
from dflash_eval.drafter.config import OVERRIDE_KEYS, DrafterConfig, check_override_keys
from dflash_eval.drafter.families import family_of_config
from dflash_eval.drafter.files import file_checksums
from dflash_eval.drafter.model import DFlashDrafter, check_state_dict
from dflash_eval.drafter.speculators import drop_extra_tensors, is_speculators_config, to_zlab_config
from dflash_eval.target.spec import TargetSpec, load_embed_and_head

log = logging.getLogger(__name__)



def _resolve_config(ck: LoadedCheckpoint, drafter_config, overrides) -> tuple[DrafterConfig, str, list[str]]:
    """``--drafter-config`` > the checkpoint's own config > the first existing sidecar ``config.json``."""
    notes = []
    if drafter_config:
        cfg, src = read_json_object(Path(drafter_config), "drafter config", RESAVE), str(drafter_config)
        if ck.config is not None and ck.config != cfg:
            notes.append(f"--drafter-config {src} replaces the checkpoint's own config ({ck.config_source})")
    elif ck.config_error is not None:
        raise ck.config_error
    elif ck.config is not None:
        cfg, src = ck.config, ck.config_source
        side = next((p for p in ck.sidecars if p.is_file()), None)
        if side is not None and read_json_object(side, "drafter config", RESAVE) != cfg:
            notes.append(f"used the config inside the checkpoint ({src}); {side} differs and was not read "
                         "(pass --drafter-config to use it)")
    else:
        side = next((p for p in ck.sidecars if p.is_file()), None)
        if side is None:
            raise InputError(ck.path, "config.json", "no drafter config: none in the checkpoint, none at "
                             f"{[str(p) for p in ck.sidecars]}, no --drafter-config",
                             "give the checkpoint entry a drafter_config: path/to/config.json")
        cfg, src = read_json_object(side, "drafter config", RESAVE), str(side)
    if is_speculators_config(cfg):  # the flat speculators config, read as the z-lab layout
        cfg, more = to_zlab_config(cfg, src)
        notes += more
        notes += drop_extra_tensors(ck.state, ck.path)
    return DrafterConfig.from_dict(cfg, source=src, overrides=overrides), src, notes


#: |value| above which a drafter weight is named in a note: trained bf16 drafters stay far below it (norm weights
#: of order 1-100), while weights that overflow the forward pass (3e38 / 1e30 seen in diverged runs) are above
HUGE_WEIGHT = 1e4


def _check_weights(ck: LoadedCheckpoint, cfg: DrafterConfig, cfg_src: str, state: dict, allow_fp16: bool,
                   notes: list[str] | None = None) -> None:
    """fc width, exact key set and shapes, dtypes and finiteness of the drafter tensors; tensors holding a value
    above :data:`HUGE_WEIGHT` in magnitude are named in ``notes`` (evaluate refuses a drafter whose forward pass
    overflows; a large finite weight that does not overflow drafts garbage, which only a low tau shows)."""
    k, h = len(cfg.target_layer_ids), cfg.hidden_size
    fc = state.get("fc.weight")
    if fc is not None and fc.ndim == 2 and fc.shape[1] != k * h:
        fused = f" (the weights fuse {fc.shape[1] // h} target layers)" if fc.shape[1] % h == 0 else ""
        raise InputError(ck.path, "fc.weight", f"in_features {fc.shape[1]} != len(dflash_config.target_layer_ids) {k} x "
                         f"hidden_size {h} = {k * h}{fused}; config {cfg_src}",
                         "use the target_layer_ids the drafter was trained with (--override target_layer_ids=[...])")
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    check_state_dict(state, model, str(ck.path))
    for key, v in sorted(state.items()):
        if not v.is_floating_point():
            raise InputError(ck.path, key, f"dtype {v.dtype}: drafter weights are floating point", "check the checkpoint")
        if v.dtype == torch.float16 and not allow_fp16:
            raise InputError(ck.path, key, "fp16 drafter weights (acceptance collapses to ~0 in fp16: vLLM #55250, lmdeploy #4991)",
                             "convert from the bf16/fp32 master weights, or pass --allow-fp16")
        if not bool(torch.isfinite(v).all()):
            raise InputError(ck.path, key, "contains NaN or Inf", "use an earlier checkpoint of the run")
        peak = float(v.abs().max()) if v.numel() else 0.0
        if notes is not None and peak > HUGE_WEIGHT:
            notes.append(f"{key}: largest magnitude {peak:.3g}, far above a trained drafter's weights (a diverged or damaged "
                         "checkpoint?)")


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint file or folder, format auto-detected: z-lab/HF folder (config.json + "
                        "model.safetensors, or sharded with model.safetensors.index.json), SpecForge epoch_E_step_S/ "
                        "or <run>-stepN/ (training_state.pt), torch .pt/.pth/.bin state dict (nested/prefixed), "
                        "torch.distributed.checkpoint folder (.metadata + *.distcp); see dflash_eval/drafter/checkpoints.py")
    p.add_argument("--target", default=None, help="target HF folder, to validate layer ids, fc width, mask token and "
                                                  "shared embed_tokens/lm_head copies")
    p.add_argument("--drafter-config", default=None,
                   help="drafter config.json; replaces the checkpoint's own (noted in strip_info.json), or supplies "
                        "one where the checkpoint has none (SpecForge <run>-stepN, DCP)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                   help="set a config field, e.g. target_layer_ids=[1,9,17]: one the checkpoint lacks, or one it stores "
                        f"twice with different values (written to every copy). Keys: {', '.join(OVERRIDE_KEYS)}; any "
                        "other key is an error. A value differing from the checkpoint's is noted in strip_info.json")
    p.add_argument("--allow-fp16", action="store_true",
                   help="accept fp16 weights (known to collapse acceptance: vLLM #55250); the output is bf16 anyway")
    p.add_argument("--allow-shared-mismatch", action="store_true",
                   help="accept embed_tokens/lm_head copies that differ from the target's")
    p.add_argument("--out-dir", required=True, help="output folder (replaced atomically; untouched on any error)")


def main(args, opts) -> None:
    overrides = {}
    for item in args.override:
        key, _, val = item.partition("=")
        try:
            overrides[key] = json.loads(val)
        except ValueError:
            key = ""
        if not key:
            raise InputError(None, "--override", f"expected KEY=JSON, got {item!r}", "e.g. --override target_layer_ids=[1,9,17]")
    strip_checkpoint(args.checkpoint, args.out_dir, target_dir=args.target, drafter_config=args.drafter_config,
                     overrides=overrides, allow_fp16=args.allow_fp16, allow_shared_mismatch=args.allow_shared_mismatch)


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
        checkpoint: file or folder, format auto-detected (module docstring table).
        out_dir: output folder (replaced atomically; untouched on any error).
        target_dir: target HF folder; when given, ``target_layer_ids`` must be < its layer count,
            ``hidden_size`` equal, ``mask_token_id`` a row of its embedding, and shared
            ``embed_tokens``/``lm_head`` copies equal to its own. Without it the config's own
            ``num_target_layers`` / ``vocab_size`` bound the ids.
        drafter_config: config.json replacing the checkpoint's own (or supplying a missing one).
        overrides: ``{field: value}``, keys from :data:`~dflash_eval.drafter.config.OVERRIDE_KEYS`
            (``target_layer_ids``, ``mask_token_id``, ``block_size``, ..., ``dtype``, ``rope_theta``):
            sets a field the config lacks, or settles one stored twice with different values.
        allow_fp16: accept fp16 weights (acceptance collapses in fp16: vLLM #55250, lmdeploy #4991).
        allow_shared_mismatch: accept shared tensors that differ from the target's.

    A checkpoint whose own config is of a family with a layout of its own (LiLiCorr: backbone + head) is stripped
    by the family (:meth:`DrafterFamily.strip <dflash_eval.drafter.families.DrafterFamily.strip>`), without
    ``drafter_config`` / ``overrides``.

    Returns:
        ``Path(out_dir)``. Weights are written as bf16 (``tensor.to(torch.bfloat16)`` of the stored
        values, so bf16 sources are copied bit for bit).

    Raises:
        InputError: with the file, key and fix, for every validation failure; nothing is written.
    """
    check_override_keys(overrides)  # before reading a possibly large checkpoint
    ck = load_checkpoint(checkpoint)
    if ck.config is not None and not drafter_config and not overrides:  # a family with a layout of its own
        own = family_of_config(ck.config, source=str(ck.config_source or checkpoint)).strip(checkpoint, out_dir)
        if own is not None:
            return Path(own)
    cfg, cfg_src, cfg_notes = _resolve_config(ck, drafter_config, overrides)
    notes = ck.notes + cfg_notes + list(cfg.notes)
    state = dict(ck.state)
    shared = {k: state.pop(k) for k in list(state) if k in SHARED_KEYS}
    buffers = [k for k in list(state) if IGNORABLE_BUFFERS.search(k)]
    for k in buffers:
        state.pop(k)
    if buffers:
        notes.append(f"dropped non-persistent rotary buffers {buffers}")
    _check_weights(ck, cfg, cfg_src, state, allow_fp16, notes)
    if target_dir is not None:
        spec = TargetSpec.read(target_dir)
        embed, head = load_embed_and_head(spec)
        notes += check_compat(cfg, cfg_src, target=spec, embed_rows=embed.shape[0])
        _compare_shared(ck, shared, embed, head, target_dir, allow_shared_mismatch, notes)
    else:
        notes += check_compat(cfg, cfg_src)
        if shared:
            notes.append(f"dropped shared tensors {sorted(shared)} without comparison (no target given)")
    if ck.meta.get("step") is None:  # a name like step20k: say why there is no step
        src = Path(checkpoint)
        notes += [n for n in [unread_step(src.name if src.is_dir() else src.stem)] if n]
    fmt = ck.format + ("+shared" if shared else "")
    out_state = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())}
    config_out = copy.deepcopy(cfg.raw)  # the parsed config with overrides applied; never the caller's dict
    if "num_target_layers" not in config_out and target_dir is not None and spec.num_layers:
        # the reference's DFlashDraftModel.__init__ reads it (eagerly, z-lab/dflash #157) even with target_layer_ids
        config_out["num_target_layers"] = spec.num_layers
        notes.append(f"num_target_layers {spec.num_layers} (the target's) written: the reference needs it to load")
    dcfg = config_out.get("dflash_config") or {}
    dcfg.update(target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id, block_size=cfg.block_size)
    config_out["dflash_config"] = dcfg
    config_out["block_size"] = cfg.block_size  # z-lab HEAD reads the top level (both copies agree: DrafterConfig)
    cfg.family.strip_config(config_out, cfg.family_fields)  # the family's fields and architectures
    config_out.setdefault("model_type", "qwen3")
    config_out["torch_dtype"] = config_out["dtype"] = "bfloat16"  # what model.safetensors now holds
    info = {
        "source": str(checkpoint),
        "format": fmt,
        "config_source": cfg_src,
        "step": ck.meta.get("step"),
        "random_init": bool(ck.meta.get("random_init", False)),
        "dropped_shared": sorted(shared),
        "source_dtypes": sorted({dtype_name(v.dtype) for v in state.values()}),
        "notes": notes,
    }
    for note in notes:  # an equal shared copy dropped is the expected case (INFO); the rest need a look
        log.log(logging.INFO if note.endswith(SHARED_EQUAL_NOTE) else logging.WARNING, "%s: %s", ck.path, note)
    with atomic_dir(out_dir) as tmp:
        save_file(out_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_out, indent=2, sort_keys=True))
        info["sha256"] = file_checksums(tmp)
        info["provenance"] = block("strip_drafter", {"strip_drafter": {"overrides": overrides or {}, "allow_fp16": allow_fp16,
                                               "allow_shared_mismatch": allow_shared_mismatch,
                                               "drafter_config": str(drafter_config) if drafter_config else None}},
                                   {"drafter_weights": info["sha256"]["model.safetensors"]})
        (tmp / "strip_info.json").write_text(json.dumps(info, indent=2))
    log.info("stripped %s (format %s, step %s) -> %s: %d tensors, %.1f MB bf16", ck.path, fmt, info["step"], out_dir,
             len(out_state), sum(v.numel() for v in out_state.values()) * 2 / 1e6)
    return Path(out_dir)


#: note (strip_info.json ``notes``) for a shared embed/lm_head copy equal to the target's
SHARED_EQUAL_NOTE = "equal to the target's; dropped"


def _compare_shared(ck, shared, embed, head, target_dir, allow_shared_mismatch, notes) -> None:
    """Shared ``embed_tokens``/``lm_head`` copies in the checkpoint must equal the target's own."""
    for key, tensor in sorted(shared.items()):
        ref = embed if SHARED_KEYS[key] == "embed" else head
        same = tuple(tensor.shape) == tuple(ref.shape) and torch.equal(tensor.to(ref.dtype), ref)
        if not same:
            close = tuple(tensor.shape) == tuple(ref.shape) and torch.allclose(tensor.float(), ref.float(), rtol=1e-2, atol=1e-3)
            msg = f"shared tensor differs from the target's{' (close: dtype rounding?)' if close else ''}"
            if not allow_shared_mismatch:
                raise InputError(ck.path, key, f"{msg}: checkpoint {tuple(tensor.shape)} vs target {tuple(ref.shape)} ({target_dir}) — "
                                 "a different target", "evaluate against the target it was trained with, or pass --allow-shared-mismatch")
            notes.append(f"{key}: {msg} (allowed by --allow-shared-mismatch)")
        else:
            notes.append(f"{key}: {SHARED_EQUAL_NOTE}")
