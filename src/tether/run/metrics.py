"""Run directory writers: metrics.jsonl, samples.jsonl and the printed sample table.

Metric names are namespaced (``objective/kl``, ``policy/clipfrac``); each is documented with its
unit in README.md ("Metrics").
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the fact visible
    return v


def _strict(v: Any) -> Any:
    """``v`` with every NaN or inf (at any depth) as None, so ``json.dumps`` writes valid JSON."""
    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    if hasattr(v, "item"):
        v = v.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


class RunWriter:
    """Appends one JSON row per step to ``metrics.jsonl`` and samples to ``samples.jsonl``."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.history: list[dict] = []
        self.lock: Path | None = None
        """The run folder's lock this process holds (:mod:`tether.run.lock`), or None."""

    def truncate_after(self, step: int) -> None:
        """Drop rows of steps after ``step`` from metrics, samples and warnings (on resume)."""
        for name in ("metrics.jsonl", "samples.jsonl", "warnings.jsonl"):
            path = self.run_dir / name
            if path.exists():
                rows = [line for line in path.read_text().splitlines() if line.strip()]
                keep = [line for line in rows if json.loads(line).get("step", -1) <= step]
                path.write_text("".join(line + "\n" for line in keep))
        self.history = [
            json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()
        ]

    def log(self, row: dict) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self.history.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def samples(self, step: int, rows: list[dict]) -> None:
        with self.samples_path.open("a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **{k: _clean(v) for k, v in r.items()}}) + "\n")

    def write_json(self, name: str, obj: dict) -> Path:
        """Write ``obj`` as JSON; a non-finite number at any depth becomes null (valid JSON)."""
        path = self.run_dir / name
        path.write_text(json.dumps(_strict(obj), indent=2))
        return path


def sample_table(rows: list[dict], width: int = 48) -> str:
    """Plain-text table ``prompt | response | score | kl | reward`` (lm-human-preference-details)."""

    def cut(s, n: int) -> str:
        if not isinstance(s, str):  # a conversation: its last message
            s = s[-1]["content"] if s and isinstance(s[-1], dict) else str(s)
        s = s.replace("\n", " ")
        return s if len(s) <= n else s[: n - 1] + "…"

    head = f"{'prompt':<24} | {'response':<{width}} | {'score':>6} | {'kl':>6} | {'reward':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{cut(r['prompt'], 24):<24} | {cut(r['response'], width):<{width}} | "
            f"{r['score']:6.3f} | {_kl_cell(r['kl'])} | {r['reward']:6.3f}"
        )
    return "\n".join(lines)


def _kl_cell(kl: float | None) -> str:
    return f"{kl:6.2f}" if kl is not None else f"{'-':>6}"  # None: no reference model, no KL
