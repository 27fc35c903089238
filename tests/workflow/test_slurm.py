"""SLURM profiles: what they ask for, and a real run on a single-node SLURM cluster.

The cluster (``scripts/slurm_local_cluster.sh``: slurmctld + slurmd + munged, partitions ``cpu``
and ``gpu``, 2 fake GPUs, no accounting) is started per test session in a temporary directory on
free ports, and stopped afterwards. It needs root and Debian's slurmctld, slurmd, slurm-client and
munge (``scripts/slurm_local_cluster.sh install``; ``.ci/run`` does it). Without them the real-run
tests are skipped with the reason; with ``DFLASH_EVAL_REQUIRE_SLURM=1`` (set by ``.ci/run``)
they fail instead.

Job states without slurmdbd: there is no ``sacct``. The cluster writes every finished job to
its job-completion log (``JobCompType=jobcomp/filetxt``: JobState, Partition, ExitCode) and keeps
it visible to ``scontrol show job`` for ``MinJobAge=3600`` s (rule name from the job's comment,
GPU request from ``TresPerJob``); both are read here.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from run_compare import assert_runs_match, assert_same_completions
from test_workflow import REPO, copy_workflow, make_tiny_workdir, shell_commands, smk

SCRIPT = REPO / "scripts" / "slurm_local_cluster.sh"
PROFILES = {p.parent.name: yaml.safe_load(p.read_text()) for p in (REPO / "profiles").glob("*/config.yaml")}
RULE_TEXT = "\n".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
RULE_BODIES = dict(re.findall(r"^\s*rule (\w+):(.*?)(?=^\s*rule |\Z)", RULE_TEXT, re.M | re.S))
ALL_RULES = set(RULE_BODIES)
# gpu=1, or gpu=PLAN.<x>_gpus: target_gpus (max(target.devices, 1)) for the rules that load the target,
# hidden_states_gpus (source hf: target_gpus; vllm: its tensor parallelism, 0 for the user's server), validate_engine_gpus
GPU_RULES = {name for name, body in RULE_BODIES.items()
             if re.search(r"resources:\s*\n\s*gpu=((1|PLAN\.\w+_gpus)|.* else (1|PLAN\.\w+_gpus)),", body)}
LOCAL_RULES = {name for name, body in RULE_BODIES.items() if "localrule: True" in body} | {"all"}


# --------------------------------------------------------------------------- static checks


def test_profiles_set():
    assert set(PROFILES) == {"local-gpu", "slurm-gpu", "slurm-cpu", "ci"}
    assert GPU_RULES == {"completions", "hidden_states", "hidden_states_shard", "evaluate", "kernel_parity",
                         "fp8_parity", "engine_parity", "target_costs", "validate_online", "validate_engine"}
    assert {"summary", "report"} <= LOCAL_RULES
    assert PROFILES["ci"]["cores"] == 2 and PROFILES["ci"]["resources"] == {"gpu": 1}
    for name, prof in PROFILES.items():
        # Containers are opt-in (--sdm apptainer on the command line): a profile's method cannot
        # be cleared from the command line.
        assert "software-deployment-method" not in prof, name
    for name in ("local-gpu", "slurm-gpu"):
        assert PROFILES[name]["apptainer-args"] == "--nv"
    # The recovery after a killed Snakemake (README: Troubleshooting): --unlock, then the same command
    # reruns the jobs it did not see finish, instead of stopping at IncompleteFilesException.
    for name, prof in PROFILES.items():
        assert prof.get("rerun-incomplete") is True, name
        assert not prof.get("keep-incomplete") and not prof.get("nolock"), name


@pytest.mark.parametrize("name", ["slurm-gpu", "slurm-cpu"])
def test_slurm_profile_settings(name):
    prof = PROFILES[name]
    assert prof["executor"] == "slurm"
    assert prof["slurm-status-command"] == "squeue"  # sacct hangs without slurmdbd
    assert prof["retries"] == 0 and prof["slurm-requeue"] is True  # never resubmit a rejected sbatch
    assert isinstance(prof["cores"], int) and prof["cores"] >= 64  # a cap on threads, not the login node's
    assert "set-threads" not in prof  # threads: config torch_threads
    assert set(prof["set-resources"]) <= ALL_RULES, set(prof["set-resources"]) - ALL_RULES
    assert not set(prof["set-resources"]) & LOCAL_RULES
    for resources in [prof["default-resources"], *prof["set-resources"].values()]:
        assert "gres" not in resources and "cpus_per_gpu" not in resources
        assert not re.search(r"--(gres|gpus)", str(resources.get("slurm_extra", "")))
    assert "cpus_per_task" not in prof["default-resources"] and "tasks" not in prof["default-resources"]
    assert prof["default-resources"]["slurm_partition"] == "cpu"
    for rule in GPU_RULES:
        res = prof["set-resources"][rule]
        if name == "slurm-gpu":
            assert res["slurm_partition"] == "gpu" and "gpu" not in res  # the rule's gpu=1 stays
        else:
            assert res["gpu"] == 0 and "slurm_partition" not in res


class _Resources(dict):
    __getattr__ = dict.get


class _Job:
    def __init__(self, threads, resources):
        self.threads = threads
        self.resources = _Resources(resources)


def _sbatch_args(profile: dict, rule: str, threads: int) -> str:
    """The sbatch arguments the SLURM plugin builds for one rule under a profile."""
    submit = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    utils = pytest.importorskip("snakemake_executor_plugin_slurm.utils")
    resources = {**profile["default-resources"], **({"gpu": 1} if rule in GPU_RULES else {}),
                 **profile["set-resources"].get(rule, {})}
    job = _Job(threads, resources)
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "",
              "partition": f"-p {resources['slurm_partition']}", "workdir": "."}
    return submit.get_submit_command(job, params) + utils.set_gres_string(job)


def test_slurm_submit_strings():
    """GPU rules: --gpus=1 on the gpu partition (slurm-gpu) or no GPU at all (slurm-cpu); CPUs from
    the job's threads (config torch_threads)."""
    gpu, cpu = PROFILES["slurm-gpu"], PROFILES["slurm-cpu"]
    call = _sbatch_args(gpu, "evaluate", threads=8)
    assert "-p gpu" in call and "--gpus=1" in call and "--cpus-per-task=8" in call and "--mem 64000" in call
    assert "--gres" not in call and "--cpus-per-gpu" not in call
    call = _sbatch_args(cpu, "evaluate", threads=8)
    assert "-p cpu" in call and "--gpus" not in call and "--gres" not in call and "--cpus-per-task=8" in call
    call = _sbatch_args(gpu, "strip_drafter", threads=1)
    assert "-p cpu" in call and "--mem 64000" in call and "--gpus" not in call and "--cpus-per-task=1" in call


