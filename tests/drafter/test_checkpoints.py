"""Checkpoint formats -> strip -> bit-exact bf16 drafter; every bad input is refused with file + key, nothing written."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_eval.drafter.checkpoints import FORMATS, detect_format
from dflash_eval.stages.strip_drafter import strip_checkpoint
from dflash_eval.drafter.model import DFlashDrafter, load_drafter
from dflash_eval.core.errors import InputError
from fixtures.drafters import LAYER_IDS, MASK_ID, TARGET_LAYERS, VOCAB, random_state, tiny_config, write_target


# --------------------------------------------------------------------------- writers, one per format
def write_hf(folder: Path, cfg: dict, state: dict, shards: int = 1) -> Path:
    """z-lab / HF folder; ``shards > 1`` writes ``model-0000i-of-0000n.safetensors`` + the index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"))
        return folder
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def write_specforge_legacy(root: Path, cfg: dict, state: dict) -> Path:
    """``epoch_1_step_300/``: save_pretrained output + training_state.pt with an argparse.Namespace, as SpecForge did."""
    folder = write_hf(root / "epoch_1_step_300", cfg, state)
    opt = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]}
    torch.save({"epoch": 1, "global_step": 301, "args": argparse.Namespace(learning_rate=6e-4), **opt},
               folder / "training_state.pt")
    return folder


def write_specforge(root: Path, cfg: dict, state: dict) -> Path:
    """``<run>/<run>-step1200/training_state.pt`` with draft_state_dict; the config sits in the run folder."""
    step_dir = root / "run" / "run-step1200"
    step_dir.mkdir(parents=True)
    (root / "run" / "config.json").write_text(json.dumps(cfg))
    torch.save({"draft_state_dict": state, "global_step": 1200, "epoch": 2, "strategy": "dflash", "run_id": "run",
                "world_size": 1}, step_dir / "training_state.pt")
    return step_dir


def write_dcp(root: Path, cfg: dict, state: dict) -> Path:
    """torch.distributed.checkpoint folder (single process), with optimizer moments and a counter beside the model."""
    import torch.distributed.checkpoint as dcp

    (root / "config.json").write_text(json.dumps(cfg))
    sd = {"model": {f"draft_model.{k}": v.clone() for k, v in state.items()},
          "optimizer": {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in list(state.items())[:3]}},
          "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(root / "global_step_700"))
    return root / "global_step_700"


NESTINGS = [  # (container, key prefix, file name)
    (None, "", "flat.pt"),
    ("model", "module.", "ckpt_step500.pt"),
    ("state_dict", "_orig_mod.draft_model.", "iter_500.pth"),
    ("module", "model.", "pytorch_model.bin"),
    ("draft_model", "", "draft.pt"),
]


def write_torch(root: Path, cfg: dict, state: dict, container, prefix: str, name: str) -> Path:
    inner = {prefix + k: v for k, v in state.items()}
    obj = inner if container is None else {container: inner, "step": 500, "draft_config": cfg,
                                            "optimizer": {"state": {}, "param_groups": []}}
    if container is None:
        (root / "config.json").write_text(json.dumps(cfg))  # sidecar
    torch.save(obj, root / name)
    return root / name


# --------------------------------------------------------------------------- helpers
def assert_bf16_equal(out_dir: Path, source: dict) -> None:
    """Stripped tensors == source tensors cast to bf16, bit for bit, and nothing else."""
    out = load_file(str(out_dir / "model.safetensors"))
    assert sorted(out) == sorted(source)
    for k, v in source.items():
        assert out[k].dtype == torch.bfloat16
        assert torch.equal(out[k].view(torch.int16), v.to(torch.bfloat16).view(torch.int16)), k


def assert_refused(exc: pytest.ExceptionInfo, file, key: str, out: Path) -> None:
    """The error names the file and the key, and no output (or temp folder) was left behind."""
    msg = str(exc.value)
    assert str(file) in msg, msg
    assert key in msg, msg
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.fixture
def cfg():
    return tiny_config()


@pytest.fixture
def state(cfg):
    return random_state(cfg, seed=1)


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_folder_round_trip(tmp_path, cfg, shards, dtype):
    src = random_state(cfg, seed=2, dtype=dtype)
    folder = write_hf(tmp_path / "step_40", cfg, src, shards=shards)
    fmt = "hf-folder" if shards == 1 else "hf-folder-sharded"
    assert detect_format(folder)[0] == fmt
    out = strip_checkpoint(folder, tmp_path / "out")
    assert_bf16_equal(out, src)
    info = json.loads((out / "strip_info.json").read_text())
    assert (info["format"], info["step"]) == (fmt, 40)
    assert info["source_dtypes"] == [str(dtype).replace("torch.", "")]
    model = load_drafter(out)
    assert model.cfg.target_layer_ids == LAYER_IDS and model.cfg.mask_token_id == MASK_ID


