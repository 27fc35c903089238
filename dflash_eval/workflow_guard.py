"""Parse-time guards of the workflow (torch-free; called from ``rules/common.smk`` and the Snakefile's hooks).

* **Duplicate YAML keys** (:func:`check_yaml_files`): Snakemake's loaders keep the last of two equal
  keys; the config files and the profile in use are re-read with :mod:`dflash_eval.core.yaml_strict`
  before the config is validated, so a prompt set defined twice stops the run naming both lines.
* **A Snakemake killed by SIGKILL** leaves its lock (``.snakemake/locks/``) behind and the next run
  stops with "Directory cannot be locked". The Snakefile's ``onstart`` records the running
  Snakemake (:func:`record_owner`: host, boot id, pid and start time) under
  ``.snakemake/dflash_eval/owners/``; ``onsuccess`` / ``onerror`` remove the record. At parse
  time :func:`release_stale_lock` finds locks whose recorded owner is provably gone (same host
  and boot, the pid free or reused, no lock file newer than the record) and removes them; the
  jobs the dead run had not seen finish are the outputs Snakemake marks incomplete, so a command
  without ``--rerun-incomplete`` (set in every profile and ``make demo``) is re-executed with it
  (:func:`rerun_incomplete_argv`): the same command just resumes, with or without a profile;
  where it cannot be sure (an owner on another host, locks without a record) it only says what
  to run. Snakemake's own ``--unlock`` does the same removal without any check.
* **The jobs' watchdog** (:func:`owner_export`): the shell prefix of the main Snakemake process
  names it in :data:`dflash_eval.core.watchdog.OWNER_ENV`, so a job whose Snakemake died stops
  (:mod:`dflash_eval.core.watchdog`). Cluster jobs re-read the Snakefile in their own Snakemake
  (``remote`` execution) and export nothing: SLURM ends its jobs itself.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from dflash_eval.core.watchdog import OWNER_ENV, alive, owner_token

OWNERS_DIR = Path(".snakemake", "dflash_eval", "owners")
LOCKS_DIR = Path(".snakemake", "locks")
#: seconds a lock file may be newer than its owner's record (file systems' mtime granularity)
MTIME_SLACK_S = 2.0


# --------------------------------------------------------------------------- duplicate YAML keys
def profile_files(argv: Sequence[str], environ=None, snakefile_dir: str | os.PathLike = ".") -> list[Path]:
    """The profile config files a Snakemake command line uses (``--profile``, ``--workflow-profile``,
    ``$SNAKEMAKE_PROFILE``, and ``profiles/default`` next to the Snakefile when no workflow profile is given),
    resolved as Snakemake resolves them (``snakemake.cli.get_profile_dir``). Missing ones are left out."""
    from snakemake.cli import get_profile_dir

    env = os.environ if environ is None else environ
    profiles, workflow_profile = [], None
    args = list(argv)
    for i, word in enumerate(args):
        for flag in ("--profile", "--workflow-profile"):
            value = None
            if word == flag and i + 1 < len(args):
                value = args[i + 1]
            elif word.startswith(flag + "="):
                value = word[len(flag) + 1:]
            if value is None:
                continue
            if flag == "--profile":
                profiles.append(value)
            else:
                workflow_profile = value
    if not profiles and env.get("SNAKEMAKE_PROFILE"):
        profiles.append(env["SNAKEMAKE_PROFILE"])
    files = []
    for p in profiles:
        if p != "none":
            found = get_profile_dir(p)
            if found:
                files.append(Path(found[1]))
    if workflow_profile != "none":
        candidates = [Path(workflow_profile)] if workflow_profile else [Path(snakefile_dir, "profiles", "default")]
        for c in candidates:
            if c.is_file():
                files.append(c)
            elif c.is_dir():
                found = get_profile_dir(str(c))
                if found:
                    files.append(Path(found[1]))
    return files


def check_yaml_files(files: Iterable[str | os.PathLike]) -> None:
    """Re-read each YAML file strictly (:func:`dflash_eval.core.yaml_strict.load_file`).

    Raises:
        InputError: a key defined twice in one mapping (both lines named), or a file that is not YAML.
    """
    from dflash_eval.core.yaml_strict import load_file

    for f in files:
        if Path(f).is_file():
            load_file(f)


# --------------------------------------------------------------------------- owner of the run, stale locks
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def owner_export(exec_mode_default: bool) -> str:
    """The shell-prefix words naming this (main Snakemake) process for the jobs' watchdog; ``""`` in cluster jobs."""
    return f"export {OWNER_ENV}={shlex.quote(owner_token())};" if exec_mode_default else ""


def record_owner(argv: Sequence[str], workdir: str | os.PathLike = ".") -> Path:
    """Write this Snakemake's record (``onstart``): host, boot id, pid + start time, command line, time."""
    d = Path(workdir, OWNERS_DIR)
    d.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    path = d / f"{host}.{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": host, "boot_id": _boot_id(), "token": owner_token(), "argv": list(argv),
                               "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    os.replace(tmp, path)
    return path


def forget_owner(workdir: str | os.PathLike = ".") -> None:
    """Remove this Snakemake's record (``onsuccess`` / ``onerror``)."""
    Path(workdir, OWNERS_DIR, f"{socket.gethostname()}.{os.getpid()}.json").unlink(missing_ok=True)


def _records(workdir) -> list[tuple[Path, dict]]:
    out = []
    for p in sorted(Path(workdir, OWNERS_DIR).glob("*.json")):
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError):
            continue
    return out


def unlock_command(argv: Sequence[str]) -> str:
    """The user's Snakemake command with ``--unlock`` added (what removes a lock Snakemake reports)."""
    words = list(argv)
    prog = "snakemake" if not words or Path(words[0]).name in ("snakemake", "__main__.py") else words[0]
    return " ".join(shlex.quote(w) for w in [prog, "--unlock", *words[1:]])


