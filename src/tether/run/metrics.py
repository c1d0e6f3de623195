"""Run directory writers: metrics.jsonl, samples.jsonl and the printed sample table.

Metric names are namespaced (``objective/kl``, ``policy/clipfrac``); each is documented with its
unit in docs/metrics.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tether.core.kl import sequence_kl
from tether.core.masked import masked_sum
from tether.run.config import Config
from tether.run.files import (
    append_lines,
    atomic_write_text,
    read_jsonl,
    remove_stale_temporaries,
    rewrite_jsonl,
)


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
        self.run_id: str | None = None
        """The run's id (:func:`tether.run.files.run_id`) that its checkpoints record; None on ranks
        other than 0."""

    def truncate_after(self, step: int) -> None:
        """Drop rows of steps after ``step`` from metrics, samples, warnings and the KL's token
        records (on resume).

        Each file is rewritten whole (:func:`tether.run.files.rewrite_jsonl`: a kill leaves the old
        file or the new one) and only when a row goes; a torn last line is dropped (and said so).

        Raises:
            ValueError: a line other than the last is not JSON (names ``FILE:LINE``).
            tether.run.files.RunFileError: the disk is full; every file is as it was.
        """
        remove_stale_temporaries(self.run_dir)  # a killed rewrite's (the files themselves are whole)
        for name in ("metrics.jsonl", "samples.jsonl", "warnings.jsonl", "kl_tokens.jsonl"):
            path = self.run_dir / name
            if not path.exists():
                continue
            rows = read_jsonl(path)
            keep = [r for r in rows if r.get("step", -1) <= step]
            torn = path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
            if len(keep) < len(rows) or torn:
                rewrite_jsonl(path, keep)
        self.history = read_jsonl(self.metrics_path)

    def log(self, row: dict) -> None:
        """Append ``row`` to metrics.jsonl (whole or not at all: :func:`tether.run.files.append_lines`).

        Raises:
            tether.run.files.RunFileError: the disk is full or a file-size limit was reached; names
                the file, and the row is not in :attr:`history` either.
        """
        row = {k: _clean(v) for k, v in row.items()}
        append_lines(self.metrics_path, [json.dumps(row)])
        self.history.append(row)

    def samples(self, step: int, rows: list[dict]) -> None:
        """Append ``rows`` to samples.jsonl, all of them or none (:func:`append_lines`)."""
        lines = [json.dumps({"step": step, **{k: _clean(v) for k, v in r.items()}}) for r in rows]
        append_lines(self.samples_path, lines)

    def kl_tokens(self, record: dict) -> None:
        """Append a step's KL attribution record (:mod:`tether.trainers.kl_tokens`, with its
        ``step``) to kl_tokens.jsonl, whole or not at all (:func:`append_lines`)."""
        append_lines(self.run_dir / "kl_tokens.jsonl", [json.dumps(_strict(record))])

    def write_json(self, name: str, obj: dict) -> Path:
        """Write ``obj`` as JSON, replacing the file whole (:func:`atomic_write_text`); a non-finite
        number at any depth becomes null (valid JSON)."""
        path = self.run_dir / name
        atomic_write_text(path, json.dumps(_strict(obj), indent=2))
        return path


def response_pieces(row: dict) -> list[tuple[str, bool]]:
    """A sample row's response as ``(text, by_the_environment)`` pieces that join to it: a chat
    row's messages (the assistant's contents and the tools', one per line, as ``response`` joins
    them); a raw row's ``env`` texts where ``env_at`` says they start (a row without it: found in
    order, the first match); a single-turn row's response, one piece."""
    if isinstance(row.get("messages"), list) and all(isinstance(m, dict) for m in row["messages"]):
        pieces: list[tuple[str, bool]] = []
        for i, m in enumerate(row["messages"]):
            pieces += [("\n", False)] if i else []
            pieces.append((str(m.get("content", "")), m.get("role") != "assistant"))
        return pieces
    text, pieces, at = str(row.get("response", "")), [], 0
    env = row.get("env")  # a hand-edited samples.jsonl may hold anything: only texts are marked
    replies = [r for r in env if isinstance(r, str)] if isinstance(env, list) else []
    starts = row.get("env_at")
    if not (isinstance(starts, list) and len(starts) == len(replies)):
        starts = [None] * len(replies)  # not recorded: searched in order (the first match)
    for reply, start in zip(replies, starts):  # the environment's texts, in order
        exact = isinstance(start, int) and start >= at and text[start : start + len(reply)] == reply
        i = start if exact else text.find(reply, at) if reply else -1
        if i < 0:
            continue
        pieces += [(text[at:i], False), (reply, True)]
        at = i + len(reply)
    return [p for p in pieces + [(text[at:], False)] if p[0]]


