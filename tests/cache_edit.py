"""Test helpers that change a finished cache *consistently* (as a writer of that content would have written it).

Format 5 puts every per-sample value under the sample's checksum, and format 6 every file attribute under
``header_sha256``, so a test that wants another value (a low ``argmax_agreement``) or an older format must rewrite
the checksum too; an edit without it is what the reader refuses (tests/cache/test_reliability.py,
tests/cache/test_cache_header.py).
"""

from __future__ import annotations

from pathlib import Path

import h5py

from dflash_eval.cache.format import HEADER_VERSION, META_VERSION, sample_meta_json, sample_sha256, write_header


def _reseal(f, i: int, meta: str | None) -> None:
    g = f[f"samples/{i:06d}"]
    if meta is None:
        if "meta" in g.attrs:
            del g.attrs["meta"]
    else:
        g.attrs["meta"] = meta
    g.attrs["sha256"] = sample_sha256(g["input_ids"][()], g["target_argmax"][()], g["hidden"][()], meta)


def _meta_of(f, i: int) -> str:
    sid = f["sample_ids"][i]
    return sample_meta_json(sid.decode() if isinstance(sid, bytes) else str(sid), int(f["prompt_len"][i]),
                            int(f["completion_len"][i]), f["stop_reason"][i].decode(), int(f["max_new_tokens"][i]),
                            float(f["argmax_agreement"][i]))


def set_agreement(path: Path, values) -> None:
    """Set ``argmax_agreement[: len(values)]`` and re-seal those samples (their ``meta`` and ``sha256``)."""
    with h5py.File(path, "r+") as f:
        f["argmax_agreement"][: len(values)] = values
        if int(f.attrs["format_version"]) >= META_VERSION:
            for i in range(len(values)):
                _reseal(f, i, _meta_of(f, i))


def set_file_attrs(path: Path, **values) -> None:
    """Set file attributes and (format 6) rewrite ``header`` / ``header_sha256`` over them, as a writer of those
    values would have (an edit without it is what the reader refuses: tests/cache/test_cache_header.py)."""
    with h5py.File(path, "r+") as f:
        f.attrs.update(values)
        if int(f.attrs["format_version"]) >= HEADER_VERSION:
            write_header(f.attrs)