@pytest.mark.parametrize("shards", [1, 2])
def test_a_torch_file_beside_safetensors_weights_is_named_not_read(tmp_path, cfg, shards):
    """a folder with model.safetensors (step 788) and another step's .pt used the safetensors
    with no word; the trainer's own side files (optimizer.pt, rng_state.pth, ...) are no news and not named."""
    src = random_state(cfg, seed=2)
    folder = write_hf(tmp_path / "step_40", cfg, src, shards=shards)
    torch.save(random_state(cfg, seed=3), folder / "training_state_3507.pt")
    for side in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "training_args.bin"):
        (folder / side).write_bytes(b"x")
    out = strip_checkpoint(folder, tmp_path / "out")
    assert_bf16_equal(out, src)  # the safetensors were read
    notes = json.loads((out / "strip_info.json").read_text())["notes"]
    assert [n for n in notes if "training_state_3507.pt" in n] == [
        "ignored ['training_state_3507.pt']: the weights read are the folder's safetensors (point the checkpoint "
        "entry at a .pt file to read that one)"]
    assert not any("optimizer.pt" in n or "rng_state" in n for n in notes)


@pytest.mark.parametrize("name, step", [
    ("step1500", 1500), ("global_step_400", 400), ("epoch_0_step_100", 100), ("run-step900", 900), ("step100.pt", 100),
    ("checkpoint-3000", 3000), ("step_100_ema", 100), ("dflash-smollm2-b8-step3507", 3507), ("ckpt", None),
    # the leading digits were taken (20, 10, 1, 1, 2): no step, and strip says why
    ("run1-step20k", None), ("step-10k", None), ("step_1.5k", None), ("step1e5", None), ("step-2e19", None)])
def test_step_from_the_name_is_a_whole_number_or_none(name, step):
    from dflash_eval.drafter.checkpoints import parse_step, unread_step

    assert parse_step(name) == step
    assert (unread_step(name) is not None) == (step is None and name != "ckpt")


def test_a_name_whose_step_has_a_unit_gets_no_step_and_a_note(tmp_path, cfg):
    folder = write_hf(tmp_path / "run1-step20k", cfg, random_state(cfg, seed=2))
    info = json.loads((strip_checkpoint(folder, tmp_path / "out") / "strip_info.json").read_text())
    assert info["step"] is None and "no training step: 'step20k' in the name 'run1-step20k' is not a whole number " \
        "of steps (a unit or decimal after the digits)" in " ".join(info["notes"])


def test_specforge_legacy_round_trip(tmp_path, cfg, state):
    folder = write_specforge_legacy(tmp_path, cfg, state)
    for given in (folder, folder / "training_state.pt"):
        out = strip_checkpoint(given, tmp_path / "out")
        assert_bf16_equal(out, state)
        info = json.loads((out / "strip_info.json").read_text())
        assert info["format"] == "specforge-legacy"
        assert info["step"] == 301  # global_step of training_state.pt wins over the name (noted)
        assert any("differs from the folder name's step 300" in n for n in info["notes"])


def test_specforge_round_trip_config_from_run_folder(tmp_path, cfg, state):
    step_dir = write_specforge(tmp_path, cfg, state)
    for given in (step_dir, step_dir / "training_state.pt"):
        out = strip_checkpoint(given, tmp_path / "out")
        assert_bf16_equal(out, state)
        info = json.loads((out / "strip_info.json").read_text())
        assert (info["format"], info["step"]) == ("specforge", 1200)
        assert info["config_source"] == str(tmp_path / "run" / "config.json")


def test_specforge_drafter_config_option(tmp_path, cfg, state):
    step_dir = write_specforge(tmp_path, cfg, state)
    (tmp_path / "run" / "config.json").unlink()
    with pytest.raises(InputError) as exc:
        strip_checkpoint(step_dir, tmp_path / "out")
    assert_refused(exc, step_dir / "training_state.pt", "config.json", tmp_path / "out")
    user_cfg = tmp_path / "user_config.json"
    user_cfg.write_text(json.dumps(cfg))
    out = strip_checkpoint(step_dir, tmp_path / "out", drafter_config=user_cfg)
    assert json.loads((out / "strip_info.json").read_text())["config_source"] == str(user_cfg)
    assert_bf16_equal(out, state)


@pytest.mark.parametrize("container,prefix,name", NESTINGS)
def test_torch_dict_round_trip(tmp_path, cfg, state, container, prefix, name):
    path = write_torch(tmp_path, cfg, state, container, prefix, name)
    out = strip_checkpoint(path, tmp_path / "out")
    assert_bf16_equal(out, state)
    info = json.loads((out / "strip_info.json").read_text())
    assert info["format"] == "torch-dict" + (f"[{container}]" if container else "")
    assert info["step"] == 500 if container else info["step"] is None


