"""The model card (``README.md``) of a saved policy: what it is, how it was leashed, what it gained.

Written into ``<run>/policy`` at the end of a run (beside the weights, the tokenizer and copies of
the run's two plots), so that the folder explains itself on disk and on the Hub (``tether push``).
Everything in it is read from the run's own records (config, metrics rows, ``eval.json``); the
metadata block is ``huggingface_hub``'s ``ModelCardData``.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

from tether.core.controllers import CONTROLLERS
from tether.models.loading import is_hub_id
from tether.run.config import TRAINER_DEFAULTS
from tether.run.console import number
from tether.run.files import replace_whole

PLOTS = ("training.png", "score_vs_kl.png")
"""The run's plots the card shows; copied into the policy folder."""


def _pm(value: float | None, se: float | None = None, digits: int = 3) -> str:
    """``+0.137 ± 0.041`` (a value with its standard error), or ``n/a``."""
    if number(value) == "n/a" or not math.isfinite(value):
        return "n/a"
    text = f"{value:+.{digits}f}"
    if number(se) != "n/a" and math.isfinite(se):
        text += f" ± {se:.{digits}f}"
    return text


def _md(text) -> str:
    """``text`` (a run name: a user's) as plain text in Markdown: ``<``, ``>`` and ``&`` as HTML
    entities, the characters that start inline markup (emphasis, code, links, images, table cells,
    a heading's closing ``#``, math) escaped with a backslash, a line break or control character
    as a space; so it renders as it is written and adds no HTML, link or line to the card."""
    entities = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}
    return re.sub(
        r"[<>&\\`*_\[\]!|#~$]|[\x00-\x1f\x7f]",
        lambda c: entities.get(c[0]) or (" " if c[0] < " " or c[0] == "\x7f" else "\\" + c[0]),
        str(text),
    )


def _code(text) -> str:
    """``text`` (a user's: a path, a scorer's name) as a code span in a Markdown table cell: fenced
    by more backticks than it holds in a row, ``|`` escaped (GFM splits a row's cells before it
    reads code spans), a line break or control character as a space."""
    text = re.sub(r"[\x00-\x1f\x7f]", " ", str(text)).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _beta_path(history: list[dict]) -> str:
    betas = [r["objective/kl_coef"] for r in history if number(r.get("objective/kl_coef")) != "n/a"]
    if not betas:
        return "not logged"
    lo, hi = min(betas), max(betas)
    return f"{betas[0]:.4g} at step 0, {lo:.4g} to {hi:.4g} over the run, {betas[-1]:.4g} at the end"


def _guard_row(k: dict, history: list[dict]) -> str:
    """The card's row of the update guard (kl.guard): what it guarantees, and how often it acted;
    "" when off."""
    cuts = [r for r in history if isinstance(r.get("guard/fraction"), (int, float))]
    if not k.get("guard") or not cuts:
        return ""
    unit = k.get("target_unit", "nats_per_sequence").replace("_", " ")
    ceiling = k["budget"] * (1 + k.get("guard_tol", 0.0))
    acted = sum(r["guard/fraction"] < 1 for r in cuts)
    restored = sum(r["guard/fraction"] == 0 for r in cuts)
    return (
        f"| update guard | each update kept only where its exact KL at its own batch's prefixes, plus "
        f"{k.get('guard_z', 0.0):g} standard errors of the next batch's reading (sqrt(2) x the batch "
        f"mean's), stays under {ceiling:g} {unit} (kl.budget x (1 + kl.guard_tol)); it cut "
        f"{acted} of {len(cuts)} updates, {restored} of them whole. Not bounded: the KL on other prompts; "
        "a next batch past the ceiling stays possible (about one step in 44 at the bound: "
        "docs/kl.md, 'The update guard') |"
    )


def _anchor_row(a: dict, last: dict) -> str:
    """The text anchor's row (``anchor.coef > 0`` or ``anchor.budget``): its kind, weight (or
    budget and last weight) and text, and its last forward KL."""
    kind = "forward KL KL(pi_ref || pi)" if a.get("kind", "forward_kl") == "forward_kl" else "ptx NLL"
    weight = f"`anchor.coef={a.get('coef', 0):g}`"
    if a.get("budget") is not None:
        weight = (
            f"a weight held to `anchor.budget={a['budget']:g}` nats per token (its dual from `anchor.coef="
            f"{a.get('coef', 0):g}`; its mean over the last step's optimizer steps "
            f"{number(last.get('anchor/coef'))})"
        )
    return (
        f"| text anchor | {weight} x the exact {kind} on human text "
        f"({_code(a.get('texts', 'builtin'))}); at the last step {number(last.get('anchor/forward_kl'))} "
        "nats per token of forward KL |"
    )


