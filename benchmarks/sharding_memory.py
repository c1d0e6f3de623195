"""Memory per process, 2 processes on the embedded default: sharded (FSDP) against unsharded (DDP).

Usage: python benchmarks/sharding_memory.py [--processes 2] [--steps 2] [overrides]

Runs ``accelerate launch --multi_gpu --num_processes N -m tether train`` three times, with
``train.sharding=none``, ``fsdp`` (blocks gathered one at a time for generation, the default)
and ``fsdp`` with ``train.sharded_generation=whole`` (PPO, ``train.steps`` steps, no held-out
evaluation, so only the policy, its value head, the reference and AdamW are in memory), and reads
every worker's ``/proc/PID/status`` every 50 ms: ``VmRSS`` (resident now) and ``VmHWM`` (the
peak). The workers run with glibc's ``MALLOC_MMAP_THRESHOLD_=131072``: otherwise glibc raises its
mmap threshold after the first large free and keeps later freed blocks in its heap, so the
resident size stays near its high-water mark whatever is in use; with a fixed threshold every
large block freed goes back to the system and the resident size is the memory in use (the same
for every setting). Prints, per setting: the peak resident size of the largest worker, the median resident
size of the largest worker while it trains (from the first step on, after the one-time load of
the whole model that every process does before sharding it), and the bytes per parameter each
process keeps of the model state (weights, gradients, AdamW moments, reference), counted from
the model's parameters: ``(4 + 4 + 8) / N`` per trainable and ``4 / N`` per frozen parameter of
the policy, ``4 / N`` per reference parameter under FSDP; N times ``1 / N`` unsharded.

Prints numbers, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _status(pid: int) -> dict[str, int] | None:
    """VmRSS and VmHWM in bytes, and whether it is a tether worker; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    vals = {
        line.split(":")[0]: int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Vm")
    }
    worker = b"tether" in cmd and b"-m" in cmd and b"launch" not in cmd
    return {"rss": vals.get("VmRSS", 0), "hwm": vals.get("VmHWM", 0), "worker": worker}


def measure(setting: list[str], processes: int, steps: int, overrides: list[str], out: Path) -> dict:
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    cmd = [accelerate, "launch", "--multi_gpu", f"--num_processes={processes}", "--num_machines=1"]
    cmd += ["--mixed_precision=no", "--dynamo_backend=no", "-m", "tether", "train"]
    cmd += [
        *setting,
        f"train.steps={steps}",
        "eval.n_prompts=0",
        "eval.every=0",
        "eval.judge=none",
        "eval.fluency_model=none",
        "train.save_model=false",
        "train.checkpoint_every=0",
        "train.progress=false",
        f"train.output_dir={out}",
        *overrides,
    ]
    threads = max(1, (os.cpu_count() or 1) // processes)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_="131072")
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    training: dict[int, list[int]] = {}
    metrics = out / "metrics.jsonl"
    while p.poll() is None:
        stepping = metrics.exists()  # written after the first step: the model is sharded by then
        for pid in _descendants(p.pid):
            s = _status(pid)
            if s is None or not s["worker"]:
                continue
            peaks[pid] = max(peaks.get(pid, 0), s["hwm"])
            if stepping:
                training.setdefault(pid, []).append(s["rss"])
        time.sleep(0.05)
    log = p.stdout.read()
    if p.returncode != 0:
        raise SystemExit(f"{setting}: tether failed\n{log[-3000:]}")
    held = next((line for line in log.splitlines() if "sharded (FSDP)" in line), "")
    return {
        "peak": max(peaks.values()),
        "training": max(statistics.median(v) for v in training.values()) if training else float("nan"),
        "workers": len(peaks),
        "line": held,
        "rows": (rows := [json.loads(line) for line in metrics.read_text().splitlines()]),
        "step": statistics.median(r["time/step"] for r in rows),
    }


def bytes_per_parameter(processes: int, overrides: list[str]) -> dict[str, float]:
    """Model-state bytes each process keeps, per parameter of the policy, counted from the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tether.models.loading import resolve_model_path
    from tether.run.config import load_config

    cfg = load_config(None, list(overrides))
    path = resolve_model_path(cfg.model.name, cfg.model.revision)
    with __import__("torch").device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    total = sum(p.numel() for p in lm.parameters())
    layers = cfg.model.layers_to_train
    blocks = lm.model.layers
    last = blocks[len(blocks) - layers :] if layers is not None else []
    trainable = total if layers is None else sum(p.numel() for b in last for p in b.parameters())
    frozen = total - trainable
    # fp32 weights 4 B; a trained one adds its gradient (4 B) and AdamW's moments (8 B); reference 4 B
    state = 16 * trainable + 4 * frozen + 4 * total
    return {
        "params": total,
        "trainable": trainable,
        "none": state / total,
        "fsdp": state / total / processes,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    gib = 2**30
    counted = bytes_per_parameter(args.processes, args.overrides)
    print(
        f"policy {counted['params'] / 1e6:.1f}M parameters, {counted['trainable'] / 1e6:.1f}M trained; "
        f"{args.processes} processes, {args.steps} PPO steps"
    )
    settings = {
        "none": ["train.sharding=none"],
        "fsdp": ["train.sharding=fsdp"],
        "fsdp, whole": ["train.sharding=fsdp", "train.sharded_generation=whole"],
    }
    results = {}
    for name, setting in settings.items():
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(setting, args.processes, args.steps, args.overrides, Path(tmp) / "run")
        results[name] = r
        state = counted["none" if name == "none" else "fsdp"]
        print(
            f"  {' '.join(setting)}: peak RSS of the largest worker {r['peak'] / gib:.2f} GiB; "
            f"while training {r['training'] / gib:.2f} GiB; model state {state:.1f} bytes per "
            f"parameter per process (counted); median step {r['step']:.1f} s"
        )
        if r["line"]:
            print(f"    {r['line']}")
    a = results["none"]
    for name in ("fsdp", "fsdp, whole"):
        b = results[name]
        print(
            f"{name} / none: peak {b['peak'] / a['peak']:.2f}x, "
            f"while training {b['training'] / a['training']:.2f}x, "
            f"model state {counted['fsdp'] / counted['none']:.2f}x, step time {b['step'] / a['step']:.2f}x"
        )
    keys = ("objective/kl", "objective/scores", "response/length")
    for name, r in results.items():
        print(f"step 0, {name}: " + ", ".join(f"{k} {r['rows'][0].get(k)}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
