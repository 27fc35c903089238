"""Nothing wrong passes silently: damaged or non-finite inputs are refused where they are read.

* a cache sample whose bytes changed after it was written (bytes flipped on disk inside a sample that
  ``evaluate`` replays) fails ``evaluate`` naming the file and the sample (it used to give another tau);
* so does an edited per-sample value (``prompt_len``, ``max_new_tokens``, ... of format 5: under the
  sample's checksum through its ``meta``), naming the file, the array, the sample and the fix; a format-4
  cache is still read, its per-sample values unverified, and the log says so;
* non-finite hidden states fail the reader naming the sample, token and target layer;
* a stripped drafter with a NaN tensor, or whose weights no longer match the sha256 that strip recorded
  in ``strip_info.json``, fails ``load_drafter`` naming the tensor / file (it used to give tau 1.0);
* a prompt + ``max_new_tokens`` beyond the target's ``max_position_embeddings`` is refused by the
  completions stage unless ``generation.allow_beyond_max_positions``;
* ``bench/verify_cost.py --smoke`` runs and reports the verification cost.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_tiny_pipeline  # noqa: E402

from dflash_eval.cache.reader import CacheReader  # noqa: E402
from dflash_eval.cache.writer import write_cache  # noqa: E402
from dflash_eval.core.errors import InputError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A tiny target, a random drafter folder (stripped layout), 3 prompts, their completions and cache."""
    from dflash_eval.stages.hidden_states import extract_hidden_states

    p = make_tiny_pipeline(tmp_path_factory.mktemp("reliability"), [1, 3], block_size=4, max_new_tokens=16)
    extract_hidden_states(p["target_dir"], p["dir"] / "c.jsonl", p["dir"] / "c.h5", layer_ids=[1, 3], device="cpu",
                          dtype="float32")
    return p


def _evaluate(p, cache, drafter=None, out="ev.json"):
    from dflash_eval.stages.evaluate import evaluate

    d = p["dir"]
    return evaluate(drafter or d / "drafter", cache, p["target_dir"], d / out, device="cpu", dtype="float32",
                    ddtree_budgets=[])