def model_card_text(
    *,
    config: dict,
    history: list[dict],
    evaluation: dict | None,
    adapter: bool,
    repo_id: str | None = None,
    name: str | None = None,
    no_evaluation: str | None = None,
    value_head: bool = False,
    versions: dict[str, str] | None = None,
) -> str:
    """The model card's Markdown, YAML metadata first (the Hub's: base model, the Hub datasets
    trained on, library, tags).

    Args:
        config: the run's config as ``Config.to_dict()`` gives it (sections of fields).
        history: the rows of ``metrics.jsonl``.
        evaluation: ``eval.json`` (the final held-out evaluation), or None when there was none.
        adapter: the policy folder holds a LoRA adapter (peft) rather than whole weights.
        repo_id: the Hub repository the card is for, in the loading example (None: a local path).
        name: the title's run name (None: ``train.run_name``).
        no_evaluation: what the card says when ``evaluation`` is None (default: none was run,
            eval.n_prompts=0).
        value_head: the folder holds ``value_head.safetensors`` (PPO's critic), said in the card.
        versions: package -> version, the card's "Framework versions" (None: :func:`versions`).
    """
    from huggingface_hub import ModelCardData

    m, t, k, d, r = (config[s] for s in ("model", "train", "kl", "data", "reward"))
    algo = t["algo"]
    base = m["name"]
    meta = ModelCardData(
        base_model=base if is_hub_id(base) else None,
        datasets=hub_datasets(config) or None,
        library_name="peft" if adapter else "transformers",
        tags=["tether", "rlhf", algo, "kl-regularized"],
        pipeline_tag="text-generation",
    )
    placement = "in the reward (shaping, per token)" if k.get("kl_in_reward") else "in the loss"
    if k.get("kl_in_reward") and k.get("kl_in_loss"):
        placement = "in the reward and in the loss (allowed by kl.allow_double_kl)"
    estimator = k["estimator"] + (f"; loss surrogate {k['loss_estimator']}" if k.get("kl_in_loss") else "")
    kl_row = f"| KL placement | {placement}; per-token estimator {estimator} |"
    divergence = k.get("divergence", "reverse_kl")
    if divergence != "reverse_kl":  # kl.divergence: another divergence held in the loss, exactly
        order = f" of order {k.get('alpha', 0.5):g}" if divergence == "alpha" else ""
        kl_row = (
            f"| KL placement | in the loss: `kl.divergence={divergence}`{order}, exact over the vocabulary "
            "at each sampled position (the reverse KL still measured and logged) |"
        )
    controller = CONTROLLERS[k["controller"]].from_fields(k["kl_coef"], k)
    unit = k.get("target_unit", "nats_per_sequence").replace("_", " ")
    leash_row = f"| leash | `kl.controller={k['controller']}`, {controller.describe(unit)} |"
    beta_row = f"| beta's path | {_beta_path(history)} |"
    guard_row = _guard_row(k, history)
    if TRAINER_DEFAULTS[algo].placement is None:  # no KL term: DPO's beta is the implicit KL coefficient
        kl_row = (
            "| KL placement | implicit, in DPO's loss (Rafailov et al. 2023, eq. 7); the KL is measured, "
            f"not penalized: per-sequence {k['estimator']} on the policy's samples of held-out prompts |"
        )
        leash_row = f"| leash | `dpo.beta={config['dpo']['beta']:g}` (fixed) |"
        beta_row = ""
    steps_run = len(history)
    last = history[-1] if history else {}
    lines = [
        "---",
        meta.to_yaml(),
        "---",
        "",
        f"# {_md(name or t.get('run_name') or 'tether policy')}: {algo.upper()} on a KL leash",
        "",
        f"Fine-tuned with tether ({algo.upper()}), which keeps the policy on a "
        "KL leash to its frozen reference: the objective is `E[r(x, y)] - beta KL(pi || pi_ref)`, "
        "KL in nats.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {_code(base)}"
        + (f" at revision {_code(m['revision'])}" if m.get("revision") else "")
        + " |",
        f"| data | {_code(d['prompts'])} (split {_code(d['split'])})"
        + (
            f", held out: {_code(d['eval_prompts'])}"
            if d.get("eval_prompts")
            else f", held out: a {d['heldout_fraction']:g} hash share"
        )
        + " |",
        f"| reward | {_code(r['scorer'])}" + (f", weights {r['weights']}" if r.get("weights") else "") + " |",
        f"| trainer | {algo}: {steps_run} steps run (train.steps={t['steps']}), "
        f"{config['rollout']['batch_size']} samples each, seed {t['seed']} |",
        kl_row,
        leash_row,
        *([beta_row] if beta_row else []),
        *([guard_row] if guard_row else []),
        *(
            [_anchor_row(config.get("anchor") or {}, last)]
            if (config.get("anchor") or {}).get("coef")
            or (config.get("anchor") or {}).get("budget") is not None
            else []
        ),
        f"| KL at the last step | {number(last.get('objective/kl'))} nats per sequence "
        "(on the policy's own samples) |",
        f"| LoRA | {'yes, this folder is the adapter' if adapter else 'no, whole weights'} |",
        "",
    ]
    if evaluation:
        ref, pol = evaluation["reference"], evaluation["policy"]
        lines += [
            "## Held-out results",
            "",
            f"{evaluation['n_prompts']} held-out prompts x {evaluation['samples_per_prompt']} samples, "
            f"never trained on; the policy of step {evaluation.get('policy_step', '?')} against the "
            "reference on the same prompts and seeds "
            "(paired standard errors).",
            "",
            "| measure | reference | policy | change |",
            "|---|---|---|---|",
            f"| reward (proxy) | {number(ref.get('proxy_mean'))} | {number(pol.get('proxy_mean'))} | "
            f"{_pm(evaluation.get('gain'), evaluation.get('gain_se_paired'))} |",
        ]
        if "gold_gain" in evaluation:
            lines.append(
                f"| gold judge | {number(ref.get('gold_mean'))} | "
                f"{number(pol.get('gold_mean'))} | "
                f"{_pm(evaluation['gold_gain'], evaluation.get('gold_gain_se_paired'))} |"
            )
        lines.append(f"| held-out KL (nats per sequence) | 0 | {number(pol.get('kl'))} | |")
        lines += [
            "",
            "### What the leash protects",
            "",
            "| measure | reference | policy | change |",
            "|---|---|---|---|",
        ]
        for key, name in (
            ("fluency_nll", "fluency NLL (nats per token)"),
            ("distinct_2", "distinct-2"),
            ("self_bleu", "self-BLEU"),
            ("repetition", "repetition"),
        ):
            mean = "fluency_nll_mean" if key == "fluency_nll" else key
            if mean in pol and f"{key}_change" in evaluation:
                lines.append(
                    f"| {name} | {number(ref.get(mean))} | {number(pol.get(mean))} | "
                    f"{_pm(evaluation[f'{key}_change'], evaluation.get(f'{key}_change_se'))} |"
                )
        if "capability_nll" in evaluation:
            change = _pm(evaluation.get("capability_nll_change"), evaluation.get("capability_nll_change_se"))
            lines.append(
                f"| capability NLL ({evaluation.get('capability_texts', '?')} human sentences) | "
                f"{number(evaluation.get('ref_capability_nll'))} | {number(evaluation['capability_nll'])} | "
                f"{change} |"
            )
        lines.append("")
    else:
        said = no_evaluation or "No final held-out evaluation was run (eval.n_prompts=0)."
        lines += ["## Held-out results", "", said, ""]
    lines += ["## Plots", "", "![training](training.png)", "", "![reward against KL](score_vs_kl.png)", ""]
    where = repo_id or "PATH/TO/policy"
    if adapter:
        load = [
            "```python",
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{where}")  # the base of adapter_config.json',
            f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
            "```",
        ]
    else:
        load = [
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{where}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
            "```",
        ]
    lines += [
        "## How to load it",
        "",
        *load,
        "",
        *(
            ["`value_head.safetensors` holds tether's value head (PPO), which generation does not use.", ""]
            if value_head
            else []
        ),
        "## Framework versions",
        "",
        *(
            f"- {pkg}: {ver}"
            for pkg, ver in (versions if versions is not None else framework_versions()).items()
        ),
        "",
    ]
    return "\n".join(lines)


