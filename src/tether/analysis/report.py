"""``tether report RUN_DIR``: one self-contained HTML page of a run (images inlined as base64)."""

from __future__ import annotations

import base64
import errno
import html
import json
import os
from pathlib import Path

from tether.analysis.kl_tokens import FILE as KL_FILE
from tether.analysis.kl_tokens import probe_view, read_records, report_section
from tether.run.console import number
from tether.run.files import RunFileError, atomic_write_text, read_jsonl
from tether.run.folder import check_no_links
from tether.run.metrics import response_pieces


def _img(path: Path) -> str:
    if not path.exists():
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}" style="max-width:100%">'


def _rows(path: Path) -> list[dict]:
    return read_jsonl(path)  # a torn last line is dropped (and said so); a bad line names FILE:LINE


class _Html(str):
    """A table cell already escaped (:func:`marked_response`)."""


def marked_response(row: dict) -> str:
    """A samples.jsonl row's response as HTML, each text the environment wrote inside ``<mark>``
    (:func:`tether.run.metrics.response_pieces`: a chat row's tool messages, a raw row's ``env``
    texts); a single-turn row escaped as it is."""
    return _Html(
        "".join(
            f"<mark title='environment'>{html.escape(t)}</mark>" if env else html.escape(t)
            for t, env in response_pieces(row)
        )
    )


def shown_prompt(prompt) -> str:
    """A prompt as a reader sees it: a text as it is, a conversation one ``role: content`` line per
    message (not the Python repr of its dicts)."""
    if isinstance(prompt, list):
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict)
        )
    return str(prompt)


def _gain(ev: dict, key: str) -> str:
    """eval.json's change ``key`` with its SE (``gain`` with ``gain_se_paired``, ``x_change`` with
    ``x_change_se``): ``+0.137 ± 0.041``, ``n/a`` where there is none (no sample was scored)."""
    se = ev.get(f"{key}_se_paired" if key.endswith("gain") else f"{key}_se")  # a gain's SE is paired
    value = number(ev.get(key), "+.3f")
    return value if value == "n/a" or number(se) == "n/a" else f"{value} ± {number(se)}"


