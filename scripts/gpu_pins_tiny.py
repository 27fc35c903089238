"""The tiny workflows of scripts/gpu_pins_check.sh: their inputs, and the GPU-vs-CPU comparison.

    python scripts/gpu_pins_tiny.py make DIR            # DIR/llama, DIR/hybrid: inputs + config.yaml
    python scripts/gpu_pins_tiny.py gpu-config SET OUT [DEVICE]  # the overlay that moves SET's jobs to CUDA
    python scripts/gpu_pins_tiny.py compare CPU GPU     # two results/<run>/ folders: tau, completions

``make`` (here, with the dev venv): ``llama`` is the CI's tiny workflow (tests/workflow/test_workflow.py
``make_tiny_workdir``: a 4-layer random llama, two random checkpoints and a random demo drafter,
two file prompt sets, float32); ``hybrid`` is the same on a tiny random Qwen3.5 (Gated DeltaNet +
full attention, tests/tiny_hybrid.py) with word-level prompts, so on CUDA the fla kernels run
inside the workflow, and ``kernel_parity`` (fla vs torch states and tau) is on. Each set holds
only inputs (tiny_target/, prompts/, ckpts/, config/config.yaml); the workflow itself is copied
from the checkout where it runs.

``compare`` prints, per (checkpoint, prompt set), tau on both devices and its difference, the
number of samples whose greedy completion is identical, and for the hybrid set the fla-vs-torch
kernel-parity lines; it exits 1 only when a run is missing rows (the numbers are for reading:
CPU float32 and CUDA float32, torch GDN and fla GDN, are different arithmetic).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
#: the inputs a set carries; everything else in a workdir is the workflow, copied where it runs
INPUTS = ("tiny_target", "prompts", "ckpts", "config/config.yaml")
HYBRID_PROMPTS = ["t5 t9 t20 t33", "t7 t8 t100 t3 t4", "t50 t51", "t60 t61 t62 t63 t64 t65", "t90 t12"]


def _keep_inputs(wd: Path, out: Path) -> None:
    for name in INPUTS:
        dst = out / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (wd / name).is_dir() else shutil.copy2)(wd / name, dst)


def make(out_dir: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import tiny_hybrid
    from test_workflow import make_tiny_workdir

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wd = make_tiny_workdir(Path(tmp) / "llama")
        _keep_inputs(wd, out_dir / "llama")

        wd = make_tiny_workdir(Path(tmp) / "hybrid")
        shutil.rmtree(wd / "tiny_target")
        tiny_hybrid.save_target(wd / "tiny_target", "qwen3_5", seed=0)
        for i, name in enumerate(("a.jsonl", "b.jsonl")):
            rows = HYBRID_PROMPTS[i::2]
            (wd / "prompts" / name).write_text("".join(json.dumps({"id": f"{name[0]}{j}", "prompt": p}) + "\n"
                                                       for j, p in enumerate(rows)))
        for ckpt in sorted((wd / "ckpts").glob("*.pt")):  # drafters of the hybrid target's shapes
            step = ckpt.stem.removeprefix("step")
            subprocess.run([sys.executable, "-m", "dflash_eval", "demo-checkpoint", "--target", "tiny_target",
                            "--random-init", "--layer-ids", "1,2", "--block-size", "4", "--num-layers", "1",
                            "--step", step, "--seed", step[0], "--out", f"ckpts/{ckpt.name}"],
                           cwd=wd, check=True, capture_output=True, text=True)
        cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
        cfg["run"] = "tinyhybrid"
        cfg["target"]["name"] = "tinyhybrid"
        cfg["kernel_parity"] = {"enabled": True, "n_samples": 2}
        (wd / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        _keep_inputs(wd, out_dir / "hybrid")
    print(f"tiny inputs: {out_dir}/llama, {out_dir}/hybrid")


def gpu_config(name: str, out: Path, device: str = "cuda") -> None:
    """Every torch job on ``device`` in float32 (as on the CPU), and on CUDA for the hybrid set fla
    required (``device="cpu"``: the smoke run of scripts/gpu_pins_check.sh)."""
    cfg = {section: {"device": device} for section in ("generation", "cache", "evaluate", "target_costs")}
    if name == "hybrid" and device == "cuda":
        cfg["target"] = {"linear_attn_backend": "fla"}
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _completions(run: Path) -> dict[str, list[int]]:
    out = {}
    for f in sorted((run / "completions").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[f"{f.stem}/{r['id']}"] = r["completion_ids"]
    return out


def compare(cpu: Path, gpu: Path) -> int:
    import pandas as pd

    key = ["checkpoint", "prompt_set"]
    a = pd.read_csv(cpu / "tau.csv")[key + ["n_samples", "tau"]]
    b = pd.read_csv(gpu / "tau.csv")[key + ["n_samples", "tau"]]
    m = a.merge(b, on=key, how="outer", suffixes=("_cpu", "_gpu"), indicator=True)
    m["tau_diff"] = m.tau_gpu - m.tau_cpu
    print(m.drop(columns="_merge").to_string(index=False))
    ca, cb = _completions(cpu), _completions(gpu)
    same = sum(ca[k] == cb.get(k) for k in ca)
    print(f"greedy completions identical on CPU and GPU: {same} of {len(ca)}")
    print(f"max |tau_gpu - tau_cpu|: {m.tau_diff.abs().max():.4f}")
    import h5py
    import numpy as np

    for cache in sorted((gpu / "cache").glob("*.h5")):
        if (cpu / "cache" / cache.name).is_file():
            worst, n, skipped = (0.0, ""), 0, 0
            with h5py.File(cpu / "cache" / cache.name, "r") as fa, h5py.File(cache, "r") as fb:
                def visit(name, obj):
                    nonlocal worst, n, skipped
                    if not isinstance(obj, h5py.Dataset) or obj.dtype.kind != "f":
                        return
                    other = fb.get(name)
                    if other is None or other.shape != obj.shape:
                        skipped += 1
                        return
                    x, y = obj[()].astype(np.float64), other[()].astype(np.float64)
                    err = float(np.linalg.norm(y - x) / max(np.linalg.norm(x), 1e-30))
                    n += 1
                    worst = max(worst, (err, name))
                fa.visititems(visit)
            print(f"hidden-state cache {cache.name}, CPU vs GPU: {n} float datasets compared, max rel-L2 "
                  f"{worst[0]:.2e} ({worst[1] or '-'}); {skipped} not comparable (other shape: other completions)")
        with h5py.File(cache, "r") as f:
            kernel = json.loads(f.attrs.get("linear_attn_kernel", "{}")).get("backend", "?")
            device = f.attrs.get("device_name") or f.attrs.get("device", "?")
            print(f"GPU cache {cache.name}: torch {f.attrs.get('torch_version')}, device {device}, "
                  f"dtype {f.attrs.get('dtype', '?')}, linear-attention kernel {kernel}")
    kp = gpu / "kernel_parity.json"
    if kp.is_file():
        r = json.loads(kp.read_text())
        print(f"{r['title']} (GPU run)\n{r['markdown']}")
    return 0 if (m._merge == "both").all() else 1


if __name__ == "__main__":
    cmd, *args = sys.argv[1:] or ["help"]
    if cmd == "make" and len(args) == 1:
        make(Path(args[0]))
    elif cmd == "gpu-config" and len(args) in (2, 3):
        gpu_config(args[0], Path(args[1]), *args[2:])
    elif cmd == "compare" and len(args) == 2:
        sys.exit(compare(Path(args[0]), Path(args[1])))
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