def test_a_stored_step_other_than_the_names_is_noted(tmp_path, cfg, state):
    """step3507.pt storing step 100 (a resumed run's local step) said nothing."""
    path = write_torch(tmp_path, cfg, state, "model", "", "step3507.pt")
    torch.save({**torch.load(path, weights_only=False), "step": 100}, path)
    info = json.loads((strip_checkpoint(path, tmp_path / "out") / "strip_info.json").read_text())
    assert info["step"] == 100 and "the checkpoint stores step 100, its name 'step3507' says 3507: the step column " \
        "uses the stored one" in info["notes"]


def test_dcp_round_trip(tmp_path, cfg, state):
    folder = write_dcp(tmp_path, cfg, state)
    assert detect_format(folder)[0] == "dcp"
    out = strip_checkpoint(folder, tmp_path / "out")
    assert_bf16_equal(out, state)
    info = json.loads((out / "strip_info.json").read_text())
    assert (info["format"], info["step"]) == ("dcp[model]", 700)
    assert any("skipped 4 non-parameter DCP entries" in n for n in info["notes"])  # 3 exp_avg + step


def test_custom_layout_with_target_tensors(tmp_path, cfg, state, caplog):
    import logging

    embed, head = write_target(tmp_path / "target")
    full = {**state, "embed_tokens.weight": embed.float(), "lm_head.weight": head.clone(),
            "verifier_lm_head.weight": head.clone()}
    torch.save({"model": full, "draft_config": cfg}, tmp_path / "big.pt")
    with caplog.at_level(logging.INFO, logger="dflash_eval.stages.strip_drafter"):
        out = strip_checkpoint(tmp_path / "big.pt", tmp_path / "out", target_dir=tmp_path / "target")
    # equal shared copies dropped: the expected case, logged at INFO (a WARNING only for what needs a look)
    dropped = [r for r in caplog.records if r.getMessage().endswith("equal to the target's; dropped")]
    assert len(dropped) == 3 and {r.levelname for r in dropped} == {"INFO"}
    assert_bf16_equal(out, state)
    info = json.loads((out / "strip_info.json").read_text())
    assert info["format"] == "torch-dict[model]+shared"
    assert info["dropped_shared"] == ["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"]

    other = dict(full, **{"lm_head.weight": head.flip(0)})  # a different target's head
    torch.save({"model": other, "draft_config": cfg}, tmp_path / "other.pt")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "other.pt", tmp_path / "out2", target_dir=tmp_path / "target")
    assert_refused(exc, tmp_path / "other.pt", "lm_head.weight", tmp_path / "out2")
    assert "different target" in str(exc.value)
    out = strip_checkpoint(tmp_path / "other.pt", tmp_path / "out2", target_dir=tmp_path / "target",
                           allow_shared_mismatch=True)
    notes = json.loads((out / "strip_info.json").read_text())["notes"]
    assert any(n.startswith("lm_head.weight: shared tensor differs") for n in notes)


def test_partial_rotary_factor_ignored_with_note(tmp_path, cfg, state):
    write_hf(tmp_path / "d", dict(cfg, partial_rotary_factor=0.25), state)
    out = strip_checkpoint(tmp_path / "d", tmp_path / "out")
    info = json.loads((out / "strip_info.json").read_text())
    assert any("partial_rotary_factor" in n for n in info["notes"])
    assert "partial_rotary_factor" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("field, value, where, problem", [
    ("rms_norm_eps", float("nan"), "rms_norm_eps", "not a finite number"),
    ("rope_theta", float("inf"), "rope_theta", "not a finite number"),
    ("rms_norm_eps", 0.0, "rms_norm_eps", "must be a positive number, got 0.0"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps", "must be a positive number, got '1e-6'"),
    ("output_multiplier", -1.0, "output_multiplier", "must be a positive number, got -1.0"),
    ("input_embedding_scale", 0, "input_embedding_scale", "must be a positive number, got 0"),
    ("final_logit_softcapping", -5.0, "final_logit_softcapping", "must be a positive number, got -5.0"),
    # bool("false") is True: it was refused, but as missing k_proj.bias tensors
    ("attention_bias", "false", "attention_bias", "must be true or false, got 'false'"),
])
def test_non_finite_or_non_positive_config_numbers_are_refused(tmp_path, cfg, state, field, value, where, problem):
    """``"rms_norm_eps": NaN`` in a checkpoint's config.json (Python's json reads it)
    built a drafter whose every draft was rejected: tau 1.0, exit 0. Refused by name, at strip and wherever a
    config is read (a stripped folder's config edited after strip too)."""
    write_hf(tmp_path / "d", dict(cfg, **{field: value}), state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", where, tmp_path / "out")
    assert problem in exc.value.problem
    from dflash_eval.drafter.config import DrafterConfig

    nested = dict(json.loads(json.dumps(cfg)), rope_parameters={"rope_type": "default", "rope_theta": float("nan")})
    nested.pop("rope_theta", None)  # the nested copy only (two copies must agree: another error)
    with pytest.raises(InputError) as exc:
        DrafterConfig.from_dict(nested, "x/config.json")
    assert exc.value.field == "rope_parameters.rope_theta" and "not a finite number" in exc.value.problem


def test_missing_target_layer_ids_needs_override(tmp_path, cfg, state):
    bad = json.loads(json.dumps(cfg))
    del bad["dflash_config"]["target_layer_ids"]
    write_hf(tmp_path / "d", bad, state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", "dflash_config.target_layer_ids", tmp_path / "out")
    out = strip_checkpoint(tmp_path / "d", tmp_path / "out", overrides={"target_layer_ids": LAYER_IDS})
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == LAYER_IDS


def test_fp16_refused_unless_allowed(tmp_path, cfg):
    src = random_state(cfg, seed=3, dtype=torch.float16)
    write_hf(tmp_path / "d", cfg, src)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "model.safetensors", "fc.weight", tmp_path / "out")
    assert "--allow-fp16" in str(exc.value)
    out = strip_checkpoint(tmp_path / "d", tmp_path / "out", allow_fp16=True)
    assert_bf16_equal(out, src)


def test_failed_strip_keeps_previous_output(tmp_path, cfg, state):
    write_hf(tmp_path / "good", cfg, state)
    out = strip_checkpoint(tmp_path / "good", tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    torch.save([1, 2], tmp_path / "bad.pt")
    with pytest.raises(InputError):
        strip_checkpoint(tmp_path / "bad.pt", tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == before


# --------------------------------------------------------------------------- bad input
def test_truncated_safetensors(tmp_path, cfg, state):
    folder = write_hf(tmp_path / "d", cfg, state)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])  # the last tensor in the file loses its tail
    header_len = int.from_bytes(data[:8], "little")
    offsets = {k: v["data_offsets"] for k, v in json.loads(data[8:8 + header_len]).items() if k != "__metadata__"}
    last = max(offsets, key=lambda k: offsets[k][1])
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, f, last, tmp_path / "out")
    assert "truncated" in str(exc.value)

    f.write_bytes(data[:5])
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, f, "header", tmp_path / "out")


