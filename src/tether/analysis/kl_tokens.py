"""Reading a run's KL attribution (``kl_tokens.jsonl``, :mod:`tether.trainers.kl_tokens`):
``tether kl RUN [--step N]`` on the console, and the report's section with each listed
response's tokens shaded by their exact KL.

Records are read as data (JSON, never executed), through no symbolic link; a torn or non-JSON
line is refused with the file and line (:func:`tether.run.files.read_jsonl`), and a field that is
missing or of another type (a hand-edited file) shows as ``n/a`` or is left out.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from tether.run.files import read_jsonl
from tether.run.folder import check_no_links

FILE = "kl_tokens.jsonl"


def read_records(run_dir: str | Path) -> list[dict]:
    """The run's records, in step order (a resumed run's rewritten file keeps one per step).

    Raises:
        FileNotFoundError: the run folder holds no kl_tokens.jsonl (names how to get one).
        ValueError: a line other than the last is not JSON (names ``FILE:LINE``).
    """
    run = Path(run_dir)
    if not run.is_dir() or not (run / "config.yaml").is_file():
        raise ValueError(
            f"{run} is not a tether run folder (no config.yaml there): give the folder a run wrote "
            "(train.output_dir, under runs/ by default)"
        )
    check_no_links(run, "tether kl")  # a link could show a file from outside the run
    path = run / FILE
    off = _attribution_off(run)
    if off and not path.exists():
        raise FileNotFoundError(f"{run} ran with {off}: it wrote no KL records (kl_tokens.jsonl)")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a file (tether writes kl_tokens.jsonl as one)")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: a run writes it on a jump of its KL (kl.tokens_jump), on the step "
            "that crosses kl.budget, or every kl.tokens_every steps (set kl.tokens_every=1 for every "
            "step; it needs kl.exact and kl.attribution, both on by default)"
        )
    return [r for r in read_jsonl(path) if isinstance(r, dict) and isinstance(r.get("step"), int)]


def _attribution_off(run: Path) -> str:
    """Why the run's config turned the attribution off ("kl.attribution=false", "kl.exact=false"),
    or "" (on, or the config unreadable: the file's absence then says enough)."""
    import yaml

    from tether.run.config import read_yaml

    path = run / "config.yaml"
    try:
        kl = (read_yaml(path.read_text(), str(path)) or {}).get("kl") or {}
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return ""
    if not isinstance(kl, dict):
        return ""
    return (
        "kl.attribution=false"
        if kl.get("attribution") is False
        else "kl.exact=false"
        if kl.get("exact") is False
        else ""
    )


def _finite(v) -> float | None:
    """``v`` as a finite float, or None (not a number, a bool, NaN, infinite, or an integer too
    large for a float: a hand-edited file may hold any JSON)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _text(v) -> str:
    """A scalar field as text ("" for anything else)."""
    return "" if isinstance(v, (dict, list)) or v is None else str(v)


def _dicts(v) -> list[dict]:
    """The dict items of a list field (none for anything else)."""
    return [e for e in v if isinstance(e, dict)] if isinstance(v, list) else []


def rise(record: dict) -> float:
    """The record's rise of the KL reading from the previous step (-inf where unknown)."""
    kl, prev = _finite(record.get("kl")), _finite(record.get("previous_kl"))
    return -math.inf if kl is None or prev is None else kl - prev


def chosen(records: list[dict], step: int | None = None) -> dict:
    """Step ``step``'s record, or without one the record of the largest rise of the KL.

    Raises:
        ValueError: no record, or none of step ``step`` (names the steps there are).
    """
    if not records:
        raise ValueError(f"{FILE} holds no record")
    if step is None:
        return max(records, key=lambda r: (rise(r), r["step"]))
    for r in records:
        if r["step"] == step:
            return r
    steps = ", ".join(str(r["step"]) for r in records)
    raise ValueError(f"{FILE} has no record of step {step}; its steps: {steps}")


def _num(v, fmt: str = ".4f") -> str:
    f = _finite(v)
    return "n/a" if f is None else format(f, fmt)


def _tops(entry: dict, who: str, k: int = 3) -> str:
    tops = entry.get(f"{who}_top")
    pairs = [t for t in tops if isinstance(t, list) and len(t) == 2] if isinstance(tops, list) else []
    return " ".join(f"{_text(t)!r}:{_num(p, '.2g')}" for t, p in pairs[:k])


def console_view(record: dict) -> str:
    """The record as a console table: the step's KL and why it was written, the top positions
    (token, exact KL, k1, both models' top-3 next tokens, whether the sampler disagreed), the KL by
    token id, and the ids that carried the rise."""
    share = _finite(record.get("top_share"))
    carried = "n/a" if share is None else f"{100 * share:.1f}%"
    lines = [
        f"step {_text(record.get('step'))}: KL {_num(record.get('kl'))} "
        f"(previous step {_num(record.get('previous_kl'))}), written on: {_text(record.get('reason'))}; "
        f"the batch's summed exact KL {_num(record.get('kl_sum'))} nats, the listed positions carry "
        f"{carried} of it",
        "",
        f"{'#':>3} {'row':>4} {'pos':>4} {'token':<14} {'KL':>8} {'k1':>8}  "
        "policy top-3 | reference top-3   context",
    ]
    for i, e in enumerate(_dicts(record.get("positions"))):
        flag = "  MISALIGNED (sampler != learner)" if e.get("misaligned") is True else ""
        context = _text(e.get("context"))[-40:].replace("\n", "\\n")
        lines.append(
            f"{i + 1:>3} {_text(e.get('row')):>4} {_text(e.get('position')):>4} "
            f"{_text(e.get('token'))!r:<14} "
            f"{_num(e.get('kl')):>8} {_num(e.get('k1')):>8}  "
            f"{_tops(e, 'policy')} | {_tops(e, 'reference')}   ...{context!r}{flag}"
        )
    lines += [
        "",
        "KL by token id (summed over the batch):",
        f"{'id':>7} {'token':<16} {'KL':>9} {'count':>6} {'share':>7}",
    ]
    for t in _dicts(record.get("by_token_id")):
        share = _finite(t.get("share"))
        lines.append(
            f"{_text(t.get('id')):>7} {_text(t.get('token'))!r:<16} {_num(t.get('kl')):>9} "
            f"{_text(t.get('count')):>6} {'n/a' if share is None else format(100 * share, '.1f') + '%':>7}"
        )
    r = record.get("rise")
    if isinstance(r, dict):
        explained = _finite(r.get("explained"))
        listed = _dicts(r.get("by_token_id"))
        lines += [
            "",
            f"the summed KL rose {_num(r.get('kl_sum'))} nats from the previous step; the {len(listed)} ids "
            "below carry "
            + ("it (no rise to explain)" if explained is None else f"{100 * explained:.0f}% of that rise")
            + (" (more than all of it: other ids fell)" if explained is not None and explained > 1 else ""),
        ]
        for t in listed:
            lines.append(
                f"{_text(t.get('id')):>7} {_text(t.get('token'))!r:<16} {_num(t.get('rise'), '+.4f'):>9}"
            )
    return "\n".join(lines)


def heat_html(tokens: list) -> str:
    """A response's tokens ``[[text, kl or None], ...]`` as HTML, each policy token shaded by its
    exact KL relative to the response's largest (title: the KL in nats); a token with None (an
    environment's, padding) unshaded."""
    pairs = [t for t in tokens if isinstance(t, list) and len(t) == 2] if isinstance(tokens, list) else []
    kls = [f for f in (_finite(t[1]) for t in pairs) if f is not None]
    top = max([k for k in kls if k > 0], default=0.0)
    out = []
    for t in pairs:
        text, kl = html.escape(_text(t[0])), _finite(t[1])
        if kl is not None and top > 0:
            alpha = max(0.0, min(1.0, kl / top))
            out.append(
                f"<span title='{kl:.4g} nats' style='background: rgba(220,40,40,{alpha:.2f})'>{text}</span>"
            )
        else:
            out.append(text)
    return "".join(out)


def report_section(records: list[dict], most: int = 3) -> str:
    """The report's "Where the KL went" section: the ``most`` records of largest rise, each with
    its top positions and the listed responses shaded by their tokens' KL."""
    if not records:
        return ""
    parts = [
        "<h2>Where the KL went (kl_tokens.jsonl)</h2><p>The steps of the largest rises of the KL. Each "
        "listed response is shaded by its tokens' exact KL relative to its own largest token (hover: "
        "the KL in nats); unshaded text is not the policy's (a tool's reply).</p>"
    ]
    for record in sorted(records, key=lambda r: -rise(r))[:most]:
        parts.append(f"<h3>step {record['step']} ({html.escape(_text(record.get('reason')))})</h3>")
        parts.append(f"<pre>{html.escape(console_view(record))}</pre>")
        responses = record.get("responses")
        for row, tokens in responses.items() if isinstance(responses, dict) else []:
            parts.append(f"<p>row {html.escape(_text(row))}: {heat_html(tokens)}</p>")
    return "".join(parts)


def probe_view(evaluation: dict, most: int = 10) -> str:
    """eval.json's ``capability_fallen`` as a console table: the capability probe's tokens of human
    text whose log-probability fell most from the reference to the final policy ("" without it)."""
    fallen = _dicts(evaluation.get("capability_fallen"))
    if not fallen:
        return ""
    lines = [
        "capability probe (eval/capability_nll): the tokens of human text whose log-prob fell most",
        f"{'fall':>8} {'policy':>8} {'ref':>8}  token            context",
    ]
    for f in fallen[:most]:
        context = _text(f.get("context"))[-50:]
        lines.append(
            f"{_num(f.get('fall'), '+.3f'):>8} {_num(f.get('logprob'), '.3f'):>8} "
            f"{_num(f.get('ref_logprob'), '.3f'):>8}  {_text(f.get('token'))!r:<16} ...{context!r}"
        )
    return "\n".join(lines)
