"""Held-out evaluation: proxy score, gold score and KL of a policy on prompts it never trained on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from tether.core.kl import estimate_kl, sequence_kl
from tether.data.prompts import PromptData
from tether.judges.contract import Scorer, checked_scores
from tether.models.sampling import generate, sample_seeds
from tether.models.scoring import rollout_logprobs


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n)); (nan, nan) for an empty list."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / max(n - 1, 1) / n)


@dataclass
class EvalResult:
    name: str
    responses: list[str]
    kl_per_sequence: list[float]
    """k1 per sequence (nats) of each sample against the reference; empty without a reference."""
    scores: dict[str, list[float]] = field(default_factory=dict)
    """scorer name ('proxy', 'gold') -> one score per response."""

    @property
    def kl(self) -> float:
        return mean_se(self.kl_per_sequence)[0] if self.kl_per_sequence else float("nan")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "responses": self.responses,
            "kl_per_sequence": self.kl_per_sequence,
            "scores": self.scores,
        }

    @classmethod
    def from_json(cls, d: dict) -> EvalResult:
        return cls(d["name"], d["responses"], d["kl_per_sequence"], d["scores"])

    def summary(self) -> dict:
        out = {"name": self.name, "n": len(self.responses), "kl": self.kl}
        for key, xs in self.scores.items():
            m, se = mean_se(xs)
            out[f"{key}_mean"], out[f"{key}_se"] = m, se
        return out


@torch.no_grad()
def evaluate(
    name: str,
    lm: nn.Module,
    reference: nn.Module | None,
    tokenizer,
    prompts: PromptData | list,
    scorers: dict[str, Scorer],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int = 64,
    max_prompt_tokens: int = 64,
) -> EvalResult:
    """Sample one response per held-out prompt with a fixed seed; score it with every scorer.

    Prompt ``i`` is sampled with the seed ``sample_seeds(seed, 0, [i])``, whatever the batching,
    so reference and policy see the same random numbers on each prompt; the global torch RNG is
    forked (a scorer may draw from it), so evaluation never changes the training stream. KL is the
    k1 estimate per sequence (unbiased) against ``reference`` on the evaluated samples, with the
    sampling settings of training.
    """
    result = EvalResult(name, [], [], {k: [] for k in scorers})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            ro = generate(
                lm,
                tokenizer,
                batch,
                max_new_tokens,
                temperature,
                max_prompt_tokens,
                seeds=sample_seeds(seed, 0, range(i, i + len(batch))),
            )
            if reference is not None:
                lp = rollout_logprobs(lm, ro, temperature).logprobs
                ref_lp = lp if reference is lm else rollout_logprobs(reference, ro, temperature).logprobs
                result.kl_per_sequence += sequence_kl(
                    estimate_kl(lp, ref_lp, "k1"), ro.response_mask
                ).tolist()
            columns = batch.columns if isinstance(batch, PromptData) else None
            for key, scorer in scorers.items():
                result.scores[key] += checked_scores(
                    scorer, ro.responses, f"held-out evaluation ({name}, {key} scorer)", ro.prompts, columns
                )
            result.responses += ro.responses
    return result


def compare(before: EvalResult, after: EvalResult) -> dict:
    """Score gains after - before on the same prompts, per scorer, with standard errors."""
    out = {"n_prompts": len(before.responses), "reference": before.summary(), "policy": after.summary()}
    for key in before.scores:
        diffs = [a - b for a, b in zip(after.scores[key], before.scores[key])]
        gain, paired_se = mean_se(diffs)
        unpaired_se = math.sqrt(mean_se(before.scores[key])[1] ** 2 + mean_se(after.scores[key])[1] ** 2)
        prefix = "" if key == "proxy" else f"{key}_"
        out[f"{prefix}gain"] = gain
        out[f"{prefix}gain_se_paired"] = paired_se
        out[f"{prefix}gain_se_unpaired"] = unpaired_se
        out[f"{prefix}gain_z_unpaired"] = gain / unpaired_se if unpaired_se > 0 else float("inf")
    return out
