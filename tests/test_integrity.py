"""Inputs edited or damaged between stages are refused (or, where they cannot be verified, named in the log).

* a drafter folder without ``strip_info.json`` is evaluated with a warning naming it, and the result
  says ``drafter_verified: false`` (true for a stripped folder);
* a ``strip_info.json`` without ``info_sha256``, or without its ``sha256`` record, is refused
  (``strip`` always writes both);
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_reliability import _evaluate, pipeline  # noqa: E402,F401  (the module-scoped fixture)

from dflash_eval.errors import InputError  # noqa: E402


@pytest.fixture(scope="module")
def stripped(pipeline, tmp_path_factory):  # noqa: F811
    from dflash_eval.stages.strip_drafter import strip_checkpoint

    return strip_checkpoint(pipeline["dir"] / "drafter", tmp_path_factory.mktemp("integrity") / "stripped",
                            target_dir=pipeline["target_dir"])


def test_a_drafter_without_strip_info_is_evaluated_with_a_warning(pipeline, stripped, tmp_path, caplog):  # noqa: F811
    d = pipeline["dir"]
    assert _evaluate(pipeline, d / "c.h5", drafter=stripped, out="verified.json")["drafter_verified"] is True
    bare = tmp_path / "bare"
    shutil.copytree(stripped, bare)
    (bare / "strip_info.json").unlink()
    with caplog.at_level("WARNING", logger="dflash_eval"):
        result = _evaluate(pipeline, d / "c.h5", drafter=bare, out="bare.json")
    assert result["drafter_verified"] is False
    assert json.loads((d / "bare.json").read_text())["drafter_verified"] is False
    assert [m for m in caplog.messages if "unverified" in m] == [
        f"{bare}: weights read unverified: no strip_info.json; strip the checkpoint with the strip_drafter rule "
        "to have them verified"]


@pytest.mark.parametrize("edit, field", [("no info_sha256", "info_sha256"), ("no sha256", "sha256"),
                                         ("sha256 without config.json", "sha256")])
def test_strip_info_without_its_checksums_is_refused(pipeline, stripped, tmp_path, edit, field):  # noqa: F811
    from dflash_eval.drafter import load_drafter
    from dflash_eval.drafter_files import info_sha256

    bad = tmp_path / "bad"
    shutil.copytree(stripped, bad)
    info = json.loads((bad / "strip_info.json").read_text())
    info["step"] = 5000  # the edit the checksum would have caught
    if edit == "no info_sha256":
        del info["info_sha256"]
    else:
        if edit == "no sha256":
            del info["sha256"]
        else:
            del info["sha256"]["config.json"]
        info["info_sha256"] = info_sha256(info)  # resealed by hand: still no record of the files
    (bad / "strip_info.json").write_text(json.dumps(info, indent=2))
    with pytest.raises(InputError) as err:
        load_drafter(bad)
    e = err.value
    assert Path(e.file) == bad / "strip_info.json" and e.field == field and "strip it again" in e.fix
    if field == "sha256":
        assert ("model.safetensors, config.json" if edit == "no sha256" else "for config.json") in e.problem
    with pytest.raises(InputError):
        _evaluate(pipeline, pipeline["dir"] / "c.h5", drafter=bad, out="bad.json")
    assert not (pipeline["dir"] / "bad.json").exists()
