"""``tether interpolate RUN --alpha A,B,...``: the weights between the reference and the trained
policy, each evaluated as the run evaluates its final policy.

At each ``alpha`` the policy's weights are ``(1 - alpha) theta_ref + alpha theta`` (every tensor
of the saved policy; frozen ones are equal on both sides). Weight averaging with the starting model
is the zero-training-cost answer to the alignment tax (Lin et al. 2024, "Mitigating the Alignment
Tax of RLHF"; WiSE-FT, Wortsman et al. 2022): the baseline any regularizer, the text anchor
included, must beat on the gain-against-forgetting front.

With LoRA (a fresh adapter, so the reference is the base model) the adapter's update is scaled:
``A`` as trained, ``B`` times ``alpha``, so each adapted weight is ``W + s (alpha B) A = (1 - alpha)
W + alpha (W + s B A)``, the same interpolation of the merged weights, and the base (the reference's
weights) is never written. A run that started from an adapter (``model.adapter``: its reference is
base + that adapter, and ``(1 - alpha) B0 A0 + alpha B A`` is not one rank-r adapter) and a DoRA
adapter (its magnitude vector is not linear in ``B A``) are refused by name.

Each alpha is evaluated with the run's own held-out evaluation (the same prompts, seeds, scorers,
fluency judge and capability probe as its ``eval.json``), against the reference's evaluation the
run kept (``eval_reference.json``): ``alpha = 0`` is the reference's numbers and ``alpha = 1`` the
saved policy's (tested). Written to ``RUN/interpolate.json`` and ``RUN/interpolate.png``, which
replace an earlier call's (the rows are printed too).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from tether.run.console import say

log = logging.getLogger(__name__)

COLUMNS = (
    ("gain", "proxy gain"),
    ("gold_gain", "gold gain"),
    ("kl", "held-out KL"),
    ("fluency_nll_change", "fluency NLL"),
    ("distinct_2_change", "distinct-2"),
    ("capability_nll_change", "capability NLL"),
)
"""The table's numbers (``interpolate.json`` keys, each with ``_se`` where it has one) and headings."""