def test_flipped_bytes_in_an_evaluated_sample_fail_evaluate(pipeline):
    d = pipeline["dir"]
    _evaluate(pipeline, d / "c.h5", out="intact.json")  # the intact cache evaluates
    bad = d / "flipped.h5"
    shutil.copy(d / "c.h5", bad)
    with h5py.File(bad, "r") as f:  # where sample 1's hidden bytes lie in the file (contiguous layout)
        ds = f["samples/000001/hidden"]
        offset, nbytes = ds.id.get_offset(), ds.id.get_storage_size()
        sample_id = f["sample_ids"][1].decode()
    assert offset is not None and nbytes > 64
    data = bytearray(bad.read_bytes())
    data[offset + nbytes // 2] ^= 0x10  # one bit of one hidden value, on disk: HDF5 itself sees nothing
    bad.write_bytes(bytes(data))
    with CacheReader(bad, verify=False) as rd:  # the damage is invisible without the checksum ...
        rd.sample(1)
        assert rd.verify() == [1]
    with pytest.raises(InputError) as err:  # ... and evaluate, which reads sample 1, refuses it
        _evaluate(pipeline, bad, out="flipped.json")
    e = err.value
    assert Path(e.file) == bad and e.field == "samples/000001" and sample_id in e.problem
    assert "do not match their checksum" in e.problem and "re-extract" in e.fix
    assert not (d / "flipped.json").exists()
    with CacheReader(bad) as rd:  # the other samples still read
        assert rd.sample(0).sample_id != sample_id and rd.sample(2).sample_id != sample_id


def _edit_array(path: Path, name: str, i: int, value) -> None:
    with h5py.File(path, "r+") as f:
        f[name][i] = value


@pytest.mark.parametrize("name, value", [("prompt_len", None), ("max_new_tokens", 3), ("stop_reason", "other")])
def test_an_edited_per_sample_value_fails_evaluate(pipeline, tmp_path, name, value):
    """Format 5: ``prompt_len`` (which moves the first anchor: another tau) and the other per-sample arrays of
    an evaluated sample are under its checksum; an edit is refused naming file, array, sample and fix."""
    d = pipeline["dir"]
    intact = _evaluate(pipeline, d / "c.h5", out="meta_intact.json")
    bad = tmp_path / "edited.h5"
    shutil.copy(d / "c.h5", bad)
    with h5py.File(bad, "r") as f:
        assert f.attrs["format_version"] == 6
        old, sample_id = f[name][1], f["sample_ids"][1].decode()
        meta = json.loads(f["samples/000001"].attrs["meta"])
    assert meta["sample_id"] == sample_id and meta["prompt_len"] == intact["samples"][1]["prompt_len"] == 8
    if name == "stop_reason":  # the one it is not
        value = "eos" if old.decode() == "length" else "length"
    value = int(old) - 2 if value is None else value  # prompt_len 8 -> 6: two prompt tokens become completion
    _edit_array(bad, name, 1, value)
    with CacheReader(bad, verify=False) as rd:  # unverified, the edit reads back silently
        assert rd.sample(1).__dict__[name] == value
        assert rd.verify() == [1]
    with pytest.raises(InputError) as err:
        _evaluate(pipeline, bad, out="meta_edited.json")
    e = err.value
    assert Path(e.file) == bad and e.field == name and f"{sample_id!r} (samples/000001)" in e.problem
    assert f"{name}[1] is {value!r}" in e.problem and "checksummed meta" in e.problem and "re-extract" in e.fix
    assert not (tmp_path / "meta_edited.json").exists()
    with CacheReader(bad) as rd:  # read with its arrays, sample 1 is refused the same way; the others read
        assert rd.sample(0).sample_id != sample_id
        with pytest.raises(InputError) as err:
            rd.samples([2, 1])
        assert err.value.field == name


def test_an_edited_meta_fails_the_checksum(pipeline, tmp_path):
    """Editing the sample's ``meta`` too (both copies of prompt_len) does not make the edit pass: meta is hashed."""
    d = pipeline["dir"]
    bad = tmp_path / "both.h5"
    shutil.copy(d / "c.h5", bad)
    with h5py.File(bad, "r+") as f:
        g = f["samples/000001"]
        meta = json.loads(g.attrs["meta"])
        meta["prompt_len"] -= 2
        g.attrs["meta"] = json.dumps(meta, separators=(",", ":"))
        f["prompt_len"][1] = meta["prompt_len"]
        sample_id = meta["sample_id"]
    with CacheReader(bad) as rd:
        assert rd.sample_attrs(1)["prompt_len"] == meta["prompt_len"]  # the two copies agree (no hash here) ...
        with pytest.raises(InputError) as err:  # ... but the read sample's checksum does not
            rd.sample(1)
    e = err.value
    assert e.field == "samples/000001" and sample_id in e.problem
    assert "its bytes and per-sample values (meta) do not match their checksum" in e.problem
    with pytest.raises(InputError, match="do not match their checksum"):
        _evaluate(pipeline, bad, out="both.json")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_hidden_states_name_sample_token_and_layer(tmp_path, dtype):
    hidden = torch.ones(5, 2, 8, dtype=dtype)
    hidden[3, 1, 2] = float("nan") if dtype == torch.float32 else float("inf")
    attrs = {"format": "dflash-eval/hidden-state-cache", "format_version": 6, "target_layer_ids": [2, 7],
             "hidden_size": 8, "num_target_layers": 8}
    samples = [{"sample_id": sid, "input_ids": [1, 2, 3, 4, 5], "prompt_len": 2, "hidden": h,
                "target_argmax": [2, 3, 4, 5, 6], "stop_reason": "eos", "max_new_tokens": 8}
               for sid, h in (("ok", torch.ones(5, 2, 8, dtype=dtype)), ("bad", hidden))]
    write_cache(tmp_path / "c.h5", attrs, samples)
    with CacheReader(tmp_path / "c.h5") as rd:
        assert rd.verify() == []  # the checksum is intact: the values were written so
        assert float(rd.sample(0).hidden.sum()) == 80.0
        with pytest.raises(InputError) as err:
            rd.sample(1, [7])
    e = err.value
    assert e.field == "samples/000001/hidden"
    assert "'bad'" in e.problem and "token 3, target layer 7" in e.problem and "non-finite" in e.problem


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_checksum_and_scan_is_sample_sha256_and_the_finite_scan_in_one_pass(monkeypatch, dtype):
    """The reader's one-pass check gives the writer's checksum and finds a non-finite value in any chunk."""
    from dflash_eval.cache import sample_check
    from dflash_eval.cache.format import sample_sha256
    from dflash_eval.cache.sample_check import checksum_and_scan, first_non_finite

    monkeypatch.setattr(sample_check, "SCAN_CHUNK", 1000)  # several chunks, the last one short
    rng = np.random.default_rng(3)
    ids, argmax = rng.integers(0, 500, 37).astype(np.int32), rng.integers(0, 500, 37).astype(np.int32)
    hidden = (rng.integers(0, 0x7F00, (37, 3, 40)).astype(np.uint16) if dtype == np.uint16
              else rng.standard_normal((37, 3, 40)).astype(np.float32))
    for meta in (None, '{"sample_id": "x"}'):
        assert checksum_and_scan(ids, argmax, hidden, meta) == (sample_sha256(ids, argmax, hidden, meta), True)
    big_endian = hidden.astype(hidden.dtype.newbyteorder(">"))  # hashed as its little-endian bytes, as the writer does
    assert checksum_and_scan(ids, argmax, big_endian)[0] == sample_sha256(ids, argmax, hidden)
    for t, k, x in ((36, 2, 39), (0, 0, 0), (20, 1, 5)):  # the last element (short last chunk), the first, one inside
        bad = hidden.copy()
        bad[t, k, x] = 0x7F80 | 0x0001 if dtype == np.uint16 else np.inf  # a NaN (bf16 bits) / inf
        digest, finite = checksum_and_scan(ids, argmax, bad)
        assert not finite and digest == sample_sha256(ids, argmax, bad) and first_non_finite(bad) == (t, k)


def test_nan_weights_fail_load_drafter_naming_the_tensor(pipeline, tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash_eval.drafter.model import load_drafter

    d = pipeline["dir"]
    bad = tmp_path / "nan_drafter"
    shutil.copytree(d / "drafter", bad)
    state = load_file(str(bad / "model.safetensors"))
    key = sorted(k for k in state if k.endswith("q_proj.weight"))[0]
    state[key][0, 0] = float("nan")
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(InputError) as err:
        load_drafter(bad)
    assert err.value.field == key and "1 of" in err.value.problem and "NaN or Inf" in err.value.problem
    with pytest.raises(InputError, match="NaN or Inf"):  # and so evaluate on that folder (it used to give tau 1.0)
        _evaluate(pipeline, d / "c.h5", drafter=bad, out="nan.json")


def test_weights_that_overflow_in_the_forward_pass_are_refused_by_evaluate(pipeline, tmp_path):
    """Finite weights that overflow in the drafter's forward pass (3e38 in one MLP
    projection, as a diverged run leaves) passed the weights check and drafted garbage: tau 1.0, exit 0. evaluate
    refuses a drafter whose drafted states are not finite, naming the folder."""
    from safetensors.torch import load_file, save_file

    d = pipeline["dir"]
    bad = tmp_path / "overflowing_drafter"
    shutil.copytree(d / "drafter", bad)
    state = load_file(str(bad / "model.safetensors"))
    key = sorted(k for k in state if k.endswith("mlp.down_proj.weight"))[0]
    state[key][:] = 3e38  # finite; the products' sums overflow
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(InputError) as err:
        _evaluate(pipeline, d / "c.h5", drafter=bad, out="overflow.json")
    assert Path(err.value.file) == bad / "model.safetensors" and "not finite (NaN or inf) in its forward pass" in (
        err.value.problem) and "earlier checkpoint" in err.value.fix
    assert not (tmp_path / "overflow.json").exists() and not (d / "overflow.json").exists()


def test_prompt_beyond_max_positions_is_refused(pipeline, tmp_path):
    from dflash_eval.stages.completions import generate_completions

    d = pipeline["dir"]  # the tiny target has max_position_embeddings 512
    rows = [{"id": "short", "source": "file", "prompt": "", "text": "", "prompt_ids": [1, 40, 41]},
            {"id": "long", "source": "file", "prompt": "", "text": "", "prompt_ids": [1] + [40] * 499}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError) as err:
        generate_completions(pipeline["target_dir"], prompts, tmp_path / "c.jsonl", max_new_tokens=16,
                             device="cpu", dtype="float32")
    e = err.value
    assert e.field == "line 2: prompt_ids"
    assert "'long' has 500 tokens + generation.max_new_tokens 16 = 516" in e.problem
    assert "max_position_embeddings 512" in e.problem and "1 of 2 prompts" in e.problem
    assert "max_prompt_tokens" in e.fix and "at most 496" in e.fix and "to 12 for" in e.fix
    assert "allow_beyond_max_positions" in e.fix
    assert not (tmp_path / "c.jsonl").exists()
    # within the limit: generated; the documented override generates the long one too
    generate_completions(pipeline["target_dir"], prompts, tmp_path / "ok.jsonl", max_new_tokens=12, batch_size=2,
                         device="cpu", dtype="float32")
    generate_completions(pipeline["target_dir"], prompts, tmp_path / "over.jsonl", max_new_tokens=16, batch_size=2,
                         device="cpu", dtype="float32", allow_beyond_max_positions=True)
    assert len((tmp_path / "over.jsonl").read_text().splitlines()) == 2
    assert d.exists()


def test_verify_cost_bench_smoke(pipeline):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "verify_cost.py"), "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["n_samples"] > 0 and result["read_s"] > 0 and result["verify_s"] > 0
    assert result["evaluate_s"] > 0 and result["check_s"] > 0 and result["verify_pct_of_evaluate"] == pytest.approx(
        100 * result["check_s"] / result["evaluate_s"], rel=1e-6)
    assert result["evaluate_s"] == min(result["rounds_verified_s"]) and len(result["rounds_verified_s"]) == 3
    assert result["evaluate_unverified_s"] == min(result["rounds_unverified_s"])
    assert result["overhead_pct"] == pytest.approx(
        100 * (result["evaluate_s"] - result["evaluate_unverified_s"]) / result["evaluate_unverified_s"], rel=1e-6)
    assert result["tensor_shape"] == [512, 64] and result["tensor_check_s"] > 0 and result["tensor_read_s"] > 0
    assert result["tensor_check_pct_of_evaluate"] == pytest.approx(100 * result["tensor_check_s"] / result["evaluate_s"])


def test_samples_verifies_in_threads_and_names_the_first_bad_sample(tmp_path):
    hidden = [torch.full((4, 1, 8), float(k)) for k in range(5)]
    attrs = {"format": "dflash-eval/hidden-state-cache", "format_version": 6, "target_layer_ids": [2],
             "hidden_size": 8, "num_target_layers": 4}
    write_cache(tmp_path / "c.h5", attrs, [{"sample_id": f"s{k}", "input_ids": [1, 2, 3, 4], "prompt_len": 1,
                                            "hidden": h, "target_argmax": [2, 3, 4, 5], "stop_reason": "eos",
                                            "max_new_tokens": 4} for k, h in enumerate(hidden)])
    with CacheReader(tmp_path / "c.h5") as rd:
        got = rd.samples([4, 0, 2], [2])
    assert [s.sample_id for s in got] == ["s4", "s0", "s2"] and [float(s.hidden[0, 0, 0]) for s in got] == [4, 0, 2]
    with h5py.File(tmp_path / "c.h5", "r+") as f:
        for k in (1, 3):
            d = f[f"samples/{k:06d}/hidden"]
            a = d[()]
            a[0, 0, 0] += 1
            d[...] = a
    with CacheReader(tmp_path / "c.h5") as rd, pytest.raises(InputError) as err:
        rd.samples([0, 3, 1])
    assert err.value.field == "samples/000003"  # the first bad one in the order asked


def test_verified_samples_hands_samples_out_and_raises_a_bad_one_on_leaving(tmp_path):
    """evaluate's read: the samples are used (replayed) while their checksums are computed; leaving the block
    raises the first bad sample's error, replacing (and chaining) what the body raised on the damaged values;
    an array that disagrees with its sample's meta (format 5) is refused before the body runs."""
    attrs = {"format": "dflash-eval/hidden-state-cache", "format_version": 6, "target_layer_ids": [2],
             "hidden_size": 8, "num_target_layers": 4}
    write_cache(tmp_path / "c.h5", attrs, [{"sample_id": f"s{k}", "input_ids": [1, 2, 3, 4], "prompt_len": 1,
                                            "hidden": torch.full((4, 1, 8), float(k)), "target_argmax": [2, 3, 4, 5],
                                            "stop_reason": "eos", "max_new_tokens": 4} for k in range(4)])
    with CacheReader(tmp_path / "c.h5") as rd, rd.verified_samples([3, 1]) as got:  # intact: nothing raised
        assert [(s.sample_id, s.prompt_len, s.argmax_agreement) for s in got] == [("s3", 1, 1.0), ("s1", 1, 1.0)]
    with h5py.File(tmp_path / "c.h5", "r+") as f:
        d = f["samples/000002/hidden"]
        d[0, 0, 0] = 9.0  # finite, a valid file: only the checksum sees it
    seen = []
    with CacheReader(tmp_path / "c.h5") as rd, pytest.raises(InputError) as err:
        with rd.verified_samples([0, 2, 1]) as got:
            seen = [s.sample_id for s in got]
            raise IndexError("what replaying a damaged value can do")
    assert seen == ["s0", "s2", "s1"] and err.value.field == "samples/000002"
    assert isinstance(err.value.__cause__, IndexError)
    with h5py.File(tmp_path / "c.h5", "r+") as f:
        f["max_new_tokens"][1] = 40
    body = []
    with CacheReader(tmp_path / "c.h5") as rd, pytest.raises(InputError) as err:
        with rd.verified_samples([1, 3]):
            body.append(1)
    assert body == [] and err.value.field == "max_new_tokens" and "max_new_tokens[1] is 40" in err.value.problem


@pytest.mark.parametrize("free_mb, want", [
    (71, "the 3 samples left need about 6 MB (+ 67 MB of headroom) and 71 MB are free in {dir}: free at least 2 MB "
         "more and rerun"),
    (500, "the 3 samples left need about 6 MB (+ 67 MB of headroom) and the file system reports 500 MB free in {dir}, "
          "so a quota or a file size limit (ulimit -f) stopped the write"),
])
def test_disk_full_message_says_needed_and_free_consistently(tmp_path, monkeypatch, free_mb, want):
    """The case: '71 MB free, the next batch needs 6 MB + 64 MB' then 'free 0.01 GB'."""
    import errno
    import shutil as _shutil

    from dflash_eval.cache.disk_room import no_room_error

    usage = _shutil.disk_usage(tmp_path)
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: usage._replace(free=free_mb * 10**6))
    err = no_room_error(tmp_path / "c.h5.partial", OSError(errno.ENOSPC, "No space left on device"), 5, 8, 6 * 10**6)
    assert err.problem.startswith("no room left to write the cache") and "5 of 8 samples are committed" in err.problem
    assert want.format(dir=tmp_path) in err.fix and "the job resumes from the partial file" in err.fix