def release_stale_lock(argv: Sequence[str], workdir: str | os.PathLike = ".") -> tuple[str | None, bool]:
    """Remove Snakemake's locks when their owner is provably gone.

    Returns:
        (what to tell the user or None, whether the locks were removed). Where they were, the
        outputs Snakemake marks incomplete are the dead run's unfinished jobs: the caller reruns
        them (``rerun-incomplete``).

    Provably gone: every owner record is of this host and boot, none of those processes runs
    (:func:`dflash_eval.core.watchdog.alive`), and no lock file is newer than the newest record (else a
    run that has locked but not yet written its record might own them). Records of dead owners
    are removed once the locks are gone.
    """
    locks = sorted(Path(workdir, LOCKS_DIR).glob("*.lock"))
    records = _records(workdir)
    host, boot = socket.gethostname(), _boot_id()
    if not locks:
        for path, rec in records:  # a --unlock or a lost record: forget the dead owners
            if rec.get("host") == host and rec.get("boot_id") == boot and not alive(rec.get("token", "0:")):
                path.unlink(missing_ok=True)
        return None, False
    if not records:
        return None, False  # locks of a run without a record (another tool, an older version): Snakemake explains
    foreign = [r for _, r in records if r.get("host") != host or r.get("boot_id") != boot]
    if foreign:
        r = foreign[0]
        return (f"the workflow is locked by a Snakemake started on host {r.get('host')} (pid "
                f"{str(r.get('token', '?')).split(':')[0]}, {r.get('started_at')}); if it is no longer running, "
                f"run `{unlock_command(argv)}` once, then your command again with --rerun-incomplete"), False
    if any(alive(r.get("token", "0:")) for _, r in records):
        return None, False  # a live run owns it: Snakemake's lock error is right
    newest = max(p.stat().st_mtime for p, _ in records)
    if any(lk.stat().st_mtime > newest + MTIME_SLACK_S for lk in locks):
        return (f"the workflow is locked, and the Snakemake that last recorded itself here is gone; if no other "
                f"Snakemake runs in this folder, run `{unlock_command(argv)}` once, then your command again with "
                "--rerun-incomplete"), False
    import shutil

    shutil.rmtree(Path(workdir, LOCKS_DIR), ignore_errors=True)
    pids = ", ".join(str(r.get("token", "?")).split(":")[0] for _, r in records)
    for path, _ in records:
        path.unlink(missing_ok=True)
    return f"removed the lock left by a killed Snakemake (pid {pids} on this host, no longer running)", True


def rerun_incomplete_argv(argv: Sequence[str]) -> list[str] | None:
    """The ``execv`` arguments of this Snakemake command with ``--rerun-incomplete`` added, or None when it
    has it already (``--rerun-incomplete`` / ``--ri``) or this is not Snakemake's command line (an API call).

    Snakemake reads the Snakefile before its DAG settings exist, so the flag can only be given to a new
    process; the flag is appended (an option word: it also ends a preceding multi-value option such as
    ``--resources``)."""
    words = list(argv)
    if not words or any(w in ("--rerun-incomplete", "--ri") for w in words):
        return None
    prog = Path(words[0])
    if prog.name == "__main__.py" and prog.parent.name == "snakemake":
        return [sys.executable, "-m", "snakemake", *words[1:], "--rerun-incomplete"]
    if prog.name == "snakemake":
        return [sys.executable, str(prog), *words[1:], "--rerun-incomplete"]
    return None


def metadata_gone(run_dir: str | os.PathLike, workdir: str | os.PathLike = ".",
                  records_created: bool = False) -> str | None:
    """What to tell the user when ``run_dir`` holds outputs but Snakemake's metadata (``.snakemake/metadata``)
    is gone (copied results, a fresh clone, ``rm -rf .snakemake``), else None.

    Snakemake reruns a job for changed params, code, input set or software environment only from that
    metadata; without it only missing or older files rerun. Added checkpoints and prompt sets still run
    (``planned_evaluations.txt``), and so do the jobs of an option changed since the options records were
    written (:mod:`dflash_eval.job_records`); ``records_created``: the run had no records and they were just
    written from the current config, so an option changed before now is not seen (results of an earlier
    version, or a removed ``options/`` folder)."""
    meta = Path(workdir, ".snakemake", "metadata")
    if not Path(run_dir, "tau.csv").exists() or (meta.is_dir() and any(meta.iterdir())):
        return None
    head = (f"{run_dir} holds results but Snakemake's records of how they were made (.snakemake/metadata) are gone "
            "(copied results or a removed .snakemake)")
    if records_created:
        return (f"{head}, and its options records ({run_dir}/options/) were missing: they were written now from this "
                "config, so an option changed since the results were made does NOT rerun the jobs it affects. If you "
                "changed options, rerun those stages (e.g. --forcerun evaluate, or -R completions for generation "
                "options); from now on the records carry option changes")
    return (f"{head}: changed options, added checkpoints and prompt sets still rerun what they affect ({run_dir}/options/, "
            "planned_evaluations.txt), but a changed software environment (containers.cuda image, conda env) does "
            "not. If you changed one, rerun what it affects (e.g. --forcerun evaluate, or -R completions)")


def check_config_files(files: Iterable[str | os.PathLike], argv: Sequence[str], snakefile_dir) -> None:
    """:func:`check_yaml_files` of the config files and the profile files in use (:func:`profile_files`).

    Raises:
        InputError: see :func:`check_yaml_files`.
    """
    check_yaml_files(list(files) + profile_files(argv, snakefile_dir=snakefile_dir))

