"""How fast each bad input is refused on an empty cache, and that nothing was written or fitted.

Each case runs ``tether train`` in a fresh process with ``HOME``, ``HF_HOME`` and ``TETHER_CACHE``
in a new temporary folder (an empty cache: no cached SmolLM2, no fitted judge, no downloaded
prompts) on the embedded default, whose gold judge is the MiniLM reward model fitted on first
use (~2 min). Prints, per case: seconds to the refusal, the exit code, whether the run folder
was left behind, whether anything reached the cache, and the error's last line.

    python benchmarks/fail_fast.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "wrong model.name": ["model.name=/no/such/model"],
    "uncached Hub dataset (offline)": ["data.prompts=nobody/no-such-dataset"],
    "missing column": ["data.prompts={prompts}", "reward.scorer=fail_fast_rewards:needs_answer"],
    "uninstalled tracker": ["train.report_to=wandb"],
    "train.device=cuda on a CPU machine": ["train.device=cuda"],
    "scorer that does not import": ["reward.scorer=no_such_module:score"],
    "output folder holds a run": ["train.output_dir={busy}"],
}


def main() -> int:
    rows = []
    for name, args in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            prompts = home / "prompts.txt"
            prompts.write_text("".join(f"the movie number {i} was\n" for i in range(40)))
            (home / "fail_fast_rewards.py").write_text(
                "def needs_answer(completions, answer, **kw):\n    return [0.0 for _ in completions]\n"
            )
            busy = home / "busy"
            busy.mkdir()
            (busy / "config.yaml").write_text("train: {}\n")
            out = home / "run"
            env = {
                **os.environ,
                "HOME": str(home),
                "HF_HOME": str(home / "hf"),
                "TETHER_CACHE": str(home / "cache"),
                "HF_HUB_OFFLINE": "1",
            }
            given = [a.format(prompts=prompts, busy=busy) for a in args]
            if not any(a.startswith("train.output_dir=") for a in given):
                given.append(f"train.output_dir={out}")
            t0 = time.perf_counter()
            p = subprocess.run(
                [sys.executable, "-m", "tether", "train", "train.progress=false", *given],
                cwd=home,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            seconds = time.perf_counter() - t0
            cache = home / "cache"
            cached = sorted(str(x.relative_to(cache)) for x in cache.rglob("*")) if cache.exists() else []
            last = (p.stderr.strip().splitlines() or [""])[-1]
            rows.append((name, seconds, p.returncode, out.exists(), cached, last))
    print("| bad input | seconds | exit | run folder left | cache written | error |")
    print("|---|---|---|---|---|---|")
    for name, seconds, rc, left, cached, last in rows:
        print(f"| {name} | {seconds:.1f} | {rc} | {left} | {cached or 'nothing'} | {last[:160]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