def test_sharded_index_names_missing_shard(tmp_path, cfg, state):
    folder = write_hf(tmp_path / "d", cfg, state, shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    (folder / "model-00002-of-00002.safetensors").unlink()
    first = min(k for k, s in index.items() if s == "model-00002-of-00002.safetensors")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, folder / "model.safetensors.index.json", f"weight_map.{first}", tmp_path / "out")


def test_pt_not_a_dict(tmp_path):
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "list.pt", tmp_path / "out")
    assert_refused(exc, tmp_path / "list.pt", "top level", tmp_path / "out")
    assert "list, not a dict" in str(exc.value)


@pytest.mark.parametrize("content, problem", [
    (b"", "empty file (0 bytes): not a torch checkpoint"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 12\n", "a Git LFS pointer, not the checkpoint"),
    (b"<html><body>403 Forbidden</body></html>\n", "a text file, not a torch checkpoint (starts with '<html>"),
    (b"\x00\x01\x02junk", "neither a zip archive nor a pickle"),
])
def test_pt_that_is_not_a_torch_file(tmp_path, content, problem):
    """These ended in the unpickler's bare message (': 101.')."""
    (tmp_path / "bad.pt").write_bytes(content)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "bad.pt", tmp_path / "out")
    assert_refused(exc, tmp_path / "bad.pt", problem, tmp_path / "out")


def test_safetensors_that_is_a_git_lfs_pointer(tmp_path, cfg):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "d" / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\n")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "model.safetensors", "git lfs pull", tmp_path / "out")


class Opaque:
    """A class a weights-only unpickler must refuse to import."""

    def __init__(self):
        self.x = 1


def test_pickle_needing_unknown_class(tmp_path, cfg, state):
    torch.save({"model": state, "draft_config": cfg, "trainer": Opaque()}, tmp_path / "p.pt")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "p.pt", tmp_path / "out")
    assert_refused(exc, tmp_path / "p.pt", f"{__name__}.Opaque", tmp_path / "out")
    assert "weights_only=True" in str(exc.value)


def test_dcp_metadata_pickle_is_not_executed(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    (folder / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, folder / ".metadata", "system", tmp_path / "out")
    assert not (tmp_path / "pwned").exists()


def test_mismatched_shapes(tmp_path, cfg, state):
    bad = dict(state, **{"layers.1.mlp.up_proj.weight": torch.zeros(96, 64)})
    write_hf(tmp_path / "d", cfg, bad)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "model.safetensors", "layers.1.mlp.up_proj.weight", tmp_path / "out")
    assert "checkpoint (96, 64) vs config (128, 64)" in str(exc.value)


def test_fc_width_must_match_target_layer_ids(tmp_path, cfg, state):
    write_hf(tmp_path / "d", dict(cfg, dflash_config=dict(cfg["dflash_config"], target_layer_ids=[1, 3])), state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "model.safetensors", "fc.weight", tmp_path / "out")
    assert "in_features 192 != len(dflash_config.target_layer_ids) 2 x hidden_size 64" in str(exc.value)
    assert "fuse 3 target layers" in str(exc.value)