def test_closed_client_stops_its_request_in_flight_without_retrying():
    """The leak behind '[Errno 9] Bad file descriptor; retry 1/8' printed after the test summary: a request in
    flight in a worker thread when the source closes its client (on an error elsewhere) was retried (and with
    backoff up to 30 s outlived its test); now it fails at once, unretried."""
    import socket
    import threading
    import time

    from dflash_eval.serving.clients import ServerClient, ServerUnavailable

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    accepted = []

    def accept():  # accepts and never answers: the request stays in flight
        try:
            accepted.append(srv.accept()[0])
        except OSError:
            pass

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    client = ServerClient(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=1.5, retries=8, backoff_s=0.2,
                          max_backoff_s=0.5)
    errors = []

    def request():
        try:
            client.request("GET", "/v1/models")
        except BaseException as err:  # noqa: BLE001 (recorded for the assertion)
            errors.append(err)

    worker = threading.Thread(target=request)
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert accepted, "the request never connected"
        client.close()
        worker.join(6)
        assert not worker.is_alive()
        assert client.retry_counts == {}  # never retried after close (old: {'ReadError': 1}, then more)
        assert len(errors) == 1 and isinstance(errors[0], ServerUnavailable)
        assert "closed while the request was in flight" in str(errors[0])
    finally:
        for c in accepted:
            c.close()
        srv.close()
        acceptor.join(2)


def test_session_end_check_finds_leftover_threads_and_children():
    import subprocess as sp
    import threading

    from leftovers import leftovers

    baseline = {t.ident for t in threading.enumerate()}
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="leaky-client", daemon=True)
    t.start()
    child = sp.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    # Only this test's thread and child are asserted: a process another test started and is still ending (its
    # own grace period) may be alive too; the session-end check itself catches any that outlives the run.
    try:
        threads, kids = leftovers(baseline, grace_s=0.3)
        assert any(x.startswith("leaky-client (target Event.wait") for x in threads)
        assert child.pid in [pid for pid, _ in kids]
    finally:
        stop.set()
        t.join()
        child.kill()
        child.wait()
    threads, kids = leftovers(baseline, grace_s=2)
    assert not any(x.startswith("leaky-client") for x in threads) and child.pid not in [pid for pid, _ in kids]