def _table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        if isinstance(v, _Html):
            return str(v)
        if v is None or isinstance(v, float):  # None: a NaN JSON saved as null (no scored sample)
            return number(v, ".4g")
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.html``: config, metric plots, the run's frontier point, warnings, samples.

    ``out``: where (default ``run_dir/report.html``); written whole, never through a link.

    Raises:
        FileNotFoundError: ``run_dir`` holds no ``metrics.jsonl``.
        tether.run.files.RunFolderError: ``run_dir`` holds a symbolic link (nothing is read).
        tether.run.files.RunFileError: ``out`` cannot be written (a read-only run folder); names
            ``--out``.
    """
    run = Path(run_dir)
    check_no_links(run, "tether report")  # a link could put a file from outside the run in the page
    if not (run / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{run} is not a tether run directory (no metrics.jsonl)")
    out = Path(out) if out else run / "report.html"
    metrics = _rows(run / "metrics.jsonl")
    if not metrics:
        raise ValueError(f"{run / 'metrics.jsonl'} holds no steps yet")
    samples = _rows(run / "samples.jsonl")
    warnings = _rows(run / "warnings.jsonl")
    ev = json.loads((run / "eval.json").read_text()) if (run / "eval.json").exists() else None
    config = (run / "config.yaml").read_text() if (run / "config.yaml").exists() else ""

    parts = [f"<h1>tether run {html.escape(run.name)}</h1>"]
    last = metrics[-1]
    parts.append(
        "<h2>Summary</h2>"
        + _table(
            [
                {
                    "steps": len(metrics),
                    "final score": last.get("objective/scores", ""),
                    "final KL (nats/seq)": last.get("objective/kl", ""),
                    "final exact KL": last.get("objective/kl_exact", ""),
                    "final beta": last.get("objective/kl_coef", ""),
                }
            ],
            ["steps", "final score", "final KL (nats/seq)", "final exact KL", "final beta"],
        )
    )
    if ev:
        pts = [
            {
                "model": k,
                "KL (nats/seq)": ev[k].get("kl", ""),
                "proxy": ev[k].get("proxy_mean", ""),
                "proxy SE": ev[k].get("proxy_se", ""),
                "gold": ev[k].get("gold_mean", ""),
                "gold SE": ev[k].get("gold_se", ""),
                "fluency NLL (nats/token)": ev[k].get("fluency_nll_mean", ""),
                "fluency SE": ev[k].get("fluency_nll_se", ""),
                "distinct-2": ev[k].get("distinct_2", ""),
                "self-BLEU": ev[k].get("self_bleu", ""),
                "repetition": ev[k].get("repetition", ""),
            }
            for k in ("reference", "policy")
        ]
        cols = ["model", "KL (nats/seq)", "proxy", "proxy SE", "gold", "gold SE"]
        cols += ["fluency NLL (nats/token)", "fluency SE", "distinct-2", "self-BLEU", "repetition"]
        parts.append(
            "<h2>Frontier point (held-out prompts)</h2>"
            + _table(pts, cols)
            + f"<p>proxy gain {_gain(ev, 'gain')}"
            + (f"; gold gain {_gain(ev, 'gold_gain')}" if "gold_gain" in ev else "")
            + "".join(
                f"; {label} {_gain(ev, f'{key}_change')}"
                for key, label in (
                    ("fluency_nll", "fluency NLL change"),
                    ("capability_nll", "capability NLL change"),
                    ("distinct_2", "distinct-2 change"),
                    ("repetition", "repetition change"),
                )
                if f"{key}_change" in ev
            )
            + "</p>"
        )
    parts.append("<h2>Metrics</h2>" + _img(run / "training.png") + _img(run / "score_vs_kl.png"))
    parts.append(
        "<h2>Health warnings</h2>"
        + (_table(warnings, ["rule", "step", "message", "cause", "fix"]) if warnings else "<p>none fired</p>")
    )
    steps = sorted({s["step"] for s in samples})
    if steps:
        picks = dict.fromkeys([steps[0], steps[len(steps) // 2], steps[-1]])
        parts.append("<h2>Samples (start, middle, end)</h2>")
        for st in picks:
            rows = [
                {**s, "prompt": shown_prompt(s["prompt"]), "response": marked_response(s)}
                for s in samples
                if s["step"] == st
            ][:8]
            cols = ["prompt", "response", "score", "gold", "kl", "reward"]
            if any("env" in r for r in rows):  # a multi-turn run: the environment's text is marked
                cols += ["policy_tokens", "env_tokens", "ended"]
            parts.append(f"<h3>step {st}</h3>" + _table(rows, cols))
    if (run / KL_FILE).is_file():  # kl.attribution: where the KL went, the tokens shaded by their KL
        parts.append(report_section(read_records(run)))
    probe = probe_view(ev) if isinstance(ev, dict) else ""
    if probe:
        parts.append(f"<h3>Human text whose log-probability fell most</h3><pre>{html.escape(probe)}</pre>")
    parts.append(f"<h2>Config</h2><pre>{html.escape(config)}</pre>")
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:auto}table{border-collapse:collapse;"
        "margin:8px 0}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:left;"
        "white-space:pre-wrap}mark{background:#ffe08a}"
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>tether {html.escape(run.name)}"
        f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>"
    )
    try:
        atomic_write_text(out, page)
    except OSError as e:  # a read-only run folder (a shared or archived run): write it elsewhere
        code = e.errno or errno.EIO
        raise RunFileError(
            code,
            f"tether report: cannot write {out} ({os.strerror(code)}); nothing was written. Write the "
            f"report elsewhere: tether report {run} --out FILE.html",
        ) from None
    return out