def test_missing_and_unexpected_keys_all_listed(tmp_path, cfg, state):
    bad = {k: v for k, v in state.items() if k != "norm.weight"}
    bad["layers.0.self_attn.rel_bias.weight"] = torch.zeros(4)
    write_hf(tmp_path / "d", cfg, bad)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "model.safetensors", "missing keys ['norm.weight']", tmp_path / "out")
    assert "unexpected keys ['layers.0.self_attn.rel_bias.weight']" in str(exc.value)


@pytest.mark.parametrize("field", ["intermediate_size", "hidden_size", "vocab_size"])
def test_missing_config_field(tmp_path, cfg, state, field):
    write_hf(tmp_path / "d", {k: v for k, v in cfg.items() if k != field}, state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", f"{field}: missing", tmp_path / "out")


def test_duplicate_keys_after_prefix_stripping(tmp_path, cfg, state):
    dup = {**state, "module.fc.weight": state["fc.weight"].clone()}
    torch.save({"model": dup, "draft_config": cfg}, tmp_path / "dup.pt")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "dup.pt", tmp_path / "out")
    assert_refused(exc, tmp_path / "dup.pt", "module.fc.weight", tmp_path / "out")
    assert "both become 'fc.weight'" in str(exc.value)


def test_layer_ids_beyond_target(tmp_path, cfg, state):
    write_target(tmp_path / "target", layers=4)
    write_hf(tmp_path / "d", cfg, state)
    with pytest.raises(InputError) as exc:  # id 4 of [0, 2, 4] needs 5 target layers
        strip_checkpoint(tmp_path / "d", tmp_path / "out", target_dir=tmp_path / "target")
    assert_refused(exc, tmp_path / "d" / "config.json", "dflash_config.target_layer_ids", tmp_path / "out")
    assert "[4] out of range for the 4-layer target" in str(exc.value)
    write_hf(tmp_path / "e", dict(cfg, num_target_layers=4), state)  # no target: the config's own count
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "e", tmp_path / "out")
    assert_refused(exc, tmp_path / "e" / "config.json", "dflash_config.target_layer_ids", tmp_path / "out")


def test_mask_token_must_be_a_target_row(tmp_path, cfg, state):
    write_target(tmp_path / "target", vocab=MASK_ID)  # rows 0..95, mask id 96
    write_hf(tmp_path / "d", cfg, state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out", target_dir=tmp_path / "target")
    assert_refused(exc, tmp_path / "d" / "config.json", "dflash_config.mask_token_id", tmp_path / "out")
    write_hf(tmp_path / "e", dict(cfg, dflash_config=dict(cfg["dflash_config"], mask_token_id=VOCAB)), state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "e", tmp_path / "out")
    assert_refused(exc, tmp_path / "e" / "config.json", "dflash_config.mask_token_id", tmp_path / "out")


def test_non_finite_weights(tmp_path, cfg, state):
    bad = dict(state)
    bad["layers.0.self_attn.q_proj.weight"] = bad["layers.0.self_attn.q_proj.weight"].clone()
    bad["layers.0.self_attn.q_proj.weight"][3, 5] = float("nan")
    write_hf(tmp_path / "d", cfg, bad)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "model.safetensors", "layers.0.self_attn.q_proj.weight", tmp_path / "out")


def test_specforge_state_without_draft_state_dict(tmp_path, state):
    (tmp_path / "run-step5").mkdir()
    torch.save({"model": state, "global_step": 5}, tmp_path / "run-step5" / "training_state.pt")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "run-step5", tmp_path / "out")
    assert_refused(exc, tmp_path / "run-step5" / "training_state.pt", "draft_state_dict", tmp_path / "out")


