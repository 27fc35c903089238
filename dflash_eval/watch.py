"""Continuous evaluation: follow a training run's output folder and evaluate each checkpoint once it is complete.

``python -m dflash_eval watch --configfile my.yaml`` (run where you run Snakemake: the repository
root, or any folder holding the workflow) polls ``watch.dir`` every ``watch.poll_s`` seconds. A
checkpoint that is complete (:mod:`dflash_eval.drafter.trainer_output`: never one still being written, and
only after the trainer's own "done" marker where its layout has one) is evaluated by the workflow:
Snakemake as a subprocess with your config files plus one generated file naming that checkpoint
alone (``results/<run>/watch/configs/<name>.yaml``: ``checkpoints: {list: [it], glob: "", demo: []}``),
asked for its evaluate outputs ``results/<run>/eval/<name>/<prompt set>.json``. The prompt sets'
completions and caches are made by the first evaluation and reused by the next ones.

After each evaluation ``watch`` rebuilds the tau table of every checkpoint it evaluated
(``results/<run>/watch/tau.csv`` / ``.parquet``, :func:`dflash_eval.summary.write_summary`), logs it
to the configured trackers (:mod:`dflash_eval.trackers.log`; each point once) and prints one line::

    watch: step 200 step200: tau set_a 2.413 set_b 2.250 | best set_a 2.413 (step 200), set_b 2.250 (step 200)

State lives in the results folder, never in memory: ``results/<run>/watch/done/<name>.json``
(written last, after the trackers) marks a checkpoint evaluated; ``failed/<name>.json`` one whose
evaluation failed (tried again only when its files change; delete the file to retry). A restart,
also after ``kill -9``, evaluates nothing already done: an evaluation cut short is redone by
Snakemake (``--rerun-incomplete``), and the Snakemake child of a killed ``watch`` gets SIGTERM
(``PR_SET_PDEATHSIG``), so it stops its jobs. One ``watch`` per run (a lock file,
``results/<run>/watch/lock``); it runs one Snakemake at a time, with ``--resources gpu=1`` and
``CUDA_VISIBLE_DEVICES`` set to ``watch.gpu`` when given, so at most one evaluation holds the GPU.
The trainer's files are only read.

Order: complete checkpoints are evaluated by step, oldest first. Stop: after the checkpoint at or
past ``watch.until_step`` or one matching ``watch.final_checkpoint`` (a name or glob), or, with
``--once``, when nothing complete is left. A checkpoint the trainer deletes before it is evaluated
(rotation) is skipped.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.schema import SCHEMA_PATH
from dflash_eval.core.yaml_strict import load_file as load_yaml
from dflash_eval.drafter.trainer_output import Candidate, candidates, identify, inspect, matches, same_files
from dflash_eval.trackers.log import log_table
from dflash_eval.workflow.config import describe_validation_error

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path("config", "config.yaml")  #: the Snakefile's own configfile (merged first)
LOCKED = "Directory cannot be locked"


# --------------------------------------------------------------------------- config
def _merge(base: dict, over: dict) -> dict:
    """Snakemake's config merge: nested dicts merged key by key, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(configfiles: list[str | Path], workdir: str | Path = ".") -> dict:
    """The workflow config ``watch`` and Snakemake see: ``config/config.yaml`` of ``workdir`` (when
    present), then each file in order, validated against the schema with its defaults filled
    (``snakemake.utils.validate``, as ``rules/common.smk`` does).

    Raises:
        InputError: a missing or unreadable file, or a config the schema refuses (entry named).
    """
    cfg: dict = {}
    files = [Path(workdir) / DEFAULT_CONFIG] if (Path(workdir) / DEFAULT_CONFIG).is_file() else []
    for f in files + [Path(f) for f in configfiles]:
        if not f.is_file():
            raise InputError(f, "--configfile", "config file not found", "pass the config file you give Snakemake")
        data = load_yaml(f) or {}  # InputError: not YAML, or a key written twice
        if not isinstance(data, dict):
            raise InputError(f, "(top level)", "not a mapping", "write the config as key: value pairs")
        cfg = _merge(cfg, data)
    from snakemake.utils import validate  # deferred: the CUDA image runs jobs, has no Snakemake; its --help imports this

    try:
        validate(cfg, str(SCHEMA_PATH), set_default=True)
    except Exception as err:  # WorkflowError wrapping the jsonschema error
        entry, problem = describe_validation_error(err.__context__ or err)
        raise InputError(", ".join(map(str, configfiles)) or "config", entry, problem,
                         "correct that entry (dflash_eval/schemas/config.schema.yaml)") from None
    return cfg


