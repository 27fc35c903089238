"""The vLLM hidden-states source without a server: layer mapping, flags, dump checks, argmax, final norm.

The real-server tests are in ``tests/serving/test_vllm_states.py``.
"""

from __future__ import annotations

import fcntl
import json
import threading
import time

import numpy as np
import pytest
import torch

from dflash_eval.core.errors import InputError
from dflash_eval.serving.vllm.states import (LAYER_OFFSET, aux_layer_ids, argmax_from_logprobs, check_dump, connector_module_dir,
                                     dump_columns, extract_args, final_norm, read_dump)


def test_layer_mapping_is_plus_one_in_layer_order():
    assert LAYER_OFFSET == 1
    assert aux_layer_ids([27, 1, 15]) == [2, 16, 28]
    cols = dump_columns([27, 1, 15])  # cache order kept: column of each dflash id in the dump
    assert cols == [2, 0, 1]
    assert [aux_layer_ids([27, 1, 15])[c] - 1 for c in cols] == [27, 1, 15]


def test_extract_args_name_the_connector_and_turn_prefix_caching_off(tmp_path):
    args = extract_args([1, 8], tmp_path / "d", connector="cpu")
    assert args[0] == "--no-enable-prefix-caching"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 9]}}}
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "CPUHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "dflash_eval_vllm_connector"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path / "d")}
    stock = json.loads(extract_args([1, 8], tmp_path, connector="stock")[4])
    assert stock["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in stock
    d = connector_module_dir(tmp_path)
    assert sorted(p.name for p in d.iterdir()) == ["dflash_eval_vllm_connector.py"]
    assert "class CPUHiddenStatesConnector(ExampleHiddenStatesConnector)" in (d / "dflash_eval_vllm_connector.py").read_text()


def _dump(T=5, K=2, H=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(T, K, H, generator=g), "token_ids": torch.arange(10, 10 + T)}


def test_check_dump_accepts_a_good_dump_and_names_every_fault(tmp_path):
    ids = list(range(10, 15))
    d = _dump()
    assert check_dump(d, ids, 2, 4, tmp_path / "x", "s", [1, 8]) is d["hidden_states"]
    with pytest.raises(InputError, match=r"sample s: the dump's 5 token ids differ from the completion's 5 \(first "
                                         r"difference at 2\)"):
        check_dump(d, [10, 11, 99, 13, 14], 2, 4, tmp_path / "x", "s", [1, 8])
    with pytest.raises(InputError, match=r"shape \(5, 2, 4\), expected \(5, 3, 4\).*\[2, 9, 16\]"):
        check_dump(d, ids, 3, 4, tmp_path / "x", "s", [1, 8, 15])
    bad = _dump()
    bad["hidden_states"][2, 1, 0] = float("nan")
    with pytest.raises(InputError, match="non-finite"):
        check_dump(bad, ids, 2, 4, tmp_path / "x", "s", [1, 8])
    zero = _dump()
    zero["hidden_states"][3:, 1] = 0.0  # what hybrid targets gave before vLLM PR #46301
    with pytest.raises(InputError, match=r"vLLM layer 9 \(target layer 8\) holds 2 of 5 tokens all zero.*#46301"):
        check_dump(zero, ids, 2, 4, tmp_path / "x", "s", [1, 8])
    const = _dump()
    const["hidden_states"][:, 0] = const["hidden_states"][0, 0]
    with pytest.raises(InputError, match=r"vLLM layer 2 \(target layer 1\) holds the same vector at every token"):
        check_dump(const, ids, 2, 4, tmp_path / "x", "s", [1, 8])


def test_argmax_from_prompt_logprobs():
    # position t's entry: rank-1 token given tokens < t, plus the prompt token itself
    choice = {"prompt_logprobs": [None,
                                  {"7": {"logprob": -3.0, "rank": 4}, "5": {"logprob": -0.1, "rank": 1}},
                                  {"8": {"logprob": -0.2, "rank": 1}},
                                  {"9": {"logprob": -1.0, "rank": 1}, "3": {"logprob": -1.0, "rank": 1}}],
              "token_ids": [42]}
    # a tie at position 3 (both rank 1): the prompt token (listed last) is taken
    assert argmax_from_logprobs(choice, 4).tolist() == [5, 8, 3, 42]
    with pytest.raises(ValueError, match="prompt_logprobs of 4 positions"):
        argmax_from_logprobs(choice, 5)


def test_read_dump_waits_for_the_writer_lock_and_deletes_the_files(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "req.safetensors"
    lock = tmp_path / "req.safetensors.lock"
    fd = open(lock, "w")
    fcntl.flock(fd, fcntl.LOCK_EX)  # the connector holds it until the file is written
    d = _dump()

    def writer():
        time.sleep(0.5)
        save_file(d, str(path))
        fd.close()

    th = threading.Thread(target=writer)
    th.start()
    t0 = time.perf_counter()
    got = read_dump(path)
    assert time.perf_counter() - t0 >= 0.4
    th.join()
    assert torch.equal(got["hidden_states"], d["hidden_states"]) and torch.equal(got["token_ids"], d["token_ids"])
    assert not path.exists() and not lock.exists()
    with pytest.raises(InputError, match="did not appear within 0 s"):
        read_dump(tmp_path / "never.safetensors", timeout_s=0.2)


def test_final_norm_equals_the_hf_last_hidden_state(tmp_path):
    from tiny import make_tiny_target
    from transformers import AutoModelForCausalLM

    from dflash_eval.target.spec import TargetSpec

    target = make_tiny_target(tmp_path / "t", arch="llama", num_layers=3, hidden=32)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 20, 7, 2]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        # vLLM's aux id N: the residual after the last layer, before the final norm
        pre = model.model.layers[-1](out.hidden_states[-2], position_embeddings=model.model.rotary_emb(
            out.hidden_states[-2], torch.arange(6)[None]))
        pre = pre[0] if isinstance(pre, tuple) else pre
    norm = final_norm(TargetSpec.read(target))
    got = norm(pre[0])
    assert torch.allclose(got, out.hidden_states[-1][0], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(pre[0], out.hidden_states[-1][0], atol=1e-3)  # the norm matters


def test_final_norm_refuses_other_norm_types(tmp_path):
    from dflash_eval.target.spec import TargetSpec

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 4,
                                                      "hidden_size": 8, "vocab_size": 16}))
    with pytest.raises(InputError, match="model type 'gemma3_text' it is not reproduced here"):
        final_norm(TargetSpec.read(tmp_path))


