"""Guards against input that used to pass silently: duplicate YAML keys, names that leave ``results/``,
the CLI's thread count, and the jobs' watchdog (a job whose Snakemake is gone stops)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_eval.core.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def test_duplicate_yaml_key_names_both_lines(tmp_path):
    from dflash_eval.core.yaml_strict import load_file

    cfg = tmp_path / "c.yaml"
    cfg.write_text("prompt_sets:\n  chat:\n    source: file\n  code: {source: file}\n  chat:\n    source: sharegpt\n")
    with pytest.raises(InputError) as err:
        load_file(cfg)
    assert err.value.field == "prompt_sets.chat" and "defined twice, on line 2 and on line 5" in err.value.problem
    (tmp_path / "merge.yaml").write_text("base: &b {x: 1}\nuse:\n  <<: *b\n  x: 2\n")  # merge keys override on purpose
    assert load_file(tmp_path / "merge.yaml")["use"] == {"x": 2}


@pytest.mark.slow
def test_workflow_refuses_a_config_with_a_duplicate_key(tmp_path):
    from test_workflow import make_tiny_workdir, smk

    wd = make_tiny_workdir(tmp_path / "wf")
    (wd / "dup.yaml").write_text("run: tiny\nevaluate:\n  batch_size: 2\nevaluate:\n  batch_size: 4\n")
    proc = smk(wd, "-n", "--configfile", "dup.yaml", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "dup.yaml" in out and "evaluate: defined twice, on line 2 and on line 4" in out, out[-3000:]
    (wd / "nan.yaml").write_text("generation:\n  sampling: {temperature: .nan}\n")
    proc = smk(wd, "-n", "--configfile", "nan.yaml", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "generation.sampling.temperature: not a finite number" in out, out[-3000:]


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", "a" * 101, "--help", "-x"])
def test_names_that_leave_results_are_refused(name, tmp_path):
    from dflash_eval.workflow.checkpoints import checkpoint_table
    from dflash_eval.workflow.checkpoints import check_names

    base = {"run": "r", "target": {"name": "t"}, "prompt_sets": {"p": {}}}
    check_names(base)  # fine
    check_names({**base, "run": "v1.2"})  # a dot inside is fine
    check_names({**base, "run": "".join(chr(97 + i % 26) for i in range(100))})  # 100 characters are fine
    for cfg, where in [({**base, "run": name}, "run"), ({**base, "target": {"name": name}}, "target.name"),
                       ({**base, "prompt_sets": {name: {}}}, f"prompt_sets.{name}")]:
        with pytest.raises(InputError) as err:
            check_names(cfg)
        assert err.value.field == where and "may not start with '.'" in err.value.problem
    ck = tmp_path / "c.pt"
    ck.write_bytes(b"x")
    with pytest.raises(InputError, match="may not start with '.'"):
        checkpoint_table({"list": [{"name": name, "path": str(ck)}]})


@pytest.mark.parametrize("name, unit, times", [("ck-" + "0" * 20, "0", 20), ("b" * 40, "b", 40),
                                               ("step-" + "ab" * 25, "ab", 25)])
def test_names_snakemake_would_take_for_a_recursion_are_refused(name, unit, times, tmp_path):
    """A wildcard value ending in a unit repeated >= 20 times makes Snakemake plan no job for it (its
    PeriodicityDetector), so such a checkpoint would be left out with exit 0: refused at parse time."""
    from snakemake.io import PeriodicityDetector

    from dflash_eval.workflow.checkpoints import checkpoint_table
    from dflash_eval.workflow.checkpoints import check_names

    assert PeriodicityDetector().is_periodic(name)  # Snakemake's own detector agrees
    assert not PeriodicityDetector().is_periodic("ck-" + "0" * 19)
    check_names({"run": "ck-" + "0" * 19, "target": {"name": "t"}, "prompt_sets": {"p": {}}})  # 19 are fine
    ck = tmp_path / "c.pt"
    ck.write_bytes(b"x")
    with pytest.raises(InputError) as err:
        checkpoint_table({"list": [{"name": name, "path": str(ck)}]})
    assert f"ends in {unit!r} repeated {times} times" in err.value.problem
    with pytest.raises(InputError) as err:
        check_names({"run": name, "target": {"name": "t"}, "prompt_sets": {"p": {}}})
    assert err.value.field == "run" and "runaway recursion" in err.value.problem


def test_cli_threads_chosen_as_the_workflow_does(monkeypatch):
    from dflash_eval.core import threads
    from dflash_eval.cli import build_parser
    from dflash_eval.core.schema import schema_default

    assert threads.choose(3, {"OMP_NUM_THREADS": "5"}) == (3, "--threads")
    assert threads.choose(None, {"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    n, why = threads.choose(None, {})
    assert n == min(int(schema_default("torch_threads")), 2) and "2 cores available" in why
    with pytest.raises(InputError, match="--threads"):
        threads.choose(0, {})
    env = {"MKL_NUM_THREADS": "7"}
    assert threads.apply(None, env) == n and env["OMP_NUM_THREADS"] == str(n) and env["MKL_NUM_THREADS"] == "7"
    args = build_parser("evaluate").parse_args(["evaluate", "--drafter", "d", "--cache", "c", "--target", "t",
                                                "--out", "o", "--threads", "3"])
    assert args.threads == 3


#: a job's process in the watchdog tests: an owner process started (its token in ``token``) and the helpers
#: that kill it and wait for the job's Interrupted
_WATCHED_JOB = """
import os, subprocess, sys, time
from dflash_eval.core import watchdog
from dflash_eval.core.errors import Interrupted, install_signal_handlers
owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(0.3)
token = watchdog.owner_token(owner.pid)
install_signal_handlers()

