"""What a run says when it starts and ends: the defaults it took from the demo or the data, the
leash's numbers in words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.core import distributed as D
from tether.data.tasks import TASK_SETTINGS, TASKS
from tether.models.sampling import bf16_matmul_missing
from tether.models.sharding import is_sharded, local_bytes
from tether.run.config import Config
from tether.run.console import number, say

if TYPE_CHECKING:  # run.setup builds the run; the type only
    from tether.run.setup import Run

SMALL_HELDOUT = 8
"""Fewer held-out prompts than this: a warning that the held-out standard errors are rough."""


def _value(c: Config, name: str):
    section, field = name.split(".")
    return getattr(getattr(c, section), field)


def task_defaults_lines(
    c: Config, has_judge: bool, scorer_given: bool = False, n_heldout: int | None = None
) -> list[str]:
    """What the run took as defaults that belong to the demo or to the data, said in its first
    lines: the reward when reward.scorer was left unset on data other than the demo's, and what
    scores the held-out evaluation (the run's own reward; the gold judge only when named)."""
    lines = []
    if (
        not c.embedded_data
        and c.data.prompts not in TASKS
        and c.reward._given("scorer") is None
        and not scorer_given
    ):
        uses = (
            "DPO's per-step probe and the held-out evaluation score with"
            if c.pairs_file
            else "the run trains on"
        )
        lines.append(
            f"tether: note: reward.scorer is unset, so {uses} VADER sentiment, the demo's reward; name "
            "your own with reward.scorer=module:function (or hf:MODEL, a list of them)"
        )
    if c.data.prompts in TASKS and c.reward._given("scorer") is None and not scorer_given:
        lines.append(
            f"tether: data.prompts={c.data.prompts} trains on its checker, reward.scorer={c.reward.scorer} "
            "(1 when the response starts with the row's answer, else 0; tether.judges.verifiers)"
        )
    at_defaults = [
        f"{name}={value}" if isinstance(value, str) else f"{name}={value:g}".replace("e-0", "e-")  # 5e-5
        for name, value in TASK_SETTINGS.get(c.data.prompts, {}).items()
        if _value(c, name) == _value(Config(), name) != value
    ]
    if at_defaults:
        lines.append(
            f"tether: note: data.prompts={c.data.prompts} was measured at {' '.join(at_defaults)}; this run "
            'keeps the demo\'s defaults there (README, "Verifiable rewards": what each one changes)'
        )
    if c.eval.n_prompts or c.eval.every:
        if has_judge:
            gold = f"and the gold judge eval.judge={c.eval.judge}"
        elif c.eval.judge == "none" and c.eval._given("judge") is None:
            gold = (
                "alone: no gold judge (eval.judge=none, the default on data other than the demo's; name "
                "one with eval.judge=SCORER, e.g. minilm-rm, the demo's)"
            )
        else:
            gold = "alone (eval.judge=none)"
        lines.append(f"tether: the held-out evaluation scores with the run's reward (reward.scorer) {gold}")
        if c.eval.fluency_model not in ("none", "auto"):  # auto: said when it is decided
            lines.append(
                f"tether: the fluency judge is eval.fluency_model={c.eval.fluency_model} (its NLL of each "
                "held-out response; eval.fluency_model=none turns it off)"
            )
        held = n_heldout
        if held is not None and 0 < held < SMALL_HELDOUT:
            lines.append(
                f"tether: warning: only {held} held-out prompt(s): the held-out numbers' standard errors are "
                + ("undefined (nan) with one" if held == 1 else "rough")
                + " (raise data.heldout_fraction or add prompts)"
            )
    return lines


def z_text(z: float | None) -> str:
    """A z-score for the log: one decimal, or ``n/a`` where its SE was 0 (None)."""
    return "n/a" if z is None else f"{z:.1f}"


def change_text(value, se, spec: str = "+.3f") -> str:
    """A change with its standard error, ``+0.137 ± 0.041``, or ``n/a`` where it has no number
    (a NaN: no scored sample, a distinct-2 of responses under two words)."""
    text = number(value, spec)
    return text if text == "n/a" or number(se) == "n/a" else f"{text} ± {number(se, spec.lstrip('+'))}"


def leash_line(result: dict) -> str:
    """What the leash protects, reference -> policy on the held-out prompts, with SEs (``n/a``
    where a number is NaN)."""
    ref, pol = result["reference"], result["policy"]
    parts = []
    if "fluency_nll_change" in result:
        change = change_text(result["fluency_nll_change"], result["fluency_nll_change_se"], "+.2f")
        parts.append(
            f"fluency NLL {number(ref['fluency_nll_mean'], '.2f')} -> "
            f"{number(pol['fluency_nll_mean'], '.2f')} nats/token ({change})"
        )
    for key, label in (
        ("distinct_2", "distinct-2"),
        ("self_bleu", "self-BLEU"),
        ("repetition", "repetition"),
    ):
        if f"{key}_change" in result:
            parts.append(
                f"{label} {number(ref[key])} -> {number(pol[key])} "
                f"({change_text(result[f'{key}_change'], result[f'{key}_change_se'])})"
            )
    return "tether: what the leash protects (held out): " + "; ".join(parts)


def announce_start(
    run: Run, *, resume: bool, start: int, has_judge: bool, scorer_given: bool, beta_in_reward_std: bool
) -> None:
    """The run's first lines: its folder, weights and processes, its prompts, the defaults it took
    (:func:`task_defaults_lines`), what it trains, and the notes and warnings its settings call
    for (beta in group reward stds, nothing left to train, no held-out prompts)."""
    c = run.config
    w, show = run.writer, c.train.progress
    weight = next(run.policy.lm.parameters())
    say(
        f"tether: run directory {w.run_dir}"
        + (f", resuming after step {start - 1}" if resume else "")
        + f"; {weight.device.type} weights in {str(weight.dtype).removeprefix('torch.')}"
        + (f"; {D.world_size()} processes (data parallel)" if D.is_distributed() else ""),
        show,
    )
    if c.rollout.dtype != "fp32" and c.trainer.samples:  # which model the training rollouts decode on
        why = bf16_matmul_missing()
        chose = run.sampler.settings.dtype
        say(
            f"tether: rollout.dtype={c.rollout.dtype}: training rollouts decode "
            + (
                f"on a bfloat16 copy of the policy, corrected by rollout.correction={c.rollout.correction}"
                if chose == "bf16"
                else "on the policy itself (fp32)"
            )
            + (
                f" ({why[0].lower() + why[1:]})"
                if why and c.rollout.dtype == "auto" and chose == "fp32"
                else ""
            )
            + (f"; note: {why[0].lower() + why[1:]}" if why and c.rollout.dtype == "bf16" else ""),
            show,
        )
    if is_sharded(run.policy):
        held, ref = local_bytes(run.policy), local_bytes(run.reference) if run.reference else None
        say(
            f"tether: policy{' and reference' if ref else ''} sharded (FSDP) over {D.world_size()} "
            "processes: rank 0 holds "
            f"{held['params'] / 2**20:.1f} MiB of the policy's {held['numel'] * 4 / 2**20:.1f} MiB of "
            "float32 weights (and the same share of the trained ones' gradients and AdamW moments)"
            + (f", {ref['params'] / 2**20:.1f} MiB of the reference's" if ref else ""),
            show,
        )
    say(f"tether: {len(run.train_prompts)} training prompts, {len(run.heldout_prompts)} held out", show)
    for line in task_defaults_lines(
        c, has_judge=has_judge, scorer_given=scorer_given, n_heldout=len(run.heldout_prompts)
    ):
        say(line, show)
    if c.model.layers_to_train is not None:
        trained = sum(p.numel() for p in run.policy.lm.parameters() if p.requires_grad)
        total = sum(p.numel() for p in run.policy.lm.parameters())
        say(
            f"tether: training the last {c.model.layers_to_train} transformer blocks "
            f"({trained / 1e6:.1f}M of {total / 1e6:.1f}M weights; model.trainable_layers=all "
            "trains every one)",
            show,
        )
    if beta_in_reward_std:
        say(
            f"tether: note: GRPO divides the advantages by each group's reward std but not the KL term "
            f"(grpo.scale_by_std=true, KL in the loss), so kl.kl_coef={c.kl.kl_coef:g} counts in group "
            "reward standard deviations, not reward units per nat (objective/kl_coef_effective logs beta "
            "x the mean group std). For beta in reward units: grpo.scale_kl_by_std=true, "
            "grpo.scale_by_std=false or kl.kl_in_reward=true",
            show,
        )
    if resume and start >= c.train.steps:
        say(
            f"tether: the run already has its train.steps={c.train.steps} steps (raise train.steps to train "
            "on); evaluating its policy again",
            show,
        )
    if not run.heldout_prompts and (c.eval.n_prompts or c.eval.every):
        say(
            f"tether: warning: no held-out prompts (data.heldout_fraction={c.data.heldout_fraction:g} "
            f"of {len(run.train_prompts)} prompts picked none), so no held-out evaluation, gold score "
            "or eval.json; "
            "raise data.heldout_fraction or add prompts",
            show,
        )