def test_sliding_layers_need_use_sliding_window(tmp_path):
    cfg = tiny_config(sliding=True)
    state = random_state(cfg)
    write_hf(tmp_path / "d", dict(cfg, use_sliding_window=False), state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", "use_sliding_window", tmp_path / "out")


def _drop(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize("edit, field, words", [
    # a sliding layer without its window: transformers would give 4096 (absent) or none (null); never assumed
    (lambda c: _drop(c, "sliding_window"), "sliding_window", "missing while layers [0, 1] are sliding_attention"),
    (lambda c: dict(c, sliding_window=None), "sliding_window", "null while layers [0, 1] are sliding_attention"),
    # derived layer types (no layer_types; layers >= max_window_layers slide) without the window
    (lambda c: dict(_drop(_drop(c, "layer_types"), "sliding_window"), max_window_layers=1), "sliding_window",
     "missing while layers [1, 2] are sliding_attention"),
    (lambda c: dict(c, sliding_window=0), "sliding_window", "must be a positive integer, got 0"),
    (lambda c: dict(c, sliding_window=-8), "sliding_window", "must be a positive integer, got -8"),
    (lambda c: dict(c, sliding_window="2048"), "sliding_window", "must be a positive integer, got '2048'"),
    (lambda c: dict(c, sliding_window=8.5), "sliding_window", "must be a positive integer, got 8.5"),
    (lambda c: dict(c, sliding_window=True), "sliding_window", "must be a positive integer, got True"),
    (lambda c: dict(c, layer_types=c["layer_types"][:2]), "layer_types", "got ['sliding_attention', 'sliding_attention'] (2 entries)"),
    (lambda c: dict(c, layer_types=c["layer_types"] + ["full_attention"]), "layer_types", "(4 entries)"),
    (lambda c: dict(c, layer_types=[]), "layer_types", "got [] (0 entries)"),
    (lambda c: dict(c, layer_types=["sliding_attention", "linear_attention", "full_attention"]), "layer_types",
     "unknown: ['linear_attention']"),
    (lambda c: dict(c, layer_types="sliding_attention"), "layer_types", "got 'sliding_attention'"),
    (lambda c: dict(c, use_sliding_window=False), "use_sliding_window", "but use_sliding_window is False"),
    (lambda c: _drop(c, "use_sliding_window"), "use_sliding_window", "but use_sliding_window is None"),
    (lambda c: dict(_drop(c, "layer_types"), max_window_layers=-1), "max_window_layers",
     "must be a non-negative integer, got -1"),
])
def test_window_and_layer_types_refused(tmp_path, edit, field, words):
    """A window or layer types that are missing, malformed or contradictory: refused at strip, naming the field."""
    cfg = tiny_config(sliding=True)  # layers [sliding, sliding, full], window 8
    write_hf(tmp_path / "d", edit(cfg), random_state(cfg))
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", field, tmp_path / "out")
    assert exc.value.field == field and words in exc.value.problem, exc.value.problem
    if field == "sliding_window" and "positive" not in words:
        assert "give sliding_window as trained" in exc.value.fix


@pytest.mark.parametrize("max_window_layers", [0, 1, 3, 28])
def test_explicit_layer_types_decide_over_max_window_layers(tmp_path, max_window_layers):
    """``max_window_layers`` is read only without ``layer_types`` (transformers Qwen3Config, so the reference): with
    explicit types any value of it loads the same windows in the reference and here."""
    import dflash.model as dflash_model
    from transformers import Qwen3Config

    from dflash_eval.drafter.config import DrafterConfig

    cfg = dict(tiny_config(sliding=True), max_window_layers=max_window_layers)
    ref = dflash_model.DFlashDraftModel(Qwen3Config(**json.loads(json.dumps(cfg))))
    assert [layer.self_attn.sliding_window for layer in ref.layers] == [8, 8, None]
    assert DrafterConfig.from_dict(cfg).layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    write_hf(tmp_path / "d", cfg, random_state(tiny_config(sliding=True)))
    ours = load_drafter(strip_checkpoint(tmp_path / "d", tmp_path / "out"))
    assert [layer.self_attn.window for layer in ours.layers] == [8, 8, None]


@pytest.mark.parametrize("kind", ["txt", "empty-folder", "safetensors-file"])
def test_unsupported_input_lists_formats(tmp_path, kind):
    path = {"txt": tmp_path / "notes.txt", "empty-folder": tmp_path / "empty",
            "safetensors-file": tmp_path / "model.safetensors"}[kind]
    if kind == "empty-folder":
        path.mkdir()
    else:
        path.write_text("x")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(path, tmp_path / "out")
    assert_refused(exc, path, "format", tmp_path / "out")
    assert all(name in str(exc.value) for name in FORMATS)


def test_cli_strip_reports_bad_override(tmp_path, cfg, state, capsys):
    from dflash_eval.cli import main

    write_hf(tmp_path / "d", cfg, state)
    rc = main(["strip", "--checkpoint", str(tmp_path / "d"), "--out-dir", str(tmp_path / "out"),
               "--override", "target_layer_ids=[1,2"])
    assert rc == 2
    assert "--override" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    rc = main(["strip", "--checkpoint", str(tmp_path / "d"), "--out-dir", str(tmp_path / "out"),
               "--override", f"mask_token_id={MASK_ID - 1}"])
    assert rc == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"]["mask_token_id"] == MASK_ID - 1
    notes = json.loads((tmp_path / "out" / "strip_info.json").read_text())["notes"]
    assert f"override mask_token_id={MASK_ID - 1} replaces the checkpoint's dflash_config.mask_token_id={MASK_ID}" in notes


@pytest.mark.parametrize("key,value", [("use_swa", True), ("causal", True), ("attention_sink_bias", True)])
def test_unimplemented_variant_refused(tmp_path, cfg, state, key, value):
    write_hf(tmp_path / "d", dict(cfg, dflash_config=dict(cfg["dflash_config"], **{key: value})), state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", f"dflash_config.{key}", tmp_path / "out")


def test_partial_dflash2_config_names_the_missing_fields(tmp_path, cfg, state):
    """One DFlash 2 field alone is neither DFlash 1 nor a buildable DFlash 2: refused, naming what is missing."""
    write_hf(tmp_path / "d", dict(cfg, dflash_config=dict(cfg["dflash_config"], conv_kernel_size=4)), state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", "dflash_config.conv_group_size", tmp_path / "out")
    assert "['conv_group_size', 'selector_rank', 'selector_top_k'] missing" in str(exc.value)



# --------------------------------------------------------------------------- fields stored twice
@pytest.mark.parametrize("edit, field, values", [
    (lambda c: c.update(block_size=4), "block_size", ("dflash_config.block_size=8", "block_size=4")),
    (lambda c: c.update(mask_token_id=5), "mask_token_id", (f"dflash_config.mask_token_id={MASK_ID}", "mask_token_id=5")),
    (lambda c: c.update(target_layer_ids=[0, 1, 2]), "target_layer_ids",
     (f"dflash_config.target_layer_ids={LAYER_IDS}", "target_layer_ids=[0, 1, 2]")),
    (lambda c: c.update(dtype="bfloat16", torch_dtype="float32"), "dtype", ("dtype='bfloat16'", "torch_dtype='float32'")),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "rope_theta",
     ("rope_theta=10000.0", "rope_parameters.rope_theta=1000000.0")),
    (lambda c: c.update(rope_parameters={"rope_type": "default"}, rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_parameters", ("rope_parameters={'rope_type': 'default'}", "rope_scaling={'factor': 2.0, 'rope_type': 'linear'}")),
    (lambda c: c.update(rope_parameters={"type": "yarn", "rope_type": "default"}), "rope_parameters",
     ("rope_parameters (read by 'type')={'rope_type': 'yarn'}", "rope_parameters (read by 'rope_type')={'rope_type': 'default'}")),
])
def test_field_stored_twice_with_different_values_is_refused(tmp_path, cfg, state, edit, field, values):
    """Never a silent choice between two copies: the error names both values and the --override fix;
    the override settles it by writing its value to every copy (and says what it replaced)."""
    bad = json.loads(json.dumps(cfg))
    edit(bad)
    write_hf(tmp_path / "d", bad, state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert_refused(exc, tmp_path / "d" / "config.json", field, tmp_path / "out")
    assert all(v in str(exc.value) for v in values), str(exc.value)
    assert f"--override {field}=" in exc.value.fix
    value = {"block_size": 8, "mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS, "dtype": "bfloat16",
             "rope_theta": 1e6, "rope_parameters": {"rope_type": "default"}}[field]
    out = strip_checkpoint(tmp_path / "d", tmp_path / "out", overrides={field: value})
    written = json.loads((out / "config.json").read_text())
    notes = json.loads((out / "strip_info.json").read_text())["notes"]
    assert any(n.startswith(f"override {field}=") for n in notes), notes
    from dflash_eval.drafter.config import check_duplicated_fields, field_locations

    check_duplicated_fields(written, "written")  # the output is consistent
    if field == "rope_theta":
        assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == 1e6
    if field == "rope_parameters":
        assert written["rope_parameters"] == {"rope_type": "default"} == written.get("rope_scaling", {"rope_type": "default"})
    if field in ("block_size", "mask_token_id", "target_layer_ids"):
        assert {json.dumps(v) for _, v in field_locations(written)[field]} == {json.dumps(value)}


def test_agreeing_copies_say_nothing(tmp_path, cfg, state):
    same = dict(cfg, dtype="float32", torch_dtype="float32", mask_token_id=MASK_ID,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    write_hf(tmp_path / "d", same, state)
    out = strip_checkpoint(tmp_path / "d", tmp_path / "out")
    assert json.loads((out / "strip_info.json").read_text())["notes"] == []


def test_strip_never_modifies_the_input_config(tmp_path, cfg, state):
    """transformers writes rope_theta into the RoPE dict it is given; neither the caller's dict nor the
    written config may gain it (the stripped rope_scaling must be the checkpoint's)."""
    from dflash_eval.drafter.model import DrafterConfig

    scaled = dict(cfg, rope_scaling={"rope_type": "linear", "factor": 2.0})
    before = json.loads(json.dumps(scaled))
    parsed = DrafterConfig.from_dict(scaled)
    DFlashDrafter(parsed)
    assert scaled == before and parsed.raw["rope_scaling"] == before["rope_scaling"]
    write_hf(tmp_path / "d", scaled, random_state(scaled, seed=1))
    text = (tmp_path / "d" / "config.json").read_text()
    out = strip_checkpoint(tmp_path / "d", tmp_path / "out", overrides={"mask_token_id": MASK_ID - 1})
    assert (tmp_path / "d" / "config.json").read_text() == text
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert written["dflash_config"]["mask_token_id"] == MASK_ID - 1
    # and the scaling is applied: positions are divided by 2 (linear RoPE), as in the reference Qwen3Config
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    ref = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in before.items() if k != "dflash_config"}))
    mine = load_drafter(out, device="cpu", dtype=torch.float32)
    assert torch.allclose(mine.rotary_emb.inv_freq, ref.inv_freq)
    assert mine.rotary_emb.attention_scaling == ref.attention_scaling


def test_unknown_override_key_is_an_error(tmp_path, cfg, state, capsys):
    from dflash_eval.cli import main

    write_hf(tmp_path / "d", cfg, state)
    rc = main(["strip", "--checkpoint", str(tmp_path / "d"), "--out-dir", str(tmp_path / "out"),
               "--override", "frobnicate=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "'frobnicate'" in err and "mask_token_id" in err and not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="did you mean 'mask_token_id'"):
        strip_checkpoint(tmp_path / "d", tmp_path / "out", overrides={"mask_token": 3})


def test_two_different_embedded_configs_are_refused(tmp_path, cfg, state):
    other = dict(cfg, dflash_config=dict(cfg["dflash_config"], mask_token_id=3))
    torch.save({"model": state, "draft_config": cfg, "config": other, "step": 5}, tmp_path / "two.pt")
    with pytest.raises(InputError) as exc:
        strip_checkpoint(tmp_path / "two.pt", tmp_path / "out")
    assert_refused(exc, tmp_path / "two.pt", "draft_config / config", tmp_path / "out")
    (tmp_path / "right.json").write_text(json.dumps(cfg))
    out = strip_checkpoint(tmp_path / "two.pt", tmp_path / "out", drafter_config=tmp_path / "right.json")
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"] == MASK_ID
    # a training-arguments dict under 'config' is not a drafter config: no conflict
    torch.save({"model": state, "draft_config": cfg, "config": {"lr": 1e-4}}, tmp_path / "args.pt")
    strip_checkpoint(tmp_path / "args.pt", tmp_path / "out2")


def test_a_drafter_config_of_another_vocabulary_is_noted(cfg):
    """a drafter config whose vocab_size is not the target's passed without a word (the
    drafter drafts with the target's embedding and head, so it runs; the config may be another target's)."""
    from pathlib import Path as P

    from dflash_eval.drafter.compat import check_compat
    from dflash_eval.drafter.config import DrafterConfig
    from dflash_eval.target.spec import TargetSpec

    spec = TargetSpec(path=P("t"), config={}, model_type="qwen3", num_layers=TARGET_LAYERS, hidden_size=cfg["hidden_size"],
                      vocab_size=cfg["vocab_size"])
    assert check_compat(DrafterConfig.from_dict(cfg), "c.json", target=spec) == []
    other = DrafterConfig.from_dict(dict(cfg, vocab_size=cfg["vocab_size"] + 7))
    assert check_compat(other, "c.json", target=spec) == [
        f"config vocab_size {cfg['vocab_size'] + 7} != the target's {cfg['vocab_size']} (t): the drafter drafts with the "
        "target's embedding and LM head; check that this is its target"]


def test_huge_finite_weights_are_named_in_the_strip_notes(tmp_path, cfg, state):
    """norm.weight 1e30 (finite) passed strip without a word; a weight far above a trained
    drafter's is named in strip_info.json's notes (and the job log); a trained one is not."""
    big = {k: v.clone() for k, v in state.items()}
    big["norm.weight"][0] = 1e30
    write_hf(tmp_path / "d", cfg, big)
    notes = json.loads((strip_checkpoint(tmp_path / "d", tmp_path / "out") / "strip_info.json").read_text())["notes"]
    assert [n for n in notes if "largest magnitude" in n] == [
        "norm.weight: largest magnitude 1e+30, far above a trained drafter's weights (a diverged or damaged checkpoint?)"]
    write_hf(tmp_path / "ok", cfg, state)
    ok = json.loads((strip_checkpoint(tmp_path / "ok", tmp_path / "out2") / "strip_info.json").read_text())["notes"]
    assert not [n for n in ok if "largest magnitude" in n]


def test_trained_max_len_read_from_the_training_block():
    """dflash_config.training.max_len (dflash_eval.drafter.train writes it; the demo drafters hold 640); absent or
    malformed: None."""
    import copy

    from dflash_eval.drafter.config import DrafterConfig

    cfg = json.loads((Path(__file__).parents[1] / "fixtures" / "trained_drafter" / "step300" / "config.json").read_text())
    assert DrafterConfig.from_dict(cfg).trained_max_len == cfg["dflash_config"]["training"]["max_len"] > 0
    for bad in (None, "640", 0, True):
        c = copy.deepcopy(cfg)
        c["dflash_config"]["training"]["max_len"] = bad
        assert DrafterConfig.from_dict(c).trained_max_len is None, bad
    del cfg["dflash_config"]["training"]
    assert DrafterConfig.from_dict(cfg).trained_max_len is None
