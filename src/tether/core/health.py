"""Health rules: the seeds' warning signs as pure functions of the metric history.

Each rule takes the list of metric rows (dicts, oldest first) and its thresholds, and returns a
:class:`Alarm` or None. Rules never look at models or configs.
:class:`tether.run.monitor.HealthMonitor` runs them every step, prints each alarm once when it
starts, and records it in ``warnings.jsonl``.

Sources for the causes and fixes: the seeds' "Warning signs" and "What to monitor"; Gao et al.
2022, "Scaling Laws for Reward Model Overoptimization" (arXiv 2210.10760).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Alarm:
    rule: str
    step: int
    message: str
    cause: str
    fix: str


@dataclass
class HealthThresholds:
    window: int = 6
    """Steps (or eval points, for the over-optimization alarm) each rule looks back over."""
    kl_growth_factor: float = 3.0
    """KL exploding: mean KL of the window's second half > factor x its first half ..."""
    kl_explode_floor: float = 2.0
    """... and above this many nats per sequence ..."""
    kl_leash: float | None = None
    """... and above this many nats per sequence, the KL the run's controller was told to spend
    (a budget or adaptive controller reaches it by design: that rise is the leash at work, not
    an explosion). None: tether sets it to kl.budget or kl.target when the controller is budget
    or adaptive with kl.target_unit=nats_per_sequence, and leaves it unset otherwise."""
    kl_stuck_below: float = 0.05
    """KL stuck: every KL in the window below this (nats per sequence) ..."""
    score_flat_tol: float = 0.02
    """... while the score's change over the window is below this (scorer units)."""
    entropy_collapse_fraction: float = 0.5
    """Entropy collapse: entropy below this fraction of its first value."""
    length_growth_factor: float = 1.5
    """Length running away: mean length above this factor of its first value."""
    k1_negative_tol: float = 0.0
    """Negative k1: per-token mean k1 below -tol at every step of the window."""
    overopt_min_change: float = 0.02
    """Over-optimization: proxy up and gold down, each by at least this over the window."""
    logprob_mismatch_max: float = 0.01
    """Sampler/learner mismatch: ``rollout/logprob_mismatch`` above this (nats per token) at any
    step. Rounding alone gives far less (docs/performance.md, "bf16"); bf16 sampling scored in
    float32 gave 0.028."""
    is_clipped_max: float = 0.5
    """A corrected sampler that is not the learner (``rollout.dtype=bf16``): more than this share of
    the policy's tokens with a weight that is not their ratio (``rollout/is_clipped_fraction``) at
    the last step: ``mis`` drops most sequences, or ``tis`` truncates most tokens, and the update
    learns from few of the samples (with ``mis`` dropping all, from none)."""
    quality_min_proxy_gain: float = 0.02
    """Sample quality: the periodic evaluation's proxy score above the reference's by more than
    this (scorer units) ..."""
    quality_fluency_margin: float = 0.5
    """... while its fluency NLL is more than this above the reference's (nats per token; the
    fluency judge puts fluent review sentences near 2.5 and keyword strings near 5.5) ..."""
    quality_repetition_margin: float = 0.1
    """... or its 3-gram repetition rate more than this above the reference's (a share) ..."""
    quality_distinct_share: float = 0.9
    """... or its distinct-2 below this share of the reference's (a tenth of its distinct word
    pairs lost: on the embedded default the leashed demo kept 0.98 of the reference's, the
    almost unleashed run of benchmarks/overoptimization.py 0.87 at 10 nats of KL) ..."""
    quality_min_z: float = 2.0
    """... each change also more than this many standard errors of the difference (from the
    ``eval/*_se`` keys, when logged), so that a few noisy prompts do not raise it."""
    guard_rejected_steps: int = 3
    """Budget spent: the update guard restored the weights (``guard/fraction`` 0: no fraction of
    the update fit under kl.budget) in this many steps in a row."""
    capability_margin: float = 0.05
    """Capability loss: the policy's per-token NLL of the capability text (``eval/capability_nll``,
    human sentences no run trains on) more than this above the reference's (nats per token; 0.05
    is a 5% rise in perplexity) and more than ``quality_min_z`` standard errors of the paired
    difference (``eval/capability_nll_change_se``)."""

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"health.window={self.window!r} is invalid: must be >= 2")
        for name in ("kl_growth_factor", "length_growth_factor"):
            if getattr(self, name) <= 1:
                raise ValueError(f"health.{name}={getattr(self, name)!r} is invalid: must be > 1")
        if not 0 < self.quality_distinct_share < 1:
            raise ValueError(
                f"health.quality_distinct_share={self.quality_distinct_share!r} is invalid: must be in (0, 1)"
            )
        for name in ("quality_fluency_margin", "quality_repetition_margin", "capability_margin"):
            if getattr(self, name) <= 0:
                raise ValueError(f"health.{name}={getattr(self, name)!r} is invalid: must be > 0")
        if self.guard_rejected_steps < 1:
            raise ValueError(
                f"health.guard_rejected_steps={self.guard_rejected_steps!r} is invalid: must be >= 1"
            )
        if not 0 < self.entropy_collapse_fraction < 1:
            raise ValueError(
                f"health.entropy_collapse_fraction={self.entropy_collapse_fraction!r} "
                "is invalid: must be in (0, 1)"
            )