def marked_response(row: dict) -> str:
    """A sample row's response with what the environment wrote in ``⟦ ⟧``
    (:func:`response_pieces`), so a reader tells a tool's answer from the policy's text."""
    return "".join(f"⟦{t}⟧" if env else t for t, env in response_pieces(row))


def sample_table(rows: list[dict], width: int = 48) -> str:
    """Plain-text table ``prompt | response | score | kl | reward`` (lm-human-preference-details).
    A long prompt shows its end (what the response continues: the question after a few-shot
    prefix), a long response its start; what an environment wrote is in ``⟦ ⟧``
    (:func:`marked_response`)."""

    def cut(s, n: int, end: bool = False) -> str:
        if not isinstance(s, str):  # a conversation: its last message
            s = s[-1]["content"] if s and isinstance(s[-1], dict) else str(s)
        s = s.replace("\n", " ")
        if len(s) <= n:
            return s
        return "…" + s[len(s) - n + 1 :] if end else s[: n - 1] + "…"

    head = f"{'prompt':<24} | {'response':<{width}} | {'score':>6} | {'kl':>6} | {'reward':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{cut(r['prompt'], 24, end=True):<24} | {cut(marked_response(r), width):<{width}} | "
            f"{_number_cell(r['score'], 3)} | {_kl_cell(r['kl'])} | {_number_cell(r['reward'], 3)}"
        )
    return "\n".join(lines)


def _number_cell(x: float | None, digits: int) -> str:
    return f"{x:6.{digits}f}" if x is not None else f"{'-':>6}"  # None: not scored, no number


def _kl_cell(kl: float | None) -> str:
    return _number_cell(kl, 2)  # None: no reference model, no KL


def flat_config(c: Config) -> dict:
    """The config as ``section.field`` -> bool, int, float, str (lists and None as text), what
    trackers take as hyperparameters."""
    flat = {}
    for section, fields in c.to_dict().items():
        for name, v in fields.items():
            flat[f"{section}.{name}"] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return flat


SAMPLE_COLUMNS = ("prompt", "response", "score", "kl", "reward", "gold")


def log_sample_table(accelerator, step: int, rows: list[dict]) -> None:
    """The step's samples to every tracker of ``accelerator`` (the run's, or None) that takes
    tables (wandb, clearml, a custom one with ``log_table``)."""
    if accelerator is None or not accelerator.log_with:
        return
    columns = [k for k in SAMPLE_COLUMNS if k in rows[0]]
    plain = (int, float, str, type(None))
    data = [[r[k] if isinstance(r[k], plain) else json.dumps(r[k]) for k in columns] for r in rows]
    for tracker in accelerator.trackers:
        if hasattr(tracker, "log_table"):
            tracker.log_table("samples", columns=columns, data=data, step=step)


def sample_rows(exp) -> list[dict]:
    """One dict per sample: prompt, response, score, kl (the estimator's, nats/seq) and reward
    (the shaped rewards summed: score - beta * kl; with ppo.kl_shaping=exact the exact KL's sum
    in place of kl, the per-token corrections not included), and completion_ids (the sampled
    token ids, for the gold judge: :func:`_log_step` takes them out before writing)."""
    mask = exp.rollout.response_mask
    kl_seq = (
        sequence_kl(exp.kl, mask).tolist() if exp.kl is not None else [None] * len(mask)
    )  # None: no reference
    rew_seq = masked_sum(exp.rewards, mask, dim=-1)
    rows = [
        # score and reward None: no reward scored the sample (it left the step's statistics)
        {
            "prompt": p,
            "response": r,
            "score": None if s != s else float(s),
            "kl": k,
            "reward": None if s != s else float(rw),
        }
        for p, r, s, k, rw in zip(exp.rollout.prompts, exp.rollout.responses, exp.scores, kl_seq, rew_seq)
    ]
    for i, row in enumerate(rows):  # the row's other dataset columns travel with it
        if exp.rollout.columns:
            row["columns"] = {k: v[i] for k, v in exp.rollout.columns.items()}
        row |= exp.rollout.turn_row(i)  # a multi-turn sample: what the environment wrote, its messages
    for row, ids in zip(rows, exp.rollout.completion_ids):  # the gold judge's; not written
        row["completion_ids"] = ids
    return rows