@pytest.mark.slow
def test_torch_threads_from_config(tmp_path):
    """Torch rules take config torch_threads (default 8), capped by --cores; no rule reads
    workflow.cores (it fails at parse time when --cores is unset, as on a cluster)."""
    assert not re.search(r"threads:\s*workflow\.cores", RULE_TEXT)
    wd = copy_workflow(tmp_path / "wf")

    def threads(*args):
        out = smk(wd, "-n", "-p", "--forceall", *args).stdout
        found = {}
        for rule, body in re.findall(r"^rule (\w+):\n(.*?)(?=\n\n)", out, re.M | re.S):
            m = re.search(r"threads: (\d+)", body)
            found.setdefault(rule, set()).add(int(m.group(1)) if m else 1)
        return found

    t = threads("--cores", "64")
    assert t["completions"] == t["hidden_states"] == t["evaluate"] == {8}
    assert t["prompts"] == t["strip_drafter"] == {1}
    t = threads("--cores", "2", "--config", "torch_threads=3")
    assert t["completions"] == t["evaluate"] == {2}  # capped by --cores
    t = threads("--cores", "64", "--config", "torch_threads=3")
    assert t["hidden_states"] == t["target_costs"] == {3}
    # the demo overlay: torch jobs at 1 thread, the timing job on every core --cores allows
    t = threads("--cores", "2", "--configfile", "config/demo.yaml")
    assert t["completions"] == t["hidden_states"] == t["evaluate"] == {1} and t["target_costs"] == {2}


