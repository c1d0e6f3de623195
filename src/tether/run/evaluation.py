"""Held-out evaluation: proxy score, gold score and KL of a policy on prompts it never trained on."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tether.core import distributed as D
from tether.core.diversity import distinct_n, repetition, self_bleu
from tether.core.kl import estimate_kl, sequence_kl
from tether.core.passk import ks_up_to, pass_at_k
from tether.data.capability import capability_texts
from tether.data.prompts import PromptData
from tether.judges.contract import Scorer, score_rollout, trainer_state
from tether.judges.fluency import continuation_logprobs, mean_nll
from tether.models.callables import PASSED_FROM_PYTHON
from tether.models.rollouts import Sampler
from tether.models.sampling import sample_seeds
from tether.models.scoring import rollout_logprobs
from tether.models.turns import EnvFailed
from tether.run.announce import change_text, leash_line, z_text
from tether.run.console import number, say
from tether.run.files import read_json, write_json_file
from tether.run.monitor import HELDOUT_RULES
from tether.run.rngs import forked_rngs

if TYPE_CHECKING:  # run.setup builds the run this evaluates; imported for the type only
    from tether.run.setup import Run

log = logging.getLogger(__name__)


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n)); (nan, nan) for an empty list."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / max(n - 1, 1) / n)


def prompt_means(values: list, k: int, keep_empty: bool = False) -> list:
    """The mean of each prompt's ``k`` consecutive values (None left out: an unscored sample, an
    empty response's fluency; a prompt with no value left out, or None with ``keep_empty``, so
    that two lists of one evaluation's prompts stay aligned): the unit whose spread gives an
    honest standard error when the ``k`` samples of a prompt are correlated (a cluster-robust SE,
    clusters = prompts)."""
    out: list = []
    for i in range(0, len(values), k):
        xs = [float(v) for v in values[i : i + k] if v is not None]
        if xs:
            out.append(sum(xs) / len(xs))
        elif keep_empty:
            out.append(None)
    return out


def jackknife_se(groups: list[list[str]], stat) -> float:
    """Delete-one-group jackknife standard error of ``stat(texts)`` over prompt groups:
    ``sqrt((n - 1) / n * sum_i (s_(i) - mean)^2)`` with ``s_(i)`` the statistic without group
    ``i`` (Efron & Tibshirani 1993, "An Introduction to the Bootstrap", eq. 11.5), for a
    statistic of the whole set such as distinct-n that has no per-sample value. NaN for fewer
    than 2 groups."""
    n = len(groups)
    if n < 2:
        return float("nan")
    loo = [stat([t for j, g in enumerate(groups) if j != i for t in g]) for i in range(n)]
    loo = [v for v in loo if v == v]
    if len(loo) < 2:
        return float("nan")
    m = sum(loo) / len(loo)
    return math.sqrt((n - 1) / n * sum((v - m) ** 2 for v in loo))


DIVERSITY_KEYS = ("distinct_1", "distinct_2", "self_bleu", "repetition", "distinct_responses")
"""Diversity numbers of an evaluation (:mod:`tether.core.diversity`; ``distinct_responses``: the
mean count of different responses a prompt got, whitespace-normalized, with 2 or more samples a
prompt: the answer diversity of a checker task), each with an ``_se``."""


@dataclass
class EvalResult:
    name: str
    responses: list[str]
    """The policy's own text of each sample (multi-turn: its turns, the environment's text left
    out): what the diversity measures and the fluency judge read."""
    kl_per_sequence: list[float]
    """k1 per sequence (nats) of each sample against the reference; empty without a reference."""
    scores: dict[str, list[float | None]] = field(default_factory=dict)
    """scorer name ('proxy', 'gold') -> one score per response; None where the scorer returned
    None (TRL's "does not apply": the sample is left out of that scorer's numbers)."""
    samples_per_prompt: int = 1
    """Responses per prompt, stored prompt-major: responses[i * k + j] is prompt i's j-th."""
    fluency_nll: list[float | None] = field(default_factory=list)
    """Per-token NLL (nats) of each response under the fluency judge (None: empty response);
    empty without a fluency judge."""
    transcripts: list[str] = field(default_factory=list)
    """Multi-turn only (else empty): each sample's whole transcript, the environment's text
    included, as the scorers read it (in the chat format their messages' contents, one per line)."""
    env: list[list[str]] = field(default_factory=list)
    """Multi-turn only (else empty): what the environment wrote in each sample, in order."""

    @property
    def kl(self) -> float:
        return mean_se(self.kl_per_sequence)[0] if self.kl_per_sequence else float("nan")

    def head(self, n_prompts: int) -> EvalResult:
        """The result restricted to its first ``n_prompts`` prompts (all their samples)."""
        n = n_prompts * self.samples_per_prompt
        return replace(  # every per-sample list cut; the name and the samples per prompt kept
            self,
            responses=self.responses[:n],
            kl_per_sequence=self.kl_per_sequence[:n],
            scores={k: v[:n] for k, v in self.scores.items()},
            fluency_nll=self.fluency_nll[:n],
            transcripts=self.transcripts[:n],
            env=self.env[:n],
        )

    def groups(self) -> list[list[str]]:
        """The responses grouped by prompt."""
        k = self.samples_per_prompt
        return [self.responses[i : i + k] for i in range(0, len(self.responses), k)]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "responses": self.responses,
            "kl_per_sequence": self.kl_per_sequence,
            "scores": self.scores,
            "samples_per_prompt": self.samples_per_prompt,
            "fluency_nll": self.fluency_nll,
            **({"transcripts": self.transcripts, "env": self.env} if self.transcripts else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> EvalResult:
        """The result :meth:`to_json` wrote (other keys ignored); a field an older file lacks
        (``samples_per_prompt``, ``fluency_nll``, ``transcripts``, ``env``) takes its default."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def diversity(self) -> dict[str, float]:
        """distinct-1 and distinct-2 over all responses, self-BLEU between the responses of each
        prompt (when there are several) and the mean 3-gram repetition rate, each with its SE
        (jackknife over prompts for distinct-n; over per-prompt values for the others)."""
        groups = self.groups()
        out: dict[str, float] = {}
        for n in (1, 2):
            out[f"distinct_{n}"] = distinct_n(self.responses, n)
            out[f"distinct_{n}_se"] = jackknife_se(groups, lambda texts, n=n: distinct_n(texts, n))
        if self.samples_per_prompt >= 2:
            out["self_bleu"], out["self_bleu_se"] = mean_se(self_bleu(groups))
        rep = [repetition(t) for t in self.responses]
        out["repetition"], out["repetition_se"] = mean_se(prompt_means(rep, self.samples_per_prompt))
        if self.samples_per_prompt >= 2:
            distinct = [len({" ".join(t.split()) for t in g}) for g in groups]
            out["distinct_responses"], out["distinct_responses_se"] = mean_se([float(d) for d in distinct])
        return out

    def pass_at(self, key: str) -> dict[int, list[float]] | None:
        """Per prompt, the unbiased pass@k (:func:`tether.core.passk.pass_at_k`, Chen et al. 2021
        eq. 1) of scorer ``key`` for k = 1, 2, 4, ... up to the samples a prompt has, when every
        one of its scores is 0 or 1 (a checker) and a prompt has 2 or more samples; else None
        (a graded score, or an unscored sample, has no pass@k)."""
        xs, k = self.scores.get(key, []), self.samples_per_prompt
        if k < 2 or not xs or any(x is None or x not in (0, 1) for x in xs):
            return None
        right = [int(sum(xs[i : i + k])) for i in range(0, len(xs), k)]
        return {j: [pass_at_k(k, c, j) for c in right] for j in ks_up_to(k)}

    def summary(self) -> dict:
        """Means and standard errors (over prompts) of every score, the fluency NLL and the
        diversity numbers; ``kl`` in nats per sequence."""
        k = self.samples_per_prompt
        out = {"name": self.name, "n": len(self.responses), "samples_per_prompt": k, "kl": self.kl}
        for key, xs in self.scores.items():
            out[f"{key}_mean"], out[f"{key}_se"] = mean_se(prompt_means(xs, k))
            unscored = sum(x is None for x in xs)
            if unscored:  # the samples the scorer returned None for, left out of its numbers
                out[f"{key}_unscored"] = unscored
        for key in self.scores:
            for j, per_prompt in (self.pass_at(key) or {}).items():
                out[f"{key}_pass@{j}"], out[f"{key}_pass@{j}_se"] = mean_se(per_prompt)
        if self.fluency_nll:
            out["fluency_nll_mean"], out["fluency_nll_se"] = mean_se(prompt_means(self.fluency_nll, k))
        out.update(self.diversity())
        return out


@torch.no_grad()
def evaluation_state(steps: int, prompts_per_step: float, n_train_prompts: int):
    """The ``trainer_state`` of every judging call of a run (held-out evaluations of the
    reference and the policies, best-of-N, the gold judge on the step's samples): the end of
    training, ``global_step = max_steps = steps``, ``epoch`` the passes over the training prompts
    by then. One state for all, so a step-dependent reward scores the reference and every policy
    alike (the training steps' own scoring gets the live step, ``OnPolicyTrainer.trainer_state``).

    Returns:
        ``transformers.TrainerState`` (:func:`tether.judges.contract.trainer_state`).
    """
    return trainer_state(steps, steps, steps * prompts_per_step / max(1, n_train_prompts))


@dataclass(frozen=True)
class EvalSettings:
    """What a run's held-out evaluations draw and judge, fixed for the run (``eval.*``).

    Attributes:
        seed: the evaluation seed (``eval.seed``): sample ``j`` of prompt ``i`` is seeded by
            ``sample_seeds(seed, 0, [i * k + j])``, and the global generators are forked and
            seeded with it.
        batch_size: rows per sampling call (``eval.batch_size``).
        samples_per_prompt: k, responses per prompt (``eval.samples_per_prompt``).
        fluency_samples: the fluency judge reads the first this many samples of each prompt
            (``eval.fluency_samples``; None: all).
        share_prefix: with k > 1, a prompt's k rows run its prompt through the trunk once, in
            sampling and in scoring (``model.share_prompt_prefix``).
    """

    seed: int
    batch_size: int = 64
    samples_per_prompt: int = 1
    fluency_samples: int | None = None
    share_prefix: bool = False


def evaluate(
    name: str,
    lm: nn.Module,
    reference: nn.Module | None,
    prompts: PromptData | list,
    *,
    sampler: Sampler,
    scorers: dict[str, Scorer],
    settings: EvalSettings,
    fluency: Callable[[list[str], list[str]], list[float | None]] | None = None,
    state=None,
) -> EvalResult:
    """Sample ``settings.samples_per_prompt`` responses per held-out prompt with fixed seeds;
    score each with every scorer and the fluency judge.

    Sample ``j`` of prompt ``i`` is drawn with the seed ``sample_seeds(seed, 0, [i * k + j])``,
    whatever the batching, so reference and policy see the same random numbers on each sample (and
    the first prompts of a longer evaluation get the samples a shorter one gets); torch's,
    Python's and NumPy's global generators are forked and seeded with ``seed``
    (:func:`tether.run.rngs.forked_rngs`: a scorer or an environment may draw from them), so
    evaluation never changes the training stream, and every pass with one ``seed`` (the
    reference's, each policy's) starts their draws from one state. KL is the k1 estimate per
    sequence (unbiased) against ``reference`` on the evaluated samples, with the sampling settings
    of training (``sampler``, the run's: :meth:`tether.models.rollouts.Sampler.sample`, eagerly,
    on ``lm``'s weights as they are). The fluency judge reads the first
    ``settings.fluency_samples`` samples of each prompt (None = all); the others get None there.

    Scorers are called as TRL calls reward functions (:mod:`tether.judges.contract`), with the
    samples' ``completion_ids`` and ``state`` as ``trainer_state`` (a run passes
    :func:`evaluation_state`, so that the reference's and each policy's scores compare; None
    passes ``global_step=0``, ``max_steps=0``).

    With tool turns (``rollout.env``) the samples are multi-turn, as in training (a
    :class:`tether.models.turns.EnvFailed` names this evaluation): the KL counts the policy's
    tokens only, the scorers read the whole transcript, and the fluency judge, the diversity
    measures and the stored responses the policy's own text.
    """
    k, seed, batch_size = settings.samples_per_prompt, settings.seed, settings.batch_size
    if k > 1:  # each prompt k times in a row, with its columns
        idx = [i for i in range(len(prompts)) for _ in range(k)]
        prompts = prompts.select(idx) if isinstance(prompts, PromptData) else [prompts[i] for i in idx]
    result = EvalResult(name, [], [], {key: [] for key in scorers}, k)
    temperature = sampler.settings.temperature
    # k > 1: a prompt's k rows run its prompt through the trunk once, in sampling and in scoring
    # (tether.models.head.prefix_cache; the policy's and the reference's scoring alike, so at equal
    # weights their log-probs agree bit for bit): pass@16 scores 16 rows of one prompt
    share = settings.share_prefix and k > 1
    with forked_rngs(seed):
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            try:
                ro = sampler.sample(
                    lm, batch, sample_seeds(seed, 0, range(i, i + len(batch))), share_prefix=share
                )
            except EnvFailed as e:
                raise e.retold(f"held-out evaluation ({name}): {e}") from e.__cause__
            if reference is not None:
                lp = rollout_logprobs(lm, ro, temperature, share_prefix=share).logprobs
                ref_lp = (
                    lp
                    if reference is lm
                    else rollout_logprobs(reference, ro, temperature, share_prefix=share).logprobs
                )
                result.kl_per_sequence += sequence_kl(
                    estimate_kl(lp, ref_lp, "k1"), ro.response_mask
                ).tolist()
            for key, scorer in scorers.items():
                # None: the sample is left out of this scorer's numbers
                scores = score_rollout(
                    scorer, ro, f"held-out evaluation ({name}, {key} scorer)", state=state
                ).total
                result.scores[key] += [None if math.isnan(x) else x for x in scores]
            if fluency is not None:
                judged = [n for n in range(len(batch)) if (i + n) % k < (settings.fluency_samples or k)]
                nll = fluency([ro.prompts[n] for n in judged], [ro.own_texts[n] for n in judged])
                row: list[float | None] = [None] * len(batch)
                for n, v in zip(judged, nll):
                    row[n] = v
                result.fluency_nll += row
            result.responses += ro.own_texts  # the policy's own text: what diversity reads
            turns = [ro.turn_row(n) for n in range(len(batch))]
            if turns and "env" in turns[0]:  # multi-turn: what the scorers read, and the tool's part
                result.transcripts += ro.responses
                result.env += [t["env"] for t in turns]
    return result


def compare(before: EvalResult, after: EvalResult) -> dict:
    """Gains after - before on the same prompts: per scorer (paired by prompt, and unpaired),
    the fluency NLL's change (nats per token; positive = less fluent) and each diversity
    number's change, with standard errors.

    ``gain_se_paired`` (the one tether prints) is the standard error of the mean per-prompt
    difference. :func:`evaluate` draws sample ``j`` of prompt ``i`` with the same seed for both
    models (common random numbers), so the two scores of a prompt are correlated and their
    difference is the quantity to average; ``gain_se_unpaired`` = sqrt(SE_before^2 + SE_after^2)
    ignores that correlation and, when it is positive, overstates the error (kept for
    comparison with evaluations drawn independently). Each ``*_z`` is the change over its
    SE, None when that SE is 0."""
    k = before.samples_per_prompt
    sb, sa = before.summary(), after.summary()
    out = {"n_prompts": len(before.responses) // k, "samples_per_prompt": k, "reference": sb, "policy": sa}
    for key in before.scores:
        # per prompt, where both models have a scored sample (an unscored one is left out)
        pairs = zip(
            prompt_means(after.scores[key], k, keep_empty=True),
            prompt_means(before.scores[key], k, keep_empty=True),
        )
        diffs = [a - b for a, b in pairs if a is not None and b is not None]
        gain, paired_se = mean_se(diffs)
        unpaired_se = math.sqrt(sb[f"{key}_se"] ** 2 + sa[f"{key}_se"] ** 2)
        prefix = "" if key == "proxy" else f"{key}_"
        out[f"{prefix}gain"] = gain
        out[f"{prefix}gain_se_paired"] = paired_se
        out[f"{prefix}gain_se_unpaired"] = unpaired_se
        # a z needs a spread: with an SE of 0 (every prompt's difference equal, or one prompt) it
        # is None, printed "n/a", not the infinity a division by 0 would claim
        out[f"{prefix}gain_z_paired"] = gain / paired_se if paired_se > 0 else None
        out[f"{prefix}gain_z_unpaired"] = gain / unpaired_se if unpaired_se > 0 else None
        passed_before, passed_after = before.pass_at(key), after.pass_at(key)
        if passed_before and passed_after:  # a checker: pass@k's change, paired by prompt
            for j in passed_before:
                diffs = [a - b for a, b in zip(passed_after[j], passed_before[j])]
                out[f"{prefix}pass@{j}_gain"], out[f"{prefix}pass@{j}_gain_se_paired"] = mean_se(diffs)
    for key in ("fluency_nll_mean", *DIVERSITY_KEYS):
        base = key.removesuffix("_mean")
        se_key = f"{base}_se"
        if key in sb and key in sa:
            change = sa[key] - sb[key]
            se = math.sqrt(sa[se_key] ** 2 + sb[se_key] ** 2)
            out[f"{base}_change"], out[f"{base}_change_se"] = change, se
            out[f"{base}_change_z"] = change / se if se > 0 else None
    return out


class CapabilityProbe:
    """``eval/capability_nll``: the per-token NLL (nats per token) of fixed human-written
    sentences no run trains on (:func:`tether.data.capability.capability_texts`) under a policy,
    beside the reference's on the same sentences, the alignment tax of the seeds. Each sentence is
    scored given its first word (:func:`tether.judges.fluency.continuation_nll`), so every
    tokenizer, with or without a BOS token, scores the same words.

    Args:
        texts: the sentences. tokenizer: the policy's. reference: the frozen reference LM, scored
            once (on the first :meth:`measure`). batch_size: rows per forward (eval.batch_size).
    """

    def __init__(self, texts: list[str], tokenizer, reference, batch_size: int):
        firsts = [t.split(maxsplit=1) for t in texts]
        self.prefixes = [f[0] for f in firsts]
        self.rests = [" " + f[1] for f in firsts]
        self.tokenizer, self.reference, self.batch_size = tokenizer, reference, batch_size
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.ref_nll: list[float] | None = None
        self.ref_token_logprobs: list[list[float] | None] | None = None
        """The reference's log-prob of each token of each sentence, once scored (or read back)."""
        self.token_logprobs: list[list[float] | None] | None = None
        """The last measured policy's, the same way."""
        self.seconds = 0.0  # the last policy measurement's

    def logprobs(self, lm) -> list[list[float] | None]:
        """Each sentence's per-token log-probs under ``lm`` (no grad, its current mode kept; None
        for a sentence with no token after its first word)."""

        was_training = lm.training
        lm.eval()
        try:
            out = continuation_logprobs(
                lm,
                self.tokenizer,
                prefixes=self.prefixes,
                continuations=self.rests,
                batch_size=self.batch_size,
                pad_id=self.pad_id,
            )
        finally:
            lm.train(was_training)
        return out

    def nll(self, lm) -> list[float | None]:
        """Each sentence's per-token NLL under ``lm`` (the mean of :meth:`logprobs`, negated)."""
        return mean_nll(self.logprobs(lm))

    def fallen(self, top: int = 20) -> list[dict]:
        """The probe's tokens whose log-probability fell most from the reference to the last
        measured policy (``ref_logprob - logprob``, nats, largest first): the sentence's words
        before the token, the token, both log-probs. [] before both are measured."""
        if self.token_logprobs is None or self.ref_token_logprobs is None:
            return []
        falls = []
        for s, (pol, ref) in enumerate(zip(self.token_logprobs, self.ref_token_logprobs)):
            if pol is None or ref is None or len(pol) != len(ref):
                continue
            falls += [(b - a, s, t, a, b) for t, (a, b) in enumerate(zip(pol, ref))]
        falls.sort(key=lambda f: (-f[0], f[1], f[2]))
        out = []
        for fall, s, t, a, b in falls[:top]:
            ids = self.tokenizer(self.rests[s], add_special_tokens=False).input_ids
            out.append(
                {
                    "sentence": s,
                    "context": self.prefixes[s] + self.tokenizer.decode(ids[:t]),
                    "token": self.tokenizer.decode(ids[t : t + 1]),
                    "logprob": a,
                    "ref_logprob": b,
                    "fall": fall,
                }
            )
        return out

    def measure(self, lm) -> dict:
        """``capability_nll`` (the policy's mean), ``ref_capability_nll`` (the reference's),
        ``capability_nll_change`` and ``capability_nll_change_se`` (the paired per-sentence
        difference's mean and SE), nats per token, and ``capability_seconds`` (the policy's
        forward passes)."""
        if self.ref_nll is None:
            self.ref_token_logprobs = self.logprobs(self.reference)
            self.ref_nll = mean_nll(self.ref_token_logprobs)
        t0 = time.perf_counter()
        self.token_logprobs = self.logprobs(lm)
        pol = mean_nll(self.token_logprobs)
        self.seconds = time.perf_counter() - t0
        pairs = [(a, b) for a, b in zip(pol, self.ref_nll) if a is not None and b is not None]
        change, se = mean_se([a - b for a, b in pairs])
        return {
            "capability_nll": sum(a for a, _ in pairs) / len(pairs),
            "ref_capability_nll": sum(b for _, b in pairs) / len(pairs),
            "capability_nll_change": change,
            "capability_nll_change_se": se,
            "capability_seconds": self.seconds,
        }


class Evaluator:
    """Held-out evaluation with the proxy (training scorer), the gold judge and the fluency judge,
    the same samples for each; the reference's numbers on the periodic prompts are kept, so that
    every periodic row carries them (``eval/ref_*``) for the health rules and eval.best_by."""

    def __init__(self, run: Run, judge: Scorer | None, fluency=None):
        self.run, c = run, run.config
        self.scorers: dict[str, Scorer] = {"proxy": run.scorer}
        if judge is not None:
            self.scorers["gold"] = judge
        self.fluency = fluency
        self.eval_settings = EvalSettings(
            seed=c.eval.seed,
            batch_size=c.eval.batch_size,
            samples_per_prompt=c.eval.samples_per_prompt,
            fluency_samples=c.eval.fluency_samples,
            share_prefix=c.model.share_prompt_prefix,
        )
        # every judging call's trainer_state: the end of training (reference and policies alike)
        self.state = evaluation_state(
            c.train.steps, c.rollout.batch_size / (c.rollout.group_size or 1), len(run.train_prompts)
        )
        self.periodic = run.heldout_prompts[: c.eval.periodic_prompts]
        # eval.best_by chooses the policy on the periodic prompts: the final evaluation then uses
        # the held-out prompts after them, so the kept policy's numbers are not biased up by the
        # choice (the periodic set has the luck the choice selected for)
        start = len(self.periodic) if c.eval.best_by != "none" else 0
        left = len(run.heldout_prompts) - start
        if start and c.eval.n_prompts and left < c.eval.n_prompts and D.is_main():
            log.warning(
                "tether: warning: eval.best_by: %d held-out prompts after the %d periodic ones the best "
                "step is chosen on; %s (more data, or a larger data.heldout_fraction)",
                max(left, 0),
                start,
                f"the final evaluation has {left} of eval.n_prompts={c.eval.n_prompts}"
                if left > 0
                else "the final evaluation uses the periodic prompts too, so its numbers for the kept "
                "policy are biased up by the choice",
            )
        self.use_window(start if left > 0 else 0)
        self.reference_periodic: dict | None = None
        n = c.eval.capability_texts or 0
        reference = getattr(run, "reference", None)
        # the alignment tax: NLL of human text no run trains on, policy against reference
        self.capability = (
            CapabilityProbe(capability_texts(n), run.tokenizer, reference, c.eval.batch_size)
            if n and reference is not None and D.is_main()
            else None
        )

    def measure_capability(self) -> dict:
        """:meth:`CapabilityProbe.measure` of the policy now. The reference's per-sentence NLLs are
        kept in eval_reference_capability.json, so that a resumed run does not score (and count,
        ``kl/reference_forwards``) the reference again."""
        probe, path = self.capability, self.run.writer.run_dir / "eval_reference_capability.json"
        if probe.ref_nll is None and path.exists():
            saved = read_json(path)
            if saved.get("texts") == len(probe.prefixes):
                probe.ref_nll = saved["nll"]
                tokens = saved.get("token_logprobs")  # a run from before it has none: no fallen tokens
                probe.ref_token_logprobs = tokens if isinstance(tokens, list) else None
        fresh = probe.ref_nll is None
        m = probe.measure(self.run.policy.lm)
        if fresh:
            write_json_file(
                path,
                {
                    "texts": len(probe.prefixes),
                    "nll": probe.ref_nll,
                    "token_logprobs": probe.ref_token_logprobs,
                },
            )
        return m

    def capability_row(self) -> dict:
        """``eval/capability_nll``, ``eval/ref_capability_nll`` and
        ``eval/capability_nll_change_se`` of the policy now ({} when eval.capability_texts=0)."""
        if self.capability is None:
            return {}
        m = self.measure_capability()
        return {
            "eval/capability_nll": m["capability_nll"],
            "eval/ref_capability_nll": m["ref_capability_nll"],
            "eval/capability_nll_change_se": m["capability_nll_change_se"],
        }

    def use_window(self, start: int) -> None:
        """Take the final evaluation's eval.n_prompts held-out prompts from index ``start``."""
        self.start = start
        self.heldout = self.run.heldout_prompts[start : start + self.run.config.eval.n_prompts]

    def settings(self) -> dict:
        """The settings a held-out evaluation's numbers depend on besides its prompts and model:
        how samples are drawn (rollout.*, multi-turn included), how many, and who scores them
        (reward, eval.judge, the fluency judge). Kept with the reference's evaluation, so that a
        resume that changes one does not compare the policy with a reference sampled or scored
        another way (:func:`reference_eval`)."""
        c = self.run.config
        e = c.eval
        return {
            **c.rollout.sampling_fields(),
            "eval.seed": e.seed,
            "eval.n_prompts": e.n_prompts,
            "eval.samples_per_prompt": e.samples_per_prompt,
            "eval.judge": e.judge,
            "eval.fluency_model": getattr(self.run, "fluency_model", None) or e.fluency_model,
            "eval.fluency_samples": e.fluency_samples,
            "reward": c.to_dict(resolved=False)["reward"],
        }

    def __call__(self, name: str, prompts: list[str], lm: nn.Module | None = None):
        """:func:`evaluate` of ``lm`` (the policy's LM by default) on ``prompts`` with the run's
        settings."""
        run = self.run
        return evaluate(
            name,
            lm if lm is not None else run.policy.lm,
            reference=run.reference,
            prompts=prompts,
            sampler=run.sampler,  # the run's: one turn, or tool turns as in training
            scorers=self.scorers,
            settings=self.eval_settings,
            fluency=self.fluency,
            state=self.state,
        )

    def set_reference(self, before: EvalResult | None, lm: nn.Module | None = None) -> None:
        """The reference's summary on the periodic prompts: the first of its full held-out
        evaluation's (the same seeds give the same samples), or evaluated now when the periodic
        set is the larger: of ``lm``, the policy's LM by default (call before training moves the
        policy), or the frozen reference."""
        if not self.run.config.eval.every or not self.periodic:
            return
        if self.covers_periodic(before):
            self.reference_periodic = before.head(len(self.periodic)).summary()
        else:
            self.reference_periodic = self("reference", self.periodic, lm=lm).summary()

    def covers_periodic(self, before: EvalResult | None) -> bool:
        """Whether the reference's full evaluation holds every sample of the periodic prompts (it
        starts with them unless eval.best_by moved the final evaluation past them)."""
        return (
            before is not None
            and self.start == 0
            and len(before.responses) >= len(self.periodic) * before.samples_per_prompt
        )

    def periodic_row(self) -> dict:
        return (
            eval_row(self("periodic", self.periodic).summary(), self.reference_periodic)
            | self.capability_row()
        )


PERIODIC_KEYS = {
    "proxy_score": "proxy_mean",
    "gold_score": "gold_mean",
    "fluency_nll": "fluency_nll_mean",
    "fluency_nll_se": "fluency_nll_se",
    "distinct_1": "distinct_1",
    "distinct_2": "distinct_2",
    "distinct_2_se": "distinct_2_se",
    "self_bleu": "self_bleu",
    "repetition": "repetition",
    "repetition_se": "repetition_se",
}
"""Metric name after ``eval/`` (or ``eval/ref_``) -> key of :meth:`EvalResult.summary`."""


def periodic_numbers(summary: dict, prefix: str) -> dict:
    """The periodic evaluation's metrics from an evaluation summary, names prefixed."""
    return {prefix + name: summary[key] for name, key in PERIODIC_KEYS.items() if key in summary}


def eval_row(policy: dict, reference: dict | None) -> dict:
    """The ``eval/*`` metrics of a policy's evaluation summary (:meth:`EvalResult.summary`) beside
    the reference's on the same prompts (``eval/ref_*``), NaN dropped (no reference, no self-BLEU):
    a periodic row, or the final evaluation's row for :data:`tether.run.monitor.HELDOUT_RULES`."""
    row = {"eval/kl": policy["kl"], **periodic_numbers(policy, "eval/")}
    if reference is not None:
        row.update(periodic_numbers(reference, "eval/ref_"))
    return {k: v for k, v in row.items() if v == v}


def changed_settings(saved: dict, evaluator: Evaluator) -> list[str]:
    """``"field: old -> new"`` for each of :meth:`Evaluator.settings` a kept reference evaluation
    (``saved``, with its ``settings``) was made with and this config changed ([] for a file from
    before the settings were kept: nothing to compare). A setting that names an object passed
    from Python (an environment, a reward: ``(from Python) module:name``) counts as changed
    whatever its name: two objects of one name (two ``functools.partial``, two instances of a
    class) may differ, and config.yaml keeps no more than the name to tell."""
    old, now = saved.get("settings"), evaluator.settings()
    if old is None:
        return []
    return [
        f"{k}: {old.get(k)!r} -> {v!r}"
        if old.get(k) != v
        else f"{k}: an object passed from Python ({v!r}), which cannot be compared with the one before"
        for k, v in now.items()
        if old.get(k) != v or PASSED_FROM_PYTHON in repr(v)
    ]


def stale_reference(saved: dict, evaluator: Evaluator, what: str) -> bool:
    """Whether a resume's kept reference evaluation (``what``, its file) was made with other
    sampling or scoring settings (:func:`changed_settings`) and is to be made again. With the
    frozen reference at hand it is (said); without one (a run with no reference) the kept one
    stays, with a warning that the comparison mixes settings."""
    changed = changed_settings(saved, evaluator)
    if not changed:
        return False
    if evaluator.run.reference is not None:
        log.warning(
            "tether: warning: %s was made with other settings (%s); evaluating the frozen reference "
            "again with this config's, so that the policy is compared with it on the same terms",
            what,
            "; ".join(changed),
        )
        return True
    log.warning(
        "tether: warning: %s was made with other settings (%s), and this run has no frozen reference "
        "to evaluate again: the reference-vs-policy comparison mixes the two settings",
        what,
        "; ".join(changed),
    )
    return False


def reference_eval(evaluator: Evaluator, run_dir: Path, show: bool):
    """The reference's held-out evaluation, computed once and kept in eval_reference.json with
    :meth:`Evaluator.settings`; evaluated again (from the frozen reference) when a resume changed
    one (:func:`stale_reference`)."""
    if not evaluator.heldout:
        return None
    path = run_dir / "eval_reference.json"
    lm = None  # the policy's LM: the reference before the first step
    if path.exists() and stale_reference(read_json(path), evaluator, "the reference's held-out evaluation"):
        lm = evaluator.run.reference
    elif path.exists():
        saved = read_json(path)
        offset = saved.get("prompt_offset", 0)  # files from before eval.best_by moved it: 0
        if offset != evaluator.start:
            # a resume that changed eval.best_by: the policy must be compared on the reference's
            # prompts (the reference can no longer be sampled from the moved policy)
            log.warning(
                "tether: warning: the reference's held-out evaluation (eval_reference.json) used the "
                "held-out prompts from index %d, this config's final evaluation those from %d; the final "
                "evaluation keeps the reference's (%s)",
                offset,
                evaluator.start,
                "prompts the best step is chosen on included" if offset == 0 else "after the periodic ones",
            )
            evaluator.use_window(offset)
        return EvalResult.from_json(saved)
    before = evaluator("reference", evaluator.heldout, lm=lm)  # evaluate() forks the RNG
    write_json_file(
        path, before.to_json() | {"prompt_offset": evaluator.start, "settings": evaluator.settings()}
    )
    s = before.summary()
    say(
        f"tether: reference held-out proxy score {mean_text(s['proxy_mean'], s['proxy_se'])}"
        + (f", gold {mean_text(s['gold_mean'], s['gold_se'])}" if "gold_mean" in s else "")
        + f" (n={len(evaluator.heldout)}{unscored_note(s)})",
        show,
    )
    return before


def mean_text(mean: float, se: float) -> str:
    """A mean score with its standard error, ``0.412 ± 0.031``, or ``n/a: no sample was scored``
    (every score None: the mean of none is NaN)."""
    if number(mean) == "n/a":
        return "n/a: no sample was scored"
    return change_text(mean, se, ".3f")


def gain_text(result: dict) -> str:
    """The final evaluation's proxy gain with its paired SE and z, or what stands in for it where
    no prompt has a sample the reward scored under both models."""
    if number(result["gain"]) == "n/a":
        return "no gain: no prompt has a scored sample of both the reference and the policy"
    gain = change_text(result["gain"], result["gain_se_paired"])
    return f"gain {gain} SE, z = {z_text(result['gain_z_paired'])}"


def unscored_note(summary: dict) -> str:
    """``, 3 of 16 samples unscored`` when the proxy scorer returned None for some samples of an
    evaluation (:meth:`EvalResult.summary`: they are left out of its numbers), else ``""``."""
    n = summary.get("proxy_unscored")
    return f"; {n} of {summary['n']} samples unscored, left out" if n else ""


def auto_fluency_model(run: Run) -> str:
    """What ``eval.fluency_model=auto`` is on this run, said once: the embedded judge on the demo's
    data, with ``eval.best_fluency_margin``, or where its compute is at most
    :data:`tether.judges.fluency.AUTO_SHARE` of the training's
    (:func:`tether.judges.fluency.fluency_cost_share`); else ``none``."""
    from tether.judges import fluency as F

    c = run.config
    name = F.DEFAULT_FLUENCY_MODEL
    if c.embedded_data or c.eval.best_fluency_margin is not None:
        return name
    e, r = c.eval, c.rollout
    per_eval = e.fluency_samples
    judged = (
        e.n_prompts * 2 + e.periodic_prompts * ((c.train.steps // e.every if e.every else 0) + 1)
    ) * per_eval
    dpo = c.train.algo == "dpo"
    rows = r.batch_size * (2 if dpo else 1)  # DPO: a chosen and a rejected response per pair
    forwards = (1 if dpo else 3) + 3 * c.optim.epochs  # reference (+ sampling, old policy); updates
    policy_params = sum(p.numel() for p in run.policy.lm.parameters())
    share = F.fluency_cost_share(
        judge_params=F.JUDGE_PARAMS[name],
        judged_responses=judged,
        policy_params=policy_params,
        trained_sequences=c.train.steps * rows,
        forwards_per_sequence=forwards,
        tokens=(r.max_prompt_tokens or 1) + r.max_new_tokens,
    )
    on = share <= F.AUTO_SHARE
    if D.is_main():
        print(
            f"tether: eval.fluency_model=auto: {name if on else 'none'}: the fluency judge ({name}, "
            f"{F.JUDGE_PARAMS[name] / 1e6:.0f}M parameters, about {judged} responses) would add about "
            f"{share:.0%} to the training's compute ({c.train.steps} steps of {rows} sequences on a "
            f"{policy_params / 1e6:.0f}M policy), {'within' if on else 'over'} the {F.AUTO_SHARE:.0%} "
            f"it is allowed on data other than the demo's"
            + ("" if on else f"; eval.fluency_model={name} turns it on")
        )
    return name if on else "none"


def fluency_judge(run: Run):
    """The fluency judge of eval.fluency_model on rank 0 (the one that evaluates), or None;
    ``auto`` resolved first (:func:`auto_fluency_model`) into ``run.fluency_model``, which the
    evaluation records (the config keeps ``auto``: a resume decides again)."""
    c = run.config
    run.fluency_model = c.eval.fluency_model
    if c.eval.fluency_model == "auto":
        used = (c.eval.n_prompts or c.eval.every) and run.heldout_prompts
        run.fluency_model = auto_fluency_model(run) if used else "none"
    if run.fluency_model == "none" or not D.is_main() or not run.heldout_prompts:
        return None
    if not (c.eval.n_prompts or c.eval.every):
        return None
    from tether.judges.fluency import FluencyJudge

    device = run.accelerator.device if run.accelerator is not None else "cpu"
    return FluencyJudge(run.fluency_model, device)


def reference_periodic(evaluator: Evaluator, before, run_dir: Path, resume: bool) -> None:
    """The reference's numbers on the periodic prompts, computed before the first step and kept
    in eval_reference_periodic.json (a resumed run's policy is no longer the reference)."""
    path = run_dir / "eval_reference_periodic.json"
    lm = None  # the policy's LM: the reference before the first step
    if path.exists():
        saved = read_json(path)
        if not stale_reference(saved, evaluator, "the reference's periodic evaluation"):
            evaluator.reference_periodic = {k: v for k, v in saved.items() if k != "settings"}
            return
        lm = evaluator.run.reference
    elif resume and not evaluator.covers_periodic(before):
        return  # an older run without it, whose policy has moved: no reference numbers
    evaluator.set_reference(before, lm=lm)
    if evaluator.reference_periodic is not None:
        write_json_file(path, evaluator.reference_periodic | {"settings": evaluator.settings()})


def final_evaluation(
    *, run: Run, evaluator: Evaluator, monitor, before: EvalResult, best: dict | None, reporter=None
) -> list[dict]:
    """The final held-out evaluation: the policy (``best``'s step's when eval.best_by restored
    one) against the reference's ``before`` on the same prompts, written to eval.json (with the
    capability probe's numbers), said with SEs, and read by the held-out health rules
    (:data:`tether.run.monitor.HELDOUT_RULES`; ``monitor`` a :class:`tether.run.monitor.HealthMonitor`).

    Returns:
        ``[reference summary, policy summary]``, for the score-against-KL plot.
    """
    c, w, show = run.config, run.writer, run.config.train.progress
    after = evaluator("policy", evaluator.heldout)
    result = compare(before, after)  # holds both summaries: computed once, here
    result["policy_step"] = best["step"] if best else w.history[-1]["step"]
    result["prompt_offset"] = evaluator.start  # index of its first held-out prompt
    if evaluator.capability is not None:
        result |= evaluator.measure_capability() | {"capability_texts": c.eval.capability_texts}
        # the tokens of human text whose log-probability fell most (kl.attribution's probe side)
        result["capability_fallen"] = evaluator.capability.fallen()
    w.write_json("eval.json", result)
    if reporter is not None:  # a tether.run.reporting.Reporter: trackers and callbacks
        reporter.final_evaluation(result)
    evals = [result["reference"], result["policy"]]
    gold = (
        f"; gold {change_text(result['gold_gain'], result['gold_gain_se_paired'])}"
        if number(result.get("gold_gain")) != "n/a"
        else "; gold n/a (no prompt has a sample the judge scored for both)"
        if "gold_gain" in result
        else ""
    )
    ref, pol = result["reference"], result["policy"]
    proxy = (
        f"{number(ref['proxy_mean'])} -> {number(pol['proxy_mean'])} ({gain_text(result)}"
        f"{unscored_note(pol)})"
        if number(ref["proxy_mean"]) != "n/a" or number(pol["proxy_mean"]) != "n/a"
        else f"n/a: no sample was scored (the reward returned None for all {ref['n']} of the reference's "
        f"samples and all {pol['n']} of the policy's)"
    )
    say(
        f"tether: held-out proxy score {proxy}{gold}; "
        + (
            f"held-out KL {after.kl:.2f} nats/seq"
            if after.kl == after.kl
            else "held-out KL not measured (no reference model: kl.kl_coef=0 and kl.monitor=false)"
        ),
        show,
    )
    say(leash_line(result), show)
    if "capability_nll" in result:
        say(
            f"tether: capability (NLL of {result['capability_texts']} human sentences no run trains on, "
            f"NYT editorials): {result['ref_capability_nll']:.3f} -> {result['capability_nll']:.3f} "
            f"nats/token ({result['capability_nll_change']:+.3f} ± "
            f"{result['capability_nll_change_se']:.3f}); "
            f"{result['capability_seconds']:.1f} s per evaluation (eval.capability_texts=0 turns it off)",
            show,
        )
    final_row = {"step": result["policy_step"], **eval_row(result["policy"], result["reference"])}
    if "capability_nll" in result:
        final_row |= {
            "eval/capability_nll": result["capability_nll"],
            "eval/ref_capability_nll": result["ref_capability_nll"],
            "eval/capability_nll_change_se": result["capability_nll_change_se"],
        }
    for alarm in monitor.check([*w.history, final_row], HELDOUT_RULES):
        say(
            f"tether: WARNING [{alarm.rule}] final held-out evaluation (policy of step {alarm.step}): "
            f"{alarm.message}.\n  likely cause: {alarm.cause}\n  fix: {alarm.fix}",
            show,
        )
        if reporter is not None:
            reporter.alarm(alarm)
    return evals
