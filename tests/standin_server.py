"""A small stand-in for a serving engine, for tests (NOT SGLang or vLLM; a few hundred lines of stdlib HTTP).

It serves a local HF target with greedy HF ``generate`` (batch 1, all-ones attention mask) and speaks:

- SGLang's documented native schema (docs ``basic_usage/native_api`` and ``basic_usage/sampling_params``;
  ``python/sglang/srt/entrypoints/http_server.py``): ``POST /generate`` with ``input_ids`` + ``sampling_params``
  (``max_new_tokens``, ``stop_token_ids``, ``temperature``...) -> ``{"text", "output_ids", "meta_info":
  {"id", "finish_reason": {"type": "stop", "matched": id} | {"type": "length", "length": n},
  "prompt_tokens", "completion_tokens"}}``; ``GET /get_model_info``, ``GET /get_server_info`` (``version``,
  ``context_length``), ``POST /tokenize`` (``tokens``, ``count``, ``max_model_len``), ``GET /health``;
- the OpenAI-compatible subset vLLM offers (``GET /v1/models`` with ``max_model_len``, ``GET /version``,
  ``POST /tokenize``, ``POST /v1/completions`` with token-id prompts; ``choices[0].token_ids`` only when
  ``openai_ids`` is true, otherwise text only, like a server that cannot return ids).

Knobs for fault tests: ``faults`` (a list consumed one per generation request: an HTTP status to answer, or
``"drop"`` to close the connection without an answer, or ``None``), ``api_key`` (401 without it),
``trim_matched`` (drop the matched stop id from ``output_ids``, which SGLang may do), ``tokenizer_dir``
(tokenize with another tokenizer), ``ignore_stop`` (generate past stop ids), ``max_model_len``, ``edit`` (a callable
``(prompt ids, completion ids) -> completion ids`` applied to each ``/v1/completions`` answer: a corrupted engine;
it may be replaced between requests).

Run as a fake ``vllm.entrypoints.openai.api_server`` (``--model DIR --port N [--max-model-len N]``),
it also starts a child process that sleeps, like vLLM's engine core, to test process-group clean-up.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _QuietServer(ThreadingHTTPServer):
    """A client that drops its connection (a killed job, a timed-out retry) is expected here."""

    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StandIn:
    def __init__(self, target_dir, mode: str = "sglang", openai_ids: bool = True, tokenizer_dir=None, faults=(),
                 api_key: str | None = None, trim_matched: bool = False, ignore_stop: bool = False,
                 max_model_len: int = 4096, port: int = 0, edit=None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.target_dir = str(target_dir)
        self.mode, self.openai_ids = mode, openai_ids
        from transformers import GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.float32).eval()
        self.model.generation_config = GenerationConfig()  # only the request's stop ids apply
        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir or target_dir))
        self.faults = list(faults)
        self.api_key, self.trim_matched, self.ignore_stop = api_key, trim_matched, ignore_stop
        self.max_model_len = max_model_len
        self.edit = edit
        self.n_generate = 0
        self.lock = threading.Lock()
        self.httpd = _QuietServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- model
    def greedy(self, ids, max_new, stops) -> tuple[list[int], int | None]:
        import torch
        from transformers import GenerationConfig

        stops = [] if self.ignore_stop else list(stops)
        cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new, eos_token_id=stops or None,
                               pad_token_id=self.tok.pad_token_id)
        x = torch.tensor([ids])
        with self.lock, torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg)
        new = out[0, len(ids):].tolist()
        if stops:
            for k, t in enumerate(new):
                if t in stops:
                    return new[:k + 1], t
        return new, None

    # -- HTTP
    def _handler(self):
        srv = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _auth(self) -> bool:
                if srv.api_key and self.headers.get("Authorization") != f"Bearer {srv.api_key}":
                    self._send(401, {"error": "unauthorized"})
                    return False
                return True

            def _fault(self) -> bool:
                with srv.lock:
                    srv.n_generate += 1
                    f = srv.faults.pop(0) if srv.faults else None
                if f is None:
                    return False
                if f == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return True
                self._send(int(f), {"error": f"injected {f}"})
                return True

            def do_GET(self):
                if not self._auth():
                    return
                p = self.path
                if p == "/health":
                    self._send(200, {})
                elif p == "/get_model_info" and srv.mode == "sglang":
                    self._send(200, {"model_path": srv.target_dir, "tokenizer_path": srv.target_dir,
                                     "is_generation": True, "preferred_sampling_params": None, "weight_version": "default"})
                elif p == "/get_server_info" and srv.mode == "sglang":
                    self._send(200, {"model_path": srv.target_dir, "context_length": srv.max_model_len,
                                     "version": "0.5.23-standin"})
                elif p == "/v1/models" and srv.mode == "openai":
                    self._send(200, {"object": "list", "data": [{"id": srv.target_dir, "object": "model",
                                                                 "owned_by": "standin", "root": srv.target_dir,
                                                                 "max_model_len": srv.max_model_len}]})
                elif p == "/version" and srv.mode == "openai":
                    self._send(200, {"version": "0.0-standin"})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n) or b"{}")
                if not self._auth():
                    return
                p = self.path
                if p == "/tokenize":
                    ids = srv.tok(req["prompt"], add_special_tokens=bool(req.get("add_special_tokens", True))).input_ids
                    self._send(200, {"tokens": ids, "count": len(ids), "max_model_len": srv.max_model_len})
                elif p == "/generate" and srv.mode == "sglang":
                    if self._fault():
                        return
                    sp = req.get("sampling_params") or {}
                    ids, matched = srv.greedy(req["input_ids"], int(sp.get("max_new_tokens", 128)),
                                              sp.get("stop_token_ids") or [])
                    fin = {"type": "stop", "matched": matched} if matched is not None else {"type": "length",
                                                                                             "length": len(ids)}
                    out_ids = ids[:-1] if (srv.trim_matched and matched is not None) else ids
                    self._send(200, {"text": srv.tok.decode(ids, skip_special_tokens=True), "output_ids": out_ids,
                                     "meta_info": {"id": str(srv.n_generate), "finish_reason": fin,
                                                   "prompt_tokens": len(req["input_ids"]),
                                                   "completion_tokens": len(ids)}})
                elif p == "/v1/completions" and srv.mode == "openai":
                    if self._fault():
                        return
                    prompt = req["prompt"]
                    if isinstance(prompt, str):
                        prompt = srv.tok(prompt, add_special_tokens=False).input_ids
                    ids, matched = srv.greedy(prompt, int(req.get("max_tokens", 16)), req.get("stop_token_ids") or [])
                    if srv.edit is not None:
                        ids = list(srv.edit(list(prompt), list(ids)))
                    choice = {"index": 0, "text": srv.tok.decode(ids, skip_special_tokens=True),
                              "finish_reason": "stop" if matched is not None else "length", "stop_reason": None}
                    if srv.openai_ids and req.get("return_token_ids"):
                        choice["token_ids"] = ids
                        choice["prompt_token_ids"] = prompt
                    self._send(200, {"id": "cmpl-standin", "object": "text_completion", "model": srv.target_dir,
                                     "choices": [choice], "usage": {"prompt_tokens": len(prompt),
                                                                    "completion_tokens": len(ids)}})
                else:
                    self._send(404, {"detail": "Not Found"})

        return H


def main(argv=None) -> None:
    """Fake ``vllm.entrypoints.openai.api_server``: ``--model DIR --port N`` (other flags ignored)."""
    import argparse
    import subprocess

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--port", type=int)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args, _ = ap.parse_known_args(argv)
    # like vLLM's engine core: a child in the same process group that outlives a killed parent
    subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)", "standin-engine-core"])
    with StandIn(args.model, mode="openai", port=args.port, max_model_len=args.max_model_len) as s:
        print(f"stand-in vLLM serving {args.model} at {s.url}", flush=True)
        s.thread.join()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