@pytest.mark.slow
def test_missing_sif_stops_at_parse_time(tmp_path):
    """With --sdm apptainer, a containers.cuda .sif that does not exist is named at parse time."""
    wd = copy_workflow(tmp_path / "wf")
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "apptainer").write_text("#!/bin/sh\necho 'apptainer version 1.3.0'\n")
    (stub / "apptainer").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}"}
    proc = smk(wd, "-n", "--cores", "2", "--sdm", "apptainer", check=False, env=env)
    assert proc.returncode != 0
    assert "containers.cuda: image file 'containers/dflash-eval-cuda_0.1.0.sif' does not exist" in proc.stdout + proc.stderr
    (wd / "containers").mkdir()
    (wd / "containers" / "dflash-eval-cuda_0.1.0.sif").write_bytes(b"x")
    proc = smk(wd, "-n", "-p", "--cores", "2", "--sdm", "apptainer", env=env)
    assert shell_commands(proc.stdout)


# --------------------------------------------------------------------------- the real cluster


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _unavailable(reason: str):
    if os.environ.get("DFLASH_EVAL_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM test cluster required (DFLASH_EVAL_REQUIRE_SLURM=1) but: {reason}")
    pytest.skip(f"SLURM test cluster unavailable: {reason}")


def _start_cluster(tmp_path_factory, gpus: int):
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged")
               if not shutil.which(b) and not Path("/usr/sbin", b).exists()]
    if missing:
        _unavailable(f"{', '.join(missing)} not installed (as root: scripts/slurm_local_cluster.sh install)")
    if os.geteuid() != 0:
        _unavailable("the SLURM daemons need root")
    state = tmp_path_factory.mktemp(f"slurm-gpus{gpus}")
    ctld, slurmd = _free_ports(2)
    env = {**os.environ, "SLURM_LOCAL_DIR": str(state), "SLURM_LOCAL_PORT": str(ctld),
           "SLURM_LOCAL_SLURMD_PORT": str(slurmd), "SLURM_LOCAL_GPUS": str(gpus)}
    proc = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        _unavailable(f"scripts/slurm_local_cluster.sh start failed:\n{proc.stdout}\n{proc.stderr}")
    run_env = {**env, "SLURM_CONF": str(state / "etc" / "slurm.conf"),
               "PATH": f"{state / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return env, run_env, state


def _stop_cluster(env):
    subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A running single-node cluster with 2 (fake) GPUs; yields (environment for Snakemake, state dir)."""
    env, run_env, state = _start_cluster(tmp_path_factory, gpus=2)
    yield run_env, state
    _stop_cluster(env)


@pytest.fixture(scope="module")
def slurm_cluster_without_gpus(tmp_path_factory):
    """The same without GPU gres (GresTypes=gpu, no GPU on the node)."""
    env, run_env, state = _start_cluster(tmp_path_factory, gpus=0)
    yield run_env, state
    _stop_cluster(env)


def _fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


def slurm_jobs(state: Path, env: dict, workdir: Path) -> list[dict]:
    """SLURM's records of the jobs submitted from ``workdir``: the job-completion log entry
    (JobState, Partition, ExitCode) joined with ``scontrol show job`` (Comment = rule, TresPerJob)."""
    log = state / "log" / "jobcomp.log"
    jobs = []
    for line in (log.read_text().splitlines() if log.exists() else []):
        rec = _fields(line)
        if rec.get("WorkDir") != str(workdir):
            continue
        show = subprocess.run(["scontrol", "show", "job", "--oneliner", rec["JobId"]], env=env,
                              capture_output=True, text=True, check=True).stdout
        detail = _fields(show)
        rec["Comment"] = detail.get("Comment", "")
        rec["TresPerJob"] = detail.get("TresPerJob", "")
        rec["rule"] = re.match(r"rule_(\w+?)(?:_wildcards_|$)", rec["Comment"]).group(1)
        jobs.append(rec)
    return jobs


SLURM_TEST_CONFIG = {
    # one checkpoint and one prompt set: 7 SLURM jobs (a small cluster run)
    "prompt_sets": {"set_a": {"source": "file", "path": "prompts/a.jsonl"}},
    "checkpoints": {"glob": "ckpts/step100.pt", "demo": []},
    # as many threads as the reference run (CI profile, 2 cores): bitwise-equal float32 results
    "torch_threads": 2,
}


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_gpu_profile_real_run(slurm_cluster, tiny_run, tmp_path):
    """The shipped slurm-gpu profile, unchanged, on a cluster without accounting: every job
    COMPLETED in SLURM's records, GPU rules on the gpu partition with one GPU, the rest on cpu
    without one, and the same completions, caches and tau as the local run."""
    env, state = slurm_cluster
    wd = make_tiny_workdir(tmp_path / "wf", **SLURM_TEST_CONFIG)
    proc = smk(wd, "--workflow-profile", str(REPO / "profiles" / "slurm-gpu"),
               "--slurm-init-seconds-before-status-checks", "2", env=env, timeout=900)
    out = proc.stdout + proc.stderr
    assert re.search(r"\b(\d+) of \1 steps \(100%\) done", out), out[-3000:]  # every planned job ran

    jobs = slurm_jobs(state, env, wd)
    rules = sorted(j["rule"] for j in jobs)
    assert rules == sorted(["target_fingerprint", "prompts", "completions", "hidden_states", "strip_drafter",
                            "evaluate", "target_costs"]), jobs
    for job in jobs:
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
        if job["rule"] in GPU_RULES:
            assert job["Partition"] == "gpu" and job["TresPerJob"] == "gres:gpu:1", job
            assert "cpu=2," in job["Tres"], job  # --cpus-per-task = torch_threads
        else:
            assert job["Partition"] == "cpu" and "gpu" not in job["TresPerJob"], job
    assert_runs_match(tiny_run, wd, "tiny", checkpoints=["step100"], prompt_sets=["set_a"])


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_profiles_on_a_cluster_without_gpus(slurm_cluster_without_gpus, tiny_run, tmp_path):
    """Without GPU gres, slurm-gpu's GPU job is rejected by sbatch once (no retry resubmits it) with
    SLURM's reason in the error; slurm-cpu runs the same torch rule on the cpu partition without a
    GPU request and gives the local run's completions."""
    env, state = slurm_cluster_without_gpus
    target = "results/tiny/completions/set_a.jsonl"
    wd = make_tiny_workdir(tmp_path / "wf", **SLURM_TEST_CONFIG)
    proc = smk(wd, "--workflow-profile", str(REPO / "profiles" / "slurm-gpu"),
               "--slurm-init-seconds-before-status-checks", "2", target, env=env, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("SLURM sbatch failed") == 1, out[-3000:]
    assert "Requested node configuration is not available" in out
    # SLURM records the rejected submission as a FAILED job that never got a node: once.
    first = slurm_jobs(state, env, wd)
    assert sorted((j["rule"], j["JobState"]) for j in first) == [
        ("completions", "FAILED"), ("prompts", "COMPLETED"), ("target_fingerprint", "COMPLETED")]
    failed = next(j for j in first if j["rule"] == "completions")
    assert failed["Partition"] == "gpu" and failed["NodeCnt"] == "0", failed

    proc = smk(wd, "--workflow-profile", str(REPO / "profiles" / "slurm-cpu"),
               "--slurm-init-seconds-before-status-checks", "2", target, env=env, timeout=600)
    jobs = slurm_jobs(state, env, wd)[len(first):]
    assert [j["rule"] for j in jobs] == ["completions"], jobs  # prompts' output is kept from the first run
    for job in jobs:
        assert job["JobState"] == "COMPLETED" and job["Partition"] == "cpu", job
        assert "gpu" not in job["TresPerJob"], job
    assert_same_completions(tiny_run / "results" / "tiny" / "completions" / "set_a.jsonl",
                            wd / target)