def _series(history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in history if isinstance(r.get(key), (int, float))]


def _half_means(values: list[float]) -> tuple[float, float]:
    h = len(values) // 2
    return sum(values[:h]) / h, sum(values[h:]) / (len(values) - h)


def kl_exploding(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """KL exploding: over the last ``t.window`` steps, the mean ``objective/kl`` (nats per
    sequence) of the second half is above ``t.kl_explode_floor``, above the leash's own KL
    (``t.kl_leash``, when set) and ``t.kl_growth_factor`` times the first half's (the seeds'
    warning sign "KL explodes")."""
    s = _series(history, "objective/kl")[-t.window :]
    if len(s) < t.window:
        return None
    first, second = _half_means([v for _, v in s])
    floor = max(t.kl_explode_floor, t.kl_leash if t.kl_leash is not None else 0.0)
    if second > floor and second > t.kl_growth_factor * max(first, 1e-8):
        return Alarm(
            "kl_exploding",
            s[-1][0],
            f"KL grew from {first:.2f} to {second:.2f} nats/seq over {t.window} steps",
            "the policy is running away from the reference (learning rate too high, beta too low, "
            "or a reference that is not the starting model)",
            "lower optim.lr, raise kl.kl_coef or use kl.controller=adaptive with a kl.target, "
            "and check the reference",
        )
    return None


def kl_stuck(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """KL stuck: every ``objective/kl`` of the window below ``t.kl_stuck_below`` nats per
    sequence while the score's half-window means differ by less than ``t.score_flat_tol``
    (the seeds' warning sign "KL stays near zero")."""
    kl = _series(history, "objective/kl")[-t.window :]
    sc = _series(history, "objective/scores")[-t.window :]
    if len(kl) < t.window or len(sc) < t.window:
        return None
    first, second = _half_means([v for _, v in sc])
    if all(v < t.kl_stuck_below for _, v in kl) and abs(second - first) < t.score_flat_tol:
        return Alarm(
            "kl_stuck",
            kl[-1][0],
            f"KL below {t.kl_stuck_below} nats/seq and score flat ({first:.3f} -> {second:.3f}) "
            f"for {t.window} steps",
            "the policy is not learning: beta too high or learning rate too low",
            "lower kl.kl_coef (or raise kl.target) or raise optim.lr",
        )
    return None


def entropy_collapse(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """Entropy collapse: ``objective/entropy`` (nats per token) below
    ``t.entropy_collapse_fraction`` of its first logged value."""
    s = _series(history, "objective/entropy")
    if len(s) < 2:
        return None
    if s[-1][1] < t.entropy_collapse_fraction * s[0][1]:
        return Alarm(
            "entropy_collapse",
            s[-1][0],
            f"entropy fell from {s[0][1]:.2f} to {s[-1][1]:.2f} nats/token",
            "the policy is collapsing onto a few outputs (mode collapse, reward hacking)",
            "raise kl.kl_coef, lower optim.lr, or stop earlier",
        )
    return None


def length_runaway(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """Length running away: ``response/length`` (tokens) above ``t.length_growth_factor`` times
    its first value. Responses at the ``rollout.max_new_tokens`` cap from the start cannot grow,
    so the rule is silent then."""
    s = _series(history, "response/length")
    if len(s) < 2 or s[0][1] <= 0:
        return None
    if s[-1][1] > t.length_growth_factor * s[0][1]:
        return Alarm(
            "length_runaway",
            s[-1][0],
            f"mean response length grew from {s[0][1]:.1f} to {s[-1][1]:.1f} tokens",
            "the scorer rewards length (a common proxy exploit); rising length often comes with rising KL",
            "normalize the score by length, cap rollout.max_new_tokens, or raise kl.kl_coef",
        )
    return None


def k1_negative(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """Mean k1 negative: ``objective/kl_per_token`` below ``-t.k1_negative_tol`` at every step of
    the window, k1 runs only (a true KL is never negative; a persistent negative mean means
    sampling and scoring disagree)."""
    rows = [r for r in history if "objective/k1_negative_fraction" in r]  # the estimator is k1
    s = _series(rows, "objective/kl_per_token")[-t.window :]
    if len(s) < t.window:
        return None
    if all(v < -t.k1_negative_tol for _, v in s):
        return Alarm(
            "k1_negative",
            s[-1][0],
            f"mean per-token k1 negative for {t.window} steps (last {s[-1][1]:.4f} nats/token)",
            "sampling and scoring disagree: a temperature, top-k/top-p or precision mismatch "
            "between generation and the log-probabilities (a true KL is never negative)",
            "sample with plain softmax at rollout.temperature and score at the same temperature "
            "and precision",
        )
    return None


def overoptimization(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """Over-optimization (Gao et al. 2022): over the last ``t.window`` periodic evaluations (at
    least 3), the held-out proxy score's half-window means rose and the gold score's fell, each
    by more than ``t.overopt_min_change``."""
    proxy = _series(history, "eval/proxy_score")[-t.window :]
    gold = _series(history, "eval/gold_score")[-t.window :]
    n = min(len(proxy), len(gold))
    if n < 3:
        return None
    proxy, gold = proxy[-n:], gold[-n:]
    p1, p2 = _half_means([v for _, v in proxy])
    g1, g2 = _half_means([v for _, v in gold])
    if p2 - p1 > t.overopt_min_change and g1 - g2 > t.overopt_min_change:
        return Alarm(
            "overoptimization",
            proxy[-1][0],
            f"proxy score rose {p1:.3f} -> {p2:.3f} while the gold score fell {g1:.3f} -> {g2:.3f}",
            "reward over-optimization: the policy exploits the proxy's errors (Gao et al. 2022)",
            "raise kl.kl_coef or lower kl.target, or keep the policy at the gold score's peak "
            "(eval.best_by=gold, with eval.patience to stop there)",
        )
    return None


def sample_quality(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """Reward climbs while samples get worse (the seeds: the leash "preserves fluency" and
    "diversity"): at the last periodic evaluation, the held-out proxy score is more than
    ``t.quality_min_proxy_gain`` above the reference's on the same prompts while the fluency NLL
    (``eval/fluency_nll``, nats per token) is more than ``t.quality_fluency_margin`` above the
    reference's, the 3-gram repetition rate (``eval/repetition``) more than
    ``t.quality_repetition_margin`` above it, or distinct-2 (``eval/distinct_2``) below
    ``t.quality_distinct_share`` of it, each change also beyond ``t.quality_min_z`` standard
    errors of the difference. The reference's numbers are the ``eval/ref_*`` keys of the same
    row (the reference's samples on the same prompts with the same seeds)."""
    rows = [r for r in history if isinstance(r.get("eval/ref_proxy_score"), (int, float))]
    if not rows:
        return None
    last = rows[-1]
    proxy, ref_proxy = last.get("eval/proxy_score"), last["eval/ref_proxy_score"]
    if not isinstance(proxy, (int, float)) or proxy - ref_proxy <= t.quality_min_proxy_gain:
        return None

    def pair(key: str) -> tuple[float, float, float] | None:
        """(policy, reference, SE of their difference; 0 when the row has no SEs)."""
        a, b = last.get(f"eval/{key}"), last.get(f"eval/ref_{key}")
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == a and b == b):
            return None
        se = [last.get(f"eval/{k}_se") for k in (key, f"ref_{key}")]
        se2 = sum(float(x) ** 2 for x in se if isinstance(x, (int, float)) and x == x)
        return float(a), float(b), se2**0.5

    worse = []
    z = t.quality_min_z
    if (f := pair("fluency_nll")) and f[0] - f[1] > max(t.quality_fluency_margin, z * f[2]):
        worse.append(
            f"fluency NLL {f[1]:.2f} -> {f[0]:.2f} nats/token (margin {t.quality_fluency_margin}, "
            f"{(f[0] - f[1]) / f[2] if f[2] else float('inf'):.1f} SE)"
        )
    if (r := pair("repetition")) and r[0] - r[1] > max(t.quality_repetition_margin, z * r[2]):
        worse.append(f"3-gram repetition {r[1]:.3f} -> {r[0]:.3f} (margin {t.quality_repetition_margin})")
    if (d := pair("distinct_2")) and d[0] < min(t.quality_distinct_share * d[1], d[1] - z * d[2]):
        worse.append(
            f"distinct-2 {d[1]:.3f} -> {d[0]:.3f} (below {t.quality_distinct_share:.0%} of the reference's)"
        )
    if not worse:
        return None
    return Alarm(
        "sample_quality",
        last["step"],
        f"held-out proxy score {ref_proxy:.3f} (reference) -> {proxy:.3f} while the samples got worse: "
        + "; ".join(worse),
        "the policy buys proxy score with degenerate text (reward hacking: repeated keywords, "
        "lost fluency, collapse onto a few outputs) that the leash should have prevented",
        "raise kl.kl_coef or lower kl.target / kl.budget, lower optim.lr, or stop earlier "
        "(eval.best_by=gold with eval.best_fluency_margin keeps the best policy that still reads well)",
    )


def capability_loss(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """The policy models ordinary text worse than the reference did (the seeds' alignment tax;
    the leash "retains general capabilities"): at the last evaluation that measured it,
    ``eval/capability_nll - eval/ref_capability_nll`` (nats per token, on the same human
    sentences) above ``t.capability_margin`` and above ``t.quality_min_z`` times
    ``eval/capability_nll_change_se``, the SE of the paired per-sentence difference."""
    rows = [
        r
        for r in history
        if isinstance(r.get("eval/capability_nll"), (int, float))
        and isinstance(r.get("eval/ref_capability_nll"), (int, float))
    ]
    if not rows:
        return None
    last = rows[-1]
    pol, ref = float(last["eval/capability_nll"]), float(last["eval/ref_capability_nll"])
    se = last.get("eval/capability_nll_change_se")
    se = float(se) if isinstance(se, (int, float)) and se == se else 0.0
    change = pol - ref
    if change <= max(t.capability_margin, t.quality_min_z * se):
        return None
    return Alarm(
        "capability_loss",
        last["step"],
        f"the NLL of human text no run trains on rose {ref:.3f} -> {pol:.3f} nats/token ({change:+.3f}, "
        f"{change / se if se else float('inf'):.1f} SE; margin {t.capability_margin})",
        "the policy drifted from the reference on text it does not sample: the alignment tax. The leash "
        "bounds the KL on the policy's own samples, so beta alone rarely holds this (docs/kl.md, "
        "'The text anchor')",
        "turn on the text anchor held to a budget (e.g. anchor.budget=0.03 nats per token: the forward KL "
        "to the reference on human text in the loss, its weight moved to hold it), compare with tether "
        "interpolate RUN (the weights moved back toward the reference), lower "
        "optim.lr or kl.budget, or keep an earlier policy (eval.best_by)",
    )


def logprob_mismatch(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """Sampler and learner disagree: the last step's ``rollout/logprob_mismatch`` (k3 of
    KL(sampler || learner) on the sampled tokens, nats per token) above
    ``t.logprob_mismatch_max`` (the seeds' "precision mismatch": the ratio is then not the one
    PPO's clip assumes, and the KL estimates are off by as much)."""
    s = _series(history, "rollout/logprob_mismatch")
    if not s or s[-1][1] <= t.logprob_mismatch_max:
        return None
    return Alarm(
        "logprob_mismatch",
        s[-1][0],
        f"the sampler's and the learner's log-probs of the same tokens differ by "
        f"{s[-1][1]:.4f} nats/token (k3), above {t.logprob_mismatch_max}",
        "generation and scoring compute different distributions: another precision, temperature, "
        "processor or weights in the sampler than in the update",
        "sample and score in the same model.dtype with plain softmax at rollout.temperature; "
        "check a custom generation path",
    )


ENV_SILENT_STEPS = 2
"""Steps with no environment token at all before :func:`env_never_answered` fires: the first
step's samples alone may not call a tool by chance; two in a row without one usually mean a stop
string no turn writes."""


def env_never_answered(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """A multi-turn run (``rollout/env_tokens`` logged) whose environment has not written a
    token in any step so far, after :data:`ENV_SILENT_STEPS` steps: it trains single-turn while
    set up for tools. Silent once any step had an environment token."""
    s = _series(history, "rollout/env_tokens")
    if len(s) < ENV_SILENT_STEPS or any(v > 0 for _, v in s):
        return None
    if _series(history, "rollout/tool_calls"):  # rollout.tools: the policy called no tool
        return Alarm(
            "env_never_answered",
            s[-1][0],
            f"the policy called no tool in the {len(s)} steps so far (rollout/tool_calls 0)",
            "no assistant turn held a tool call the tokenizer's parser reads (the format the chat template "
            "shows in the prompt's tool instructions), or every answer was dropped for not fitting the "
            "token budget",
            "look at the policy's turns in samples.jsonl (messages); start from a model tuned for tool use, "
            "or show the policy a call in the prompts; raise rollout.max_new_tokens",
        )
    return Alarm(
        "env_never_answered",
        s[-1][0],
        f"rollout.env wrote no token in the {len(s)} steps so far (rollout/env_tokens 0)",
        "no policy turn ended at one of rollout.stop_strings (a stop string the policy never writes), "
        "the environment returned None to every turn, or every reply was dropped for not fitting the "
        "token budget (a chat reply is never cut)",
        "compare rollout.stop_strings with the policy's turns in samples.jsonl; show the policy a call "
        "in the prompts (worked examples); check what the environment returns; raise "
        "rollout.max_new_tokens",
    )


def budget_spent(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """The update guard rejected whole updates (``guard/fraction`` 0) in the last
    ``guard_rejected_steps`` steps in a row: the policy sits at its KL budget and every update
    would pass it, so the run spends compute without moving."""
    s = _series(history, "guard/fraction")[-t.guard_rejected_steps :]
    if len(s) < t.guard_rejected_steps or any(v > 0 for _, v in s):
        return None
    kept = _series(history, "guard/kl_kept")
    return Alarm(
        "budget_spent",
        s[-1][0],
        f"the update guard restored the weights in each of the last {len(s)} steps: no fraction of an "
        f"update fit under kl.budget (the KL kept: {kept[-1][1] if kept else float('nan'):.3g})",
        "the policy has spent its KL budget: beta's pull and the reward's push balance at the budget, "
        "and each update would pass it",
        "raise kl.budget if more KL is acceptable, or stop the run here (the policy is at its "
        "constrained optimum for this budget); a smaller optim.lr makes updates that fit",
    )


def sampler_correction(history: list[dict], t: HealthThresholds) -> Alarm | None:
    """The correction discards most of the batch: the last step's ``rollout/is_clipped_fraction``
    above ``t.is_clipped_max``."""
    s = _series(history, "rollout/is_clipped_fraction")
    if not s or s[-1][1] <= t.is_clipped_max:
        return None
    return Alarm(
        "sampler_correction",
        s[-1][0],
        f"{s[-1][1]:.0%} of the policy's tokens got a weight other than their ratio learner / sampler "
        f"(rollout/is_clipped_fraction), above {t.is_clipped_max:.0%}",
        "the sampler is far from the learner for the band: rollout.correction=mis drops every sequence "
        "whose ratio leaves [1/cap, cap] (long responses sum many small log-ratios), tis truncates tokens "
        "past the cap",
        "widen rollout.correction_cap, use rollout.correction=tis for long responses, or sample in the "
        "learner's precision (rollout.dtype=fp32)",
    )


RULES: dict[str, Callable[[list[dict], HealthThresholds], Alarm | None]] = {
    "budget_spent": budget_spent,
    "env_never_answered": env_never_answered,
    "kl_exploding": kl_exploding,
    "kl_stuck": kl_stuck,
    "entropy_collapse": entropy_collapse,
    "length_runaway": length_runaway,
    "k1_negative": k1_negative,
    "overoptimization": overoptimization,
    "logprob_mismatch": logprob_mismatch,
    "sampler_correction": sampler_correction,
    "sample_quality": sample_quality,
    "capability_loss": capability_loss,
}
