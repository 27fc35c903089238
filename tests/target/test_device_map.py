"""The device-map planner on fake GPU memories, and extraction through a dispatched (hooked) target on CPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflash_eval.target.device_map import AUTO_FRACTION, gib, meta_model, parse_size, plan_device_map
from dflash_eval.core.errors import InputError
from dflash_eval.target.spec import TargetSpec
from tiny import make_tiny_target

F32 = torch.float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny 4-layer target, its meta model and its float32 weight bytes X."""
    from accelerate.utils import compute_module_sizes

    spec = TargetSpec.read(make_tiny_target(tmp_path_factory.mktemp("t") / "t", num_layers=4, hidden=64))
    model = meta_model(spec, F32)
    sizes = compute_module_sizes(model, dtype=F32)
    # hand count: embed + head 384x64 each, 4 layers of q,o 64x64 + k,v 64x32 + MLP 3 x 64x(intermediate) + 2 norms
    assert sizes["model.embed_tokens"] == sizes["lm_head"] == 384 * 64 * 4
    return spec, model, int(sizes[""])


def _layer_devices(plan) -> list:
    return [plan.device_map[f"model.layers.{i}"] for i in range(4)]


def test_fits_one_gpu(tiny):
    spec, model, X = tiny
    plan = plan_device_map(spec, F32, free={0: 2 * X, 1: 2 * X}, model=model)
    assert plan.gpus == (0,) and not plan.split and plan.target_bytes == X
    assert set(plan.device_map.values()) == {0}
    assert plan.budgets == {0: int(2 * X * AUTO_FRACTION), 1: int(2 * X * AUTO_FRACTION)}


def test_needs_two_gpus(tiny):
    spec, model, X = tiny
    plan = plan_device_map(spec, F32, free={0: X, 1: X}, model=model)  # 0.85 X each: neither alone holds X
    assert plan.gpus == (0, 1) and plan.split
    dm = plan.device_map
    assert dm["model.embed_tokens"] == 0 and dm["model.norm"] == 1 and dm["lm_head"] == 1
    layers = _layer_devices(plan)
    assert layers == sorted(layers) and set(layers) == {0, 1}  # in order: inputs enter on GPU 0
    assert re.fullmatch(r"cuda:0: layers 0-\d \+ embed_tokens; cuda:1: layers \d-3 \+ .*lm_head.*", plan.describe())


def test_tied_head_stays_with_the_embedding(tmp_path):
    spec = TargetSpec.read(make_tiny_target(tmp_path / "tied", num_layers=4, hidden=64, tie_word_embeddings=True))
    from accelerate.utils import compute_module_sizes

    model = meta_model(spec, F32)
    X = int(compute_module_sizes(model, dtype=F32)[""])
    plan = plan_device_map(spec, F32, free={0: X, 1: X}, model=model)
    assert plan.split and plan.device_map["lm_head"] == plan.device_map["model.embed_tokens"] == 0
    assert plan.device_map["model.norm"] == 1 and plan.target_bytes == X  # the shared matrix counted once


def test_fits_no_gpu_names_size_memories_and_options(tiny):
    spec, model, X = tiny
    with pytest.raises(InputError) as err:
        plan_device_map(spec, F32, free={0: X // 3, 1: X // 3}, model=model)
    msg = str(err.value)
    assert f"need {gib(X)} in float32" in msg
    for g in (0, 1):
        assert f"cuda:{g} {gib(X // 3)} free, {gib(int(X // 3 * AUTO_FRACTION))} for weights" in msg
    assert "target.devices" in msg and "target.max_memory" in msg and "CUDA_VISIBLE_DEVICES" in msg


def test_devices_n_balances_and_max_memory_caps(tiny):
    spec, model, X = tiny
    big = {0: 8 * X, 1: 8 * X, 2: 8 * X}
    plan = plan_device_map(spec, F32, free=big, devices=2, model=model)
    assert plan.gpus == (0, 1) and set(_layer_devices(plan)) == {0, 1} and 2 not in plan.budgets
    capped = plan_device_map(spec, F32, free=big, max_memory={"0": X // 2}, model=model)
    assert capped.split and capped.budgets[0] == X // 2 and capped.device_map["model.embed_tokens"] == 0
    with pytest.raises(InputError, match="3 GPUs asked, 2 visible"):
        plan_device_map(spec, F32, free={0: X, 1: X}, devices=3, model=model)
    with pytest.raises(InputError, match="GPU 5 is not visible"):
        plan_device_map(spec, F32, free={0: X}, max_memory={"5": "1GiB"}, model=model)
    with pytest.raises(InputError, match="no GPU visible"):
        plan_device_map(spec, F32, free={}, model=model)


def test_one_gpu_between_budget_and_free_memory_loads_as_before(tiny):
    spec, model, X = tiny
    plan = plan_device_map(spec, F32, free={0: int(X / 0.95)}, model=model)  # above 85 %, below 100 %
    assert plan.gpus == (0,) and plan.device_map == {"": 0}


def test_parse_size():
    assert parse_size("40GiB") == 40 * 2**30 and parse_size("48GB") == 48 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20 and parse_size(123) == 123 and parse_size("1.5KB") == 1500
    for bad in ("forty", "-1GB", True, -5, "3 parsecs"):
        with pytest.raises(InputError):
            parse_size(bad)


def test_extraction_through_a_dispatched_target_is_bit_identical(tmp_path, monkeypatch):
    """The cache of a target whose modules run under Accelerate's device hooks (the split-target path:
    inputs moved to each module's device, layers' states gathered on the writer's device) equals the
    one-device cache bit for bit. On CPU every hook's device is the CPU: this checks the capture and
    gather code under the hooks, not the copies between real GPUs."""
    from accelerate import dispatch_model

    import dflash_eval.stages.hidden_states as hs
    from dflash_eval.cache.reader import CacheReader

    target = make_tiny_target(tmp_path / "t", num_layers=4, hidden=64)
    rows = [{"id": f"x{i}", "prompt_ids": [5, 6, 7, 8][: i + 1], "completion_ids": [9, 10, 11][: 3 - i % 2],
             "stop_reason": "eos", "max_new_tokens": 4} for i in range(4)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    layers = [0, 2, 3]  # 3 = the last layer: final-normed on the norm's device
    for packing in ("auto", "off"):
        one = hs.extract_hidden_states(target, tmp_path / "c.jsonl", tmp_path / f"one-{packing}.h5", layers,
                                       device="cpu", packing=packing)
        real_load, dispatched = hs.load_target, []

        def load_dispatched(*args, **kwargs):
            model, tok, kernel = real_load(*args, **kwargs)
            dm = {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(4)},
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
            model = dispatch_model(model, device_map=dm, force_hooks=True)
            dispatched.append(all(hasattr(m, "_hf_hook") for m in model.model.layers))
            return model, tok, kernel

        monkeypatch.setattr(hs, "load_target", load_dispatched)
        split = hs.extract_hidden_states(target, tmp_path / "c.jsonl", tmp_path / f"split-{packing}.h5", layers,
                                         device="cpu", packing=packing)
        monkeypatch.setattr(hs, "load_target", real_load)
        assert dispatched == [True]
        with CacheReader(one) as a, CacheReader(split) as b:
            assert len(a) == len(b) == 4
            for i in range(4):
                sa, sb = a.sample(i), b.sample(i)
                assert torch.equal(sa.hidden, sb.hidden) and sa.hidden.abs().sum() > 0
                assert torch.equal(sa.target_argmax, sb.target_argmax)
