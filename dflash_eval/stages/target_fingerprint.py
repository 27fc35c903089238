"""Stage ``target_fingerprint`` (rule ``target_fingerprint``): hash the target's weights once, for every later job.

Hashing reads every weight file (minutes for a 54 GB target), so the workflow does it once per
target; every job that records the target's sha256 reads this record instead
(:func:`dflash_eval.target.spec.weights_sha256`, keyed on the weight files' names, sizes and mtimes).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.target.spec import (FINGERPRINT_FORMAT, TENSOR_DIGEST, TargetSpec, as_spec, shared_tensors, tensor_sha256,
                           weight_stats, weights_sha256)

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--out", required=True, help="JSON record (sha256 + the weight files' names, sizes and mtimes); "
                                                "pass it to the other stages as --target-fingerprint")


def main(args, opts) -> None:
    write_fingerprint(args.target, args.out)


def write_fingerprint(target_dir: "str | Path | TargetSpec", out: str | Path) -> Path:
    """Hash a target's weights once and record it (the ``target-fingerprint`` stage).

    Output JSON: ``format`` (``"dflash-eval/target-fingerprint"``), ``sha256``
    (:func:`weights_sha256`), ``files`` (``name``, ``size``, ``mtime_ns`` of each weight file,
    the key under which later jobs reuse the hash), ``target`` (folder), ``tensors_sha256`` (key ->
    :func:`~dflash_eval.target.spec.tensor_sha256` of the embedding and LM head, verified whenever a
    stage reads them through this record), ``tensors_digest`` (:data:`~dflash_eval.target.spec.TENSOR_DIGEST`:
    how those were computed), ``seconds``.

    Raises:
        InputError: no ``*.safetensors`` files.
    """
    spec = as_spec(target_dir)
    files = spec.weight_files()
    before = weight_stats(files)
    t0 = time.perf_counter()
    sha = weights_sha256(spec.path)
    if weight_stats(files) != before:
        raise InputError(spec.path, "model.safetensors", "the weight files changed while they were hashed",
                         "rerun when nothing writes to the target folder")
    tensors = {k: tensor_sha256(t) for k, t in shared_tensors(spec).items()}  # hashed again as the stages read them
    rec = {"format": FINGERPRINT_FORMAT, "sha256": sha, "files": before, "target": str(spec.path),
           "tensors_sha256": tensors, "tensors_digest": TENSOR_DIGEST, "seconds": round(time.perf_counter() - t0, 3)}
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    log.info("target %s: weights sha256 %s -> %s", spec.path, sha, out)
    return Path(out)

