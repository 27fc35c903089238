"""What watch sees in a training output folder: candidates, completeness (half-written files, the
trainers' done markers, settling), steps and names, on hand-built SpecForge / speculators / HF Trainer
/ z-lab layouts."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file

from dflash_eval.drafter.trainer_output import candidates, checkpoint_name, inspect

OLD = time.time() + 3600  # "now" one hour later: every file has settled


def _weights(folder, n=64):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"layers.0.fc.weight": torch.arange(n, dtype=torch.float32).reshape(8, -1)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    return folder


def test_complete_hf_folder_and_settling(tmp_path):
    ck = _weights(tmp_path / "step1500")
    c = inspect(ck, settle_s=30, now=OLD)
    assert (c.complete, c.step, c.name, c.reason) == (True, 1500, "step1500", "")
    fresh = inspect(ck, settle_s=30)  # written just now
    assert not fresh.complete and fresh.reason.startswith("changed 0 s ago")
    assert inspect(ck, settle_s=0).complete


def test_half_written_safetensors_is_incomplete_until_whole(tmp_path):
    ck = _weights(tmp_path / "step200")
    whole = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    c = inspect(ck, settle_s=0, now=OLD)
    assert not c.complete and "model.safetensors: truncated" in c.reason
    (ck / "model.safetensors").write_bytes(whole + b"\0" * 16)  # longer than its header: being overwritten
    assert "its header describes" in inspect(ck, settle_s=0, now=OLD).reason
    (ck / "model.safetensors").write_bytes(whole)
    assert inspect(ck, settle_s=0, now=OLD).complete


def test_sharded_folder_waits_for_every_shard(tmp_path):
    ck = tmp_path / "step300"
    ck.mkdir()
    save_file({"layers.0.fc.weight": torch.ones(4, 4)}, str(ck / "model-00001-of-00002.safetensors"))
    (ck / "config.json").write_text("{}")
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "layers.0.fc.weight": "model-00001-of-00002.safetensors", "layers.1.fc.weight": "model-00002-of-00002.safetensors"}}))
    c = inspect(ck, settle_s=0, now=OLD)
    assert not c.complete and c.reason == "shard model-00002-of-00002.safetensors of model.safetensors.index.json not written yet"
    save_file({"layers.1.fc.weight": torch.ones(4, 4)}, str(ck / "model-00002-of-00002.safetensors"))
    assert inspect(ck, settle_s=0, now=OLD).complete


def test_speculators_epoch_folder_waits_for_training_state_json_and_takes_its_step(tmp_path):
    ck = _weights(tmp_path / "0")
    torch.save({"state": {}}, ck / "optimizer_state_dict.pt")
    c = inspect(ck, settle_s=0, now=OLD)
    assert not c.complete and "training_state.json" in c.reason
    (ck / "training_state.json").write_text(json.dumps({"epoch": 0, "local_step": 16626, "global_step": 16626}))
    c = inspect(ck, settle_s=0, now=OLD)
    assert (c.complete, c.step, c.name) == (True, 16626, "0-step16626")
    # a later mid-epoch save rewrites the same folder: a new checkpoint name
    (ck / "training_state.json").write_text(json.dumps({"epoch": 0, "local_step": 20000, "global_step": 20000}))
    assert inspect(ck, settle_s=0, now=OLD).name == "0-step20000"


def test_hf_trainer_checkpoint_waits_for_trainer_state(tmp_path):
    ck = _weights(tmp_path / "checkpoint-500")
    assert "trainer_state.json" in inspect(ck, settle_s=0, now=OLD).reason
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    c = inspect(ck, settle_s=0, now=OLD)
    assert (c.complete, c.step, c.name) == (True, 500, "checkpoint-500")


def test_specforge_folder_with_a_temporary_state_file(tmp_path):
    ck = tmp_path / "run-step100"
    ck.mkdir()
    torch.save({"draft_state_dict": {"layers.0.fc.weight": torch.ones(2, 2)}, "global_step": 100},
               ck / "training_state.pt.tmp")
    c = inspect(ck, settle_s=0, now=OLD)
    assert not c.complete and c.reason.startswith("not a checkpoint (yet)")
    os.replace(ck / "training_state.pt.tmp", ck / "training_state.pt")  # SpecForge's _atomic_save
    torch.save({}, ck / "training_state_rank1.pt.tmp")
    assert "temporary file training_state_rank1.pt.tmp present" in inspect(ck, settle_s=0, now=OLD).reason
    (ck / "training_state_rank1.pt.tmp").unlink()
    c = inspect(ck, settle_s=0, now=OLD)
    assert (c.complete, c.step) == (True, 100)


def test_half_written_torch_file(tmp_path):
    f = tmp_path / "step700.pt"
    torch.save({"model": {"layers.0.fc.weight": torch.ones(64, 64)}, "step": 700}, f)
    whole = f.read_bytes()
    f.write_bytes(whole[: len(whole) - 100])  # the zip's central directory is written last
    c = inspect(f, settle_s=0, now=OLD)
    assert not c.complete and "not a whole zip archive yet" in c.reason
    f.write_bytes(whole)
    c = inspect(f, settle_s=0, now=OLD)
    assert (c.complete, c.step, c.name) == (True, 700, "step700")


def test_candidates_skip_links_logs_hidden_and_temporary_entries(tmp_path):
    for name in ("run-step100", "run-step200"):
        _weights(tmp_path / name)
    (tmp_path / "run-latest").symlink_to("run-step200")
    (tmp_path / "run.best_meta.json").write_text("{}")
    (tmp_path / "runs").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "step9.pt.tmp").write_bytes(b"x")
    torch.save({}, tmp_path / "step5.pt")
    assert [p.name for p in candidates(tmp_path)] == ["run-step100", "run-step200", "step5.pt"]
    assert [p.name for p in candidates(tmp_path, "run-step*")] == ["run-step100", "run-step200"]
    from dflash_eval.core.errors import InputError

    with pytest.raises(InputError, match="watch.dir"):
        candidates(tmp_path / "missing")


def test_names_are_workflow_safe(tmp_path):
    assert checkpoint_name(tmp_path / "epoch 1 (best)", 50) == "epoch_1__best_-step50"
    assert checkpoint_name(tmp_path / "step10.pt", 10) == "step10"


def test_strip_takes_the_step_of_training_state_json(tmp_path):
    from dflash_eval.drafter.checkpoints import load_checkpoint

    ck = _weights(tmp_path / "0")
    (ck / "training_state.json").write_text(json.dumps({"epoch": 0, "local_step": 7, "global_step": 16626}))
    loaded = load_checkpoint(ck)
    assert loaded.format == "hf-folder" and loaded.meta["step"] == 16626
    hf = _weights(tmp_path / "checkpoint-500")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 400}))
    loaded = load_checkpoint(hf)
    assert loaded.meta["step"] == 400
    assert any("trainer_state.json global_step 400 differs from the folder name's step 500" in n for n in loaded.notes)