def parse_alphas(text: str) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``, sorted and distinct.

    Raises:
        ValueError: a value that is not a finite number in [0, 1] (extrapolating past the policy or
            the reference is not what this measures), or none.
    """
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            a = float(part)
        except ValueError:
            raise ValueError(
                f"--alpha: {part.strip()!r} is not a number; give values in [0, 1], e.g. 0,0.5,1"
            ) from None
        if not (math.isfinite(a) and 0 <= a <= 1):
            raise ValueError(f"--alpha: {a} is outside [0, 1] (0 = the reference, 1 = the trained policy)")
        out.append(a + 0.0)  # -0 is 0
    if not out:
        raise ValueError("--alpha: no value; give values in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    return sorted(set(out))


def saved_policy_tensors(policy_dir: Path) -> dict[str, torch.Tensor]:
    """The trained LM's tensors of a run's ``policy`` folder (``save_pretrained``'s safetensors files,
    the value head left out), by their names in the LM's state dict.

    Raises:
        FileNotFoundError: no such folder or no weights in it (``train.save_model=false``).
    """
    from safetensors.torch import load_file

    files = sorted(p for p in Path(policy_dir).glob("*.safetensors") if p.name != "value_head.safetensors")
    if not files:
        raise FileNotFoundError(
            f"{policy_dir}: no saved policy weights: the run has not finished (resume it: tether train "
            "--resume RUN), or it ran with train.save_model=false"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


class Interpolation:
    """The policy's LM set to ``(1 - alpha) theta_ref + alpha theta`` in place.

    Args:
        lm: the run's policy LM, holding the reference's weights (freshly loaded).
        trained: the trained tensors by state-dict name (:func:`saved_policy_tensors`).

    Raises:
        RuntimeError: a trained tensor the LM does not have, or of another shape (another model).
    """

    def __init__(
        self,
        lm: torch.nn.Module,
        trained: dict[str, torch.Tensor],
        fixed: dict[str, torch.Tensor] | None = None,
    ):
        state = lm.state_dict()
        both = {**trained, **(fixed or {})}
        bad = [k for k in both if k not in state or state[k].shape != both[k].shape]
        if bad:
            raise RuntimeError(
                f"the saved policy does not match the run's model ({bad[:3]}): was model.name changed?"
            )
        self.lm = lm
        with torch.no_grad():  # a LoRA adapter's A: as trained at every alpha (its B carries alpha)
            for k, v in (fixed or {}).items():
                state[k].copy_(v)
        self.targets = {k: state[k] for k in trained}  # the LM's own tensors, written in place
        self.reference = {k: v.detach().clone() for k, v in self.targets.items()}
        self.trained = {k: v.to(self.targets[k].device, self.targets[k].dtype) for k, v in trained.items()}
        self.changed = [k for k in self.targets if not torch.equal(self.reference[k], self.trained[k])]
        """The tensors training moved (the others are equal at every alpha)."""

    @torch.no_grad()
    def set(self, alpha: float) -> None:
        """Write ``(1 - alpha) ref + alpha trained`` into the LM (exactly ``ref`` at 0, ``trained`` at 1)."""
        for k in self.changed:
            if alpha == 0:
                self.targets[k].copy_(self.reference[k])
            elif alpha == 1:
                self.targets[k].copy_(self.trained[k])
            else:
                torch.lerp(self.reference[k], self.trained[k], alpha, out=self.targets[k])


def lora_tensors(lm: torch.nn.Module, policy_dir: Path) -> tuple[dict, dict]:
    """A LoRA run's saved adapter as :class:`Interpolation` takes it: ``(trained, fixed)``, the
    ``B`` tensors (interpolated from the fresh adapter's zeros) and the ``A`` tensors (as trained),
    by their names in ``lm``'s state dict (peft's saved names, ``x.lora_A.weight``, with the policy
    adapter's name put back: ``x.lora_A.default.weight``).

    Raises:
        FileNotFoundError: no adapter weights in ``policy_dir``. ValueError: the run's adapter did
            not start at ``B = 0`` (a run from ``model.adapter``) or is DoRA.
    """
    from tether.models.lora import POLICY_ADAPTER

    saved = saved_policy_tensors(policy_dir)
    state = lm.state_dict()
    trained, fixed = {}, {}
    for key, value in saved.items():
        parts = key.split(".")
        i = next((j for j, part in enumerate(parts[:-1]) if part.startswith("lora_")), None)
        if i is None or parts[i] == "lora_magnitude_vector":
            raise ValueError(
                f"{policy_dir}: {key} is not a LoRA A or B tensor (DoRA, or modules saved whole): "
                "tether interpolate scales a plain LoRA adapter only; merge it into its base "
                "(peft's merge_and_unload)"
            )
        name = ".".join([*parts[: i + 1], POLICY_ADAPTER, *parts[i + 1 :]])
        is_b = parts[i] in ("lora_B", "lora_embedding_B")
        if is_b and name in state and state[name].any():
            raise ValueError(
                f"{policy_dir}: the run's adapter did not start at B = 0 (it started from "
                "model.adapter), so its reference is base + that adapter and the interpolation is not "
                "one adapter: merge both into full weights to interpolate them"
            )
        (trained if is_b else fixed)[name] = value
    return trained, fixed


def interpolation_row(alpha: float, result: dict) -> dict:
    """One alpha's row of ``interpolate.json`` from :func:`tether.run.evaluation.compare`'s result
    (plus the capability probe's numbers when it ran)."""
    kl = result["policy"].get("kl")
    row = {"alpha": alpha, "kl": kl if kl is not None and kl == kl else None}  # NaN (no reference): none
    for key in ("gain", "gold_gain", "fluency_nll_change", "distinct_2_change", "capability_nll_change"):
        if key in result:
            row[key] = result[key]
            se = result.get(f"{key}_se_paired", result.get(f"{key}_se"))
            if se is not None:
                row[f"{key}_se"] = se
    return row


def table(rows: list[dict]) -> str:
    """The rows as a text table, one line per alpha (``n/a`` where a number is missing)."""
    shown = [(k, h) for k, h in COLUMNS if any(k in r for r in rows)]
    head = "alpha | " + " | ".join(h for _, h in shown)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for k, _ in shown:
            v, se = r.get(k), r.get(f"{k}_se")
            cells.append(
                "n/a" if v is None or v != v else f"{v:+.3f}" + (f" ± {se:.3f}" if se is not None else "")
            )
        lines.append(f"{r['alpha']:.3g} | " + " | ".join(cells))
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    """``interpolate.png``: the proxy gain and the capability change against the held-out KL, one
    point per alpha (labelled), error bars of one SE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tether.run.plots import save_png

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "gain", "held-out proxy gain"),
        (axes[1], "capability_nll_change", "capability NLL change (nats/token)"),
    ):
        pts = [r for r in rows if r.get(key) is not None and r.get("kl") is not None]
        if not pts:
            ax.set_title(f"{label}: not measured")
            continue
        ax.errorbar(
            [r["kl"] for r in pts],
            [r[key] for r in pts],
            yerr=[r.get(f"{key}_se", 0.0) for r in pts],
            marker="o",
            capsize=3,
        )
        for r in pts:
            ax.annotate(f"α={r['alpha']:.3g}", (r["kl"], r[key]), textcoords="offset points", xytext=(4, 4))
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("held-out KL to the reference (nats per sequence)")
        ax.set_ylabel(label)
    fig.suptitle("(1 - α) θ_ref + α θ: the trained policy's weights interpolated toward the reference")
    save_png(fig, out, dpi=100)  # whole, and never through a link planted in the run folder


def interpolate(run_dir: str | Path, alphas: list[float]) -> list[dict]:
    """Evaluate the run's saved policy interpolated toward its reference at each alpha; write
    ``interpolate.json`` and ``interpolate.png`` into the run folder; return the rows.

    Raises:
        FileNotFoundError: not a run folder, or no saved policy. ValueError: a LoRA run that started
            from an adapter or is DoRA (:func:`lora_tensors`), or a run whose reference evaluation is
            missing (eval.n_prompts=0).
    """
    from tether.judges.scorers import make_scorer
    from tether.run.config import load_config
    from tether.run.evaluation import Evaluator, compare, fluency_judge, reference_eval
    from tether.run.files import write_json_file
    from tether.run.lock import release as release_lock
    from tether.run.setup import build_run

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: not a tether run folder (no config.yaml)")
    saved_policy_tensors(run_dir / "policy")  # a run that saved no policy: said before anything loads
    config = load_config(str(run_dir / "config.yaml"), [f"train.output_dir={run_dir}"]).for_run()
    if config.model.adapter is not None:
        raise ValueError(
            f"{run_dir}: the run started from an adapter (model.adapter), so its reference is base + "
            "that adapter and the interpolation is not one adapter: merge both into full weights to "
            "interpolate them"
        )
    if not config.eval.n_prompts:
        raise ValueError(f"{run_dir}: eval.n_prompts=0, so the run has no held-out evaluation to repeat")
    config.anchor.coef = 0.0  # the text anchor trains only: its texts are not loaded (nor needed)
    config.anchor.budget = None
    judge = make_scorer(config.eval.judge) if config.eval.judge != "none" else None
    run = build_run(config, resume=True)
    try:
        show = config.train.progress
        evaluator = Evaluator(run, judge, fluency_judge(run))
        before = reference_eval(evaluator, run_dir, show)
        # with LoRA the peft model, whose state-dict names are the saved adapter's
        model = run.policy.peft if config.model.lora else run.policy.lm
        if config.model.lora:
            trained, fixed = lora_tensors(model, run_dir / "policy")
        else:
            trained, fixed = saved_policy_tensors(run_dir / "policy"), {}
        weights = Interpolation(model, trained, fixed)
        rows = []
        for alpha in alphas:
            weights.set(alpha)
            say(f"tether: alpha {alpha:g}: evaluating (1 - alpha) theta_ref + alpha theta", show)
            result = compare(before, evaluator(f"alpha={alpha:g}", evaluator.heldout))
            if evaluator.capability is not None:
                result |= evaluator.measure_capability()
            rows.append(interpolation_row(alpha, result))
        write_json_file(run_dir / "interpolate.json", {"rows": rows, "n_prompts": len(evaluator.heldout)})
        plot(rows, run_dir / "interpolate.png")
        return rows
    finally:
        release_lock(run.writer.lock)