def kill_owner():
    owner.kill(); owner.wait()

def wait_stopped(start_watch):
    t0 = time.monotonic()
    try:
        start_watch()
        time.sleep(20)
        print("not stopped")
    except Interrupted:
        print(f"stopped after {time.monotonic() - t0:.1f} s")
        sys.exit(143)
"""


def _watched_job(body: str) -> float:
    """Run :data:`_WATCHED_JOB` + ``body`` in a fresh Python; the seconds it took the watchdog to stop it."""
    script = _WATCHED_JOB + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert proc.stdout.startswith("stopped after") and "is gone: stopping" in proc.stderr, proc.stdout + proc.stderr
    return float(proc.stdout.split()[2])


def test_watchdog_stops_a_job_whose_owner_is_gone():
    assert _watched_job("""
        os.environ[watchdog.OWNER_ENV] = token
        assert watchdog.start(interval_s=0.2) is not None
        assert watchdog.start({watchdog.OWNER_ENV: watchdog.owner_token()}) is None  # never watches itself
        kill_owner()
        wait_stopped(lambda: None)
    """) < 3


def test_watchdog_stops_a_job_whose_owner_died_before_it_started():
    """Snakemake SIGKILLed while a job's Python was starting; the watchdog, finding the owner
    gone at its start, took it for one it cannot see (a container) and watched nothing, so the job ran to its end.
    An owner of the job's own pid namespace that is gone stops the job at once; one named in another namespace
    (a container's view) is still not watched, and tokens of an earlier version (two parts) still work."""
    assert _watched_job("""
        assert token.count(":") >= 2 and token.endswith(watchdog.pid_namespace()), token
        kill_owner()
        pid, ticks, ns = token.split(":", 2)
        assert watchdog.start({watchdog.OWNER_ENV: f"{pid}:{ticks}:pid:[1]"}) is None  # another namespace
        assert watchdog.start({watchdog.OWNER_ENV: f"{pid}:{ticks}"}) is None  # an earlier version's token
        wait_stopped(lambda: watchdog.start({watchdog.OWNER_ENV: token}, interval_s=30))
    """) < 1


def test_a_non_finite_number_in_the_config_is_named():
    """YAML .nan / .inf pass JSON Schema's minimum/maximum (NaN compares false): named by its path."""
    from dflash_eval.core.io import non_finite_entry

    assert non_finite_entry({"generation": {"sampling": {"temperature": 0.7}}, "evaluate": {"sampling": [{}]}}) is None
    assert non_finite_entry({"generation": {"sampling": {"temperature": float("nan")}}}) == \
        "generation.sampling.temperature"
    assert non_finite_entry({"evaluate": {"sampling": [{"temperature": 0}, {"temperature": float("inf")}]}}) == \
        "evaluate.sampling[1].temperature"


def test_an_integral_float_in_the_config_is_the_integer():
    """`prompt_set.n: 4.0` (valid: JSON Schema's integer) must give the params of `n: 4` (nothing reruns). Floats the schema types integer are made ints; numbers stay as given."""
    from dflash_eval.workflow.config import integral_numbers

    cfg = {"prompt_set": {"n": 4.0}, "generation": {"max_new_tokens": 48.0, "sampling": {"temperature": 1.0}},
           "evaluate": {"ddtree_budgets": [4.0, 8], "sampling": [{"temperature": 0.0, "top_k": 20.0}]},
           "checkpoints": {"demo": [{"name": "d", "random_init": True, "step": 50.0}]}, "prompt_sets": {"he": {"n": 2.0}}}
    out = integral_numbers(cfg)
    assert out is cfg and cfg["prompt_set"]["n"] == 4 and type(cfg["prompt_set"]["n"]) is int
    assert type(cfg["generation"]["max_new_tokens"]) is int and type(cfg["generation"]["sampling"]["temperature"]) is float
    assert [type(b) for b in cfg["evaluate"]["ddtree_budgets"]] == [int, int]
    assert type(cfg["evaluate"]["sampling"][0]["top_k"]) is int and type(cfg["evaluate"]["sampling"][0]["temperature"]) is float
    assert type(cfg["checkpoints"]["demo"][0]["step"]) is int and type(cfg["prompt_sets"]["he"]["n"]) is int
    assert integral_numbers({"prompt_set": {"n": 4.5}})["prompt_set"]["n"] == 4.5  # left to the schema to refuse


def test_a_lock_left_behind_is_explained_with_its_fix(tmp_path):
    """A Snakemake killed with SIGKILL leaves its lock: the parse names it and the fix (--unlock, then the same
    command with --rerun-incomplete); the lock itself is left alone (another Snakemake may hold it)."""
    from dflash_eval.core.errors import snakemake_lock_note

    assert snakemake_lock_note(tmp_path) is None
    locks = tmp_path / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.input.lock").write_text("x")
    note = snakemake_lock_note(tmp_path)
    assert "snakemake --unlock" in note and "--rerun-incomplete" in note
    assert (locks / "0.input.lock").exists()


def test_one_checkpoint_under_several_names_is_named_at_parse_time(tmp_path, monkeypatch, caplog):
    """The same file listed as ckA, as ckL through `..` and as ckS through a symbolic link is stripped and
    evaluated once per name. Allowed (comparing a checkpoint with itself can be
    meant), but the parse warns, naming the names and the file; a copy (other files) is not named."""
    import os
    import shutil

    from dflash_eval.workflow.checkpoints import checkpoint_table

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()
    ck = tmp_path / "ckpts" / "ckA.pt"
    ck.write_bytes(b"x")
    (tmp_path / "ckpts" / "link.pt").symlink_to("ckA.pt")
    os.link(ck, tmp_path / "hard.pt")  # a hard link is the same file too
    shutil.copy(ck, tmp_path / "ckpts" / "copy.pt")
    entries = [{"name": "ckA", "path": "ckpts/ckA.pt"}, {"name": "ckL", "path": "ckpts/../ckpts/./ckA.pt"},
               {"name": "ckS", "path": "ckpts/link.pt"}, {"name": "ckC", "path": "ckpts/copy.pt"},
               {"name": "ckH", "path": "hard.pt"}]
    with caplog.at_level("WARNING", logger="dflash_eval"):
        table = checkpoint_table({"list": entries})
    assert sorted(table) == ["ckA", "ckC", "ckH", "ckL", "ckS"]
    notes = [m for m in caplog.messages if "same files" in m]
    assert notes == [f"checkpoints ckA, ckH, ckL, ckS are the same files ({ck}): each name is stripped and evaluated on "
                     "its own (a row per name in tau.csv); list each checkpoint once unless that is meant"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_eval"):
        checkpoint_table({"list": [entries[0], entries[3]]})
    assert not [m for m in caplog.messages if "same files" in m]