def test_check_dump_takes_bf16_dumps_as_they_are():
    # checked in float32, returned in the dump dtype (the cache stores bf16 as its raw bits)
    d = {"hidden_states": torch.randn(3, 1, 4).to(torch.bfloat16), "token_ids": torch.tensor([1, 2, 3])}
    assert check_dump(d, np.array([1, 2, 3]), 1, 4, "p", "s", [0]).dtype == torch.bfloat16


def test_a_server_not_in_extract_mode_is_a_clear_error(tmp_path):
    from standin_server import StandIn
    from tiny import make_tiny_target

    from dflash_eval.serving.vllm.states import extract_hidden_states_vllm

    target = make_tiny_target(tmp_path / "t", num_layers=2, hidden=32)
    comp = tmp_path / "c.jsonl"
    comp.write_text(json.dumps({"id": "a", "prompt_ids": [1, 5, 9], "completion_ids": [7, 2], "stop_reason": "eos",
                                "max_new_tokens": 8}) + "\n")
    with StandIn(target, mode="openai") as srv:
        with pytest.raises(InputError, match="returned no kv_transfer_params.hidden_states_path: the server is not in "
                                             "extract mode"):
            extract_hidden_states_vllm(target, comp, tmp_path / "c.h5", [0, 1], source="vllm", vllm={"url": srv.url})
    assert not (tmp_path / "c.h5").exists() and not (tmp_path / "c.h5.partial").exists()


def test_hybrid_fix_check_refuses_a_connector_without_the_group_block_size(tmp_path):
    import os
    import sys

    from dflash_eval.serving.vllm.states import check_hybrid_fix

    fake = tmp_path / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    fake.mkdir(parents=True)
    for d in [fake, *fake.parents][: 5]:
        (d / "__init__.py").touch()
    mod = fake / "example_hidden_states_connector.py"
    mod.write_text("class ExampleHiddenStatesConnector:\n    pass\n")  # before vLLM PR #46301
    env = {"PYTHONPATH": str(tmp_path)}
    with pytest.raises(InputError, match="predates PR #46301"):
        check_hybrid_fix(sys.executable, env)
    mod.write_text("class ExampleHiddenStatesConnector:\n    def _get_cache_block_size(self): pass\n")
    check_hybrid_fix(sys.executable, env)
    check_hybrid_fix(str(tmp_path / "no-python"), env)  # the server start reports a missing interpreter
    assert os.environ.get("PYTHONPATH") != str(tmp_path)
