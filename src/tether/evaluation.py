"""Held-out evaluation: score and KL of a policy on prompts it never trained on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tether.kl import estimate_kl, sequence_kl
from tether.rollout import generate, score_logprobs
from tether.scorers import Scorer, checked_scores


@dataclass
class EvalResult:
    name: str
    scores: list[float]
    kl_per_sequence: list[float]
    """k1 per sequence (nats) of each sample, against the reference."""
    responses: list[str]

    @property
    def score_mean(self) -> float:
        return sum(self.scores) / len(self.scores)

    @property
    def score_se(self) -> float:
        n = len(self.scores)
        m = self.score_mean
        return math.sqrt(sum((s - m) ** 2 for s in self.scores) / max(n - 1, 1) / n)

    @property
    def kl(self) -> float:
        return sum(self.kl_per_sequence) / len(self.kl_per_sequence)

    def summary(self) -> dict:
        return {"name": self.name, "n": len(self.scores), "score_mean": self.score_mean,
                "score_se": self.score_se, "kl": self.kl}


@torch.no_grad()
def evaluate(
    name: str,
    lm: nn.Module,
    reference: nn.Module,
    tokenizer,
    prompts: list[str],
    scorer: Scorer,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int = 64,
    max_prompt_tokens: int = 64,
) -> EvalResult:
    """Sample one response per held-out prompt with a fixed seed and score it.

    The global torch RNG is forked, so evaluation never changes the training stream. KL is the
    k1 estimate per sequence (unbiased) against ``reference`` on the evaluated samples.
    """
    scores, kls, texts = [], [], []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(prompts), batch_size):
            ro = generate(lm, tokenizer, prompts[i : i + batch_size], max_new_tokens, temperature, max_prompt_tokens)
            lp = score_logprobs(lm, ro, temperature).logprobs
            ref_lp = lp if reference is lm else score_logprobs(reference, ro, temperature).logprobs
            kls += sequence_kl(estimate_kl(lp, ref_lp, "k1"), ro.response_mask).tolist()
            scores += checked_scores(scorer, ro.responses, step=-1)
            texts += ro.responses
    return EvalResult(name, scores, kls, texts)


def compare(before: EvalResult, after: EvalResult) -> dict:
    """Score gain after - before on the same prompts, with paired and unpaired standard errors."""
    diffs = [a - b for a, b in zip(after.scores, before.scores)]
    n = len(diffs)
    gain = sum(diffs) / n
    paired_se = math.sqrt(sum((d - gain) ** 2 for d in diffs) / max(n - 1, 1) / n)
    unpaired_se = math.sqrt(before.score_se**2 + after.score_se**2)
    return {
        "n_prompts": n,
        "reference": before.summary(),
        "policy": after.summary(),
        "gain": gain,
        "gain_se_paired": paired_se,
        "gain_se_unpaired": unpaired_se,
        "gain_z_unpaired": gain / unpaired_se if unpaired_se > 0 else float("inf"),
    }