def hub_datasets(config: dict) -> list[str]:
    """The Hub dataset ids the run read (``data.prompts``, ``data.eval_prompts``, ``dpo.pairs``),
    for the card's ``datasets``: what ``is_hub_id`` takes for an id and is no local path."""
    d = config["data"]
    specs = [d.get("prompts"), d.get("eval_prompts"), (config.get("dpo") or {}).get("pairs")]
    out: list[str] = []
    for s in specs:
        if isinstance(s, str) and is_hub_id(s) and not Path(s).exists() and s not in out:
            out.append(s)
    return out


def framework_versions() -> dict[str, str]:
    """The versions of the packages that made the policy (TRL's cards list theirs too)."""
    from importlib.metadata import PackageNotFoundError, version

    import tether

    out = {"tether": tether.__version__}
    for pkg in ("transformers", "torch", "accelerate", "peft", "datasets", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def write_model_card(
    folder: Path,
    *,
    run_dir: Path,
    config: dict,
    history: list[dict],
    evaluation: dict | None,
    no_evaluation: str | None = None,
) -> Path:
    """Write ``folder/README.md`` and copy the run's plots beside it; returns the card's path
    (``no_evaluation``: :func:`model_card_text`'s).

    Raises:
        OSError: a write failed (the caller names what is kept).
    """
    folder = Path(folder)
    adapter = (folder / "adapter_config.json").exists()
    value_head = (folder / "value_head.safetensors").exists()
    name = config["train"].get("run_name") or Path(run_dir).name
    text = model_card_text(
        config=config,
        history=history,
        evaluation=evaluation,
        adapter=adapter,
        name=name,
        no_evaluation=no_evaluation,
        value_head=value_head,
    )
    for name in PLOTS:
        if (Path(run_dir) / name).exists():
            shutil.copyfile(Path(run_dir) / name, folder / name)
    path = folder / "README.md"
    replace_whole(path, text.encode("utf-8"))
    return path