@dataclass
class WatchOptions:
    """Section ``watch`` of the config, with the CLI's overrides applied."""

    dir: str
    pattern: str = ""
    poll_s: float = 60.0
    settle_s: float = 30.0
    until_step: int | None = None
    final_checkpoint: str = ""
    gpu: str = ""
    snakemake_args: list[str] = field(default_factory=lambda: ["--cores", "all", "--resources", "gpu=1"])
    overrides: dict = field(default_factory=dict)
    drafter_config: str = ""
    once: bool = False

    @classmethod
    def from_config(cls, cfg: dict, **cli) -> "WatchOptions":
        section = dict(cfg.get("watch") or {})
        section.update({k: v for k, v in cli.items() if v is not None})
        if not section.get("dir"):
            raise InputError("config", "watch.dir", "not set", "name the training run's output folder (watch.dir)")
        return cls(**{k: v for k, v in section.items() if k in cls.__dataclass_fields__})


# --------------------------------------------------------------------------- the loop
def _pdeathsig():  # pragma: no cover - runs in the child
    """In the Snakemake child: get SIGTERM when the watch process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


class Watcher:
    """One ``watch`` run (see the module docstring)."""

    def __init__(self, configfiles: list[str], opts: WatchOptions, cfg: dict, out=None):
        self.configfiles = [str(f) for f in configfiles]
        self.opts = opts
        self.cfg = cfg
        self.run = cfg["run"]
        self.prompt_sets = sorted(cfg["prompt_sets"])
        self.state = Path("results", self.run, "watch")
        self.out = out or sys.stdout
        self._lock_fd = None
        self._waiting: dict[str, str] = {}

    # ---- state in the results folder
    def record(self, kind: str, name: str) -> Path:
        return self.state / kind / f"{name}.json"

    def done(self) -> dict[str, dict]:
        """``{name: record}`` of every evaluated checkpoint (``done/*.json``)."""
        out = {}
        for f in sorted((self.state / "done").glob("*.json")):
            try:
                out[f.stem] = json.loads(f.read_text())
            except (OSError, ValueError):
                log.warning("%s is unreadable: that checkpoint is evaluated again", f)
        return out

    def _write(self, path: Path, obj: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(obj, indent=1, default=str))

    def lock(self) -> None:
        """Hold ``results/<run>/watch/lock`` for this process's life (one watch per run).

        Raises:
            InputError: another watch holds it.
        """
        self.state.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise InputError(self.state / "lock", None, f"another watch of run {self.run!r} is running",
                             "stop it first; one watch per run evaluates one checkpoint at a time") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    # ---- one poll
    def pending(self) -> list[Candidate]:
        """Complete checkpoints not evaluated yet (and not failed with the same files), oldest step first."""
        done = self.done()
        ready = []
        for path in candidates(self.opts.dir, self.opts.pattern):
            if identify(path)[0] in done:  # evaluated: not inspected again
                continue
            cand = inspect(path, self.opts.settle_s)
            if not cand.complete:
                if self._waiting.get(cand.name) != cand.reason:  # once per reason, not every poll
                    log.info("waiting for %s: %s", path, cand.reason)
                    self._waiting[cand.name] = cand.reason
                continue
            failed = self.record("failed", cand.name)
            if failed.is_file():
                try:
                    if same_files(json.loads(failed.read_text()).get("signature", []), cand.signature):
                        continue
                except (OSError, ValueError):
                    pass
            ready.append(cand)
        return sorted(ready, key=lambda c: (c.step is None, c.step or 0, c.name))

    def overlay(self, cand: Candidate) -> Path:
        """The config file naming this checkpoint alone (merged after the user's)."""
        entry: dict = {"name": cand.name, "path": str(cand.path.resolve())}
        if self.opts.overrides:
            entry["overrides"] = self.opts.overrides
        if self.opts.drafter_config:
            entry["drafter_config"] = self.opts.drafter_config
        path = self.state / "configs" / f"{cand.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(yaml.safe_dump({"checkpoints": {"glob": "", "list": [entry], "demo": []}}, sort_keys=False))
        return path

    def targets(self, name: str) -> list[str]:
        return [os.path.join("results", self.run, "eval", name, f"{p}.json") for p in self.prompt_sets]

    def snakemake(self, cand: Candidate) -> tuple[int, Path]:
        """Run the workflow for one checkpoint; returns (exit code, log file). Waits (up to 5 min) while
        another Snakemake holds this folder's lock (e.g. the one of a killed watch, still stopping)."""
        overlay = self.overlay(cand)
        logf = Path("logs", "watch", self.run, f"{cand.name}.log")
        logf.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "snakemake", *self.targets(cand.name), *self.opts.snakemake_args,
               "--rerun-incomplete", "--configfile", *self.configfiles, str(overlay)]
        env = dict(os.environ)
        if self.opts.gpu:
            env["CUDA_VISIBLE_DEVICES"] = str(self.opts.gpu)
        deadline = time.time() + 300
        while True:
            with open(logf, "a") as fh:
                fh.write(f"$ {' '.join(cmd)}\n")
                fh.flush()
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                        preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)
                try:
                    rc = proc.wait()
                except BaseException:  # SIGTERM / Ctrl-C of watch: let Snakemake stop its jobs and unlock
                    proc.terminate()
                    try:
                        proc.wait(timeout=300)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    raise
            if rc == 0 or LOCKED not in logf.read_text()[-4000:] or time.time() > deadline:
                return rc, logf
            log.info("another Snakemake holds this folder's lock; retrying in 10 s")
            time.sleep(10)

    def line(self, cand: Candidate, df) -> str:
        """``watch: step S NAME: tau <set> <tau> [<set>@<sampling label> <tau>] ... | best <set> <tau> (step S), ...``
        (best over the first configured sampling setting)."""
        rows = df[df["checkpoint"] == cand.name]
        step = rows["step"].dropna()
        step = int(step.iloc[0]) if len(step) else cand.step
        # one row per sampling setting: the first configured one is plain, the others are labelled
        first = ~rows.duplicated(["prompt_set"]) if "sampling" in rows.columns else [True] * len(rows)
        taus = " ".join(f"{r.prompt_set}{'' if f else '@' + str(r.sampling)} {r.tau:.3f}"
                        for r, f in zip(rows.itertuples(), first))
        if "sampling" in df.columns:  # best so far by the first configured setting
            df = df[~df.duplicated(["checkpoint", "prompt_set"])]
        best = []
        for ps, g in df.dropna(subset=["tau"]).groupby("prompt_set"):
            i = g["tau"].idxmax()
            b = g.loc[i]
            best.append(f"{ps} {b['tau']:.3f} ({f'step {int(b.step)}' if g['step'].notna()[i] else b.checkpoint})")
        return f"watch: step {step if step is not None else '?'} {cand.name}: tau {taus} | best {', '.join(best)}"

    def evaluate(self, cand: Candidate) -> bool:
        """Evaluate one checkpoint, log the table to the trackers, print its line, record it done."""
        log.info("evaluating %s (step %s)", cand.path, cand.step)
        rc, logf = self.snakemake(cand)
        if not cand.path.exists():
            log.warning("%s was deleted by the trainer during its evaluation: skipped", cand.path)
            return False
        if rc != 0:
            self._write(self.record("failed", cand.name), {"name": cand.name, "path": str(cand.path), "rc": rc,
                                                           "log": str(logf), "signature": cand.signature})
            print(f"watch: FAILED {cand.name} (Snakemake exit {rc}); log: {logf}", file=self.out, flush=True)
            return False
        self.record("failed", cand.name).unlink(missing_ok=True)
        rec = {"name": cand.name, "path": str(cand.path), "step": cand.step, "signature": cand.signature,
               "evals": self.targets(cand.name), "finished": time.time()}
        df = self.table(cand.name)
        logged = log_table(df, self.cfg.get("trackers") or {}, self.run)
        rec["trackers"] = {k: v for k, v in logged.items() if k != "points"}
        # the record goes last: a kill before it only repeats this (finished) Snakemake run, which
        # then has nothing to do, and the trackers skip the points they already hold
        self._write(self.record("done", cand.name), rec)
        print(self.line(cand, df), file=self.out, flush=True)
        return True

    def table(self, also: str | None = None):
        """Tau table of every evaluated checkpoint (and ``also``), written to ``results/<run>/watch/tau.*``."""
        from dflash_eval.stages.summary import write_summary  # deferred: pandas; watch --help stays pandas-free (tests/core/test_startup.py)

        names = list(self.done()) + ([also] if also else [])
        evals = [t for n in dict.fromkeys(names) for t in self.targets(n) if os.path.isfile(t)]
        return write_summary(evals, self.state / "tau.csv", self.state / "tau.parquet")

    def stop_after(self, cand: Candidate) -> bool:
        o = self.opts
        return (o.until_step is not None and cand.step is not None and cand.step >= o.until_step) \
            or matches(cand.name, o.final_checkpoint)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def run_forever(self) -> int:
        """Poll until a stop condition (module docstring); returns the process exit code."""
        self.lock()
        try:
            return self._loop()
        finally:
            self.unlock()

    def _loop(self) -> int:
        log.info("watching %s every %g s (run %s, prompt sets %s)", self.opts.dir, self.opts.poll_s, self.run,
                 ", ".join(self.prompt_sets))
        if any(self.stop_after(c) for c in self._done_candidates()):
            log.info("a stop checkpoint is already evaluated: nothing to do")
            return 0
        while True:
            for cand in self.pending():
                if not cand.path.exists():
                    log.warning("%s was removed before it was evaluated (rotation?): skipped", cand.path)
                    continue
                self.evaluate(cand)
                if self.stop_after(cand):
                    log.info("stop: %s reached (watch.until_step / watch.final_checkpoint)", cand.name)
                    return 0
            if self.opts.once:
                return 0
            time.sleep(self.opts.poll_s)

    def _done_candidates(self) -> list[Candidate]:
        return [Candidate(Path(r.get("path", n)), n, r.get("step"), True) for n, r in self.done().items()]


def run(configfiles: list[str], once: bool = False, until_step: int | None = None, poll_s: float | None = None,
        out=None) -> int:
    """Load the config, then :meth:`Watcher.run_forever`; returns the exit code.

    Raises:
        InputError: a bad config (no ``watch.dir``), or another watch of the run is running.
    """
    cfg = load_config(configfiles)
    opts = WatchOptions.from_config(cfg, until_step=until_step, poll_s=poll_s, once=once or None)
    return Watcher(configfiles, opts, cfg, out).run_forever()


def add_arguments(p) -> None:
    """Arguments of ``python -m dflash_eval watch``."""
    p.add_argument("--configfile", nargs="+", required=True, metavar="YAML",
                   help="the config file(s) you give Snakemake, with a watch section (watch.dir: the training "
                        "output folder); merged after config/config.yaml")
    p.add_argument("--once", action="store_true", help="evaluate what is complete now, then exit")
    p.add_argument("--until-step", type=int, default=None, help="stop after the checkpoint at or past this step "
                   "(overrides watch.until_step)")
    p.add_argument("--poll-s", type=float, default=None, help="seconds between looks at the folder (watch.poll_s)")


def main(args, opts=None) -> int:
    """``python -m dflash_eval watch`` (:func:`run`)."""
    return run(args.configfile, args.once, args.until_step, args.poll_s)
