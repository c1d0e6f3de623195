"""Built-in verifiable tasks: problems generated in code (offline, no download) with an
``answer`` column, for a checker reward (:mod:`tether.judges.verifiers`).

``data.prompts=arithmetic`` (:data:`ARITHMETIC`): two-digit addition, prompted few-shot,

    12 + 35 = 47
    23 + 41 = 64
    58 + 17 =

with ``answer`` the sum as a string ("75"). Every pair of operands in [10, 99] is one problem
(8,100; the two worked examples are among them), in a fixed shuffled order (:data:`ORDER_SEED`),
so that any first N of them, as ``eval.n_prompts`` takes the held-out ones, are a uniform sample:
in operand order the first 128 held-out problems all had a first operand below 39, and the
reference solved 15.2% of them against 27.5% of all 394. The held-out ones are chosen by the
usual hash split of the prompt text (``data.heldout_fraction``), so the same problems are held
out in every run. The embedded SmolLM2-135M solves 27.5% +- 1.9% (SE) of the 394 held-out
problems at the default temperature 1 with ``reward.scorer=integer-answer`` (tether's held-out
evaluation, 2 samples each; 29.7% +- 2.3% with one sample each, seeds ``sample_seeds(1234, 0, i)``):
hard enough to learn, common enough to give a gradient.
"""

from __future__ import annotations

import random

from tether.data.prompts import PromptData

ARITHMETIC = "arithmetic"
"""``data.prompts`` name of the two-digit addition task."""

SHOTS = "12 + 35 = 47\n23 + 41 = 64\n"
"""The arithmetic task's two worked examples, before every problem."""

ORDER_SEED = 31
"""Seed of the fixed shuffle of the arithmetic problems (``random.Random(ORDER_SEED)``)."""

TASKS = (ARITHMETIC,)
"""The built-in verifiable tasks, by ``data.prompts`` name."""

TASK_SCORERS = {ARITHMETIC: "integer-answer"}
"""Each task's checker, the ``reward.scorer`` it fills when that is unset."""

TASK_SETTINGS = {
    ARITHMETIC: {"rollout.max_new_tokens": 5, "optim.lr": 5e-5, "kl.budget": 0.5, "anchor.coef": 3.0}
}
"""The settings each task was measured at and recommends (README, "Verifiable rewards";
benchmarks/rlvr.py), which a run left at the demo's defaults is told about when it starts. For
arithmetic: 5 tokens hold the answer and a newline; at the demo's 16 tokens and lr 3e-4 the
held-out accuracy fell (-0.059 +- 0.027 over 40 steps), at these it rose. The leash and the
anchor (issue 54's matrix, 3 seeds): the budget at 0.5 nats per sequence with the text anchor at
weight 3 kept the capability probe within 1 SE of 0, 99% of beta 0's pass@1 gain and pass@16 at
the reference's less 0.013 (its SE: 0.038); at 1 nat it kept the gain and the probe but lost 0.05
of pass@16, the default budget of 2.5 barely acted, and beta 0 narrowed pass@16 by 0.18."""


def arithmetic_problems() -> PromptData:
    """The 8,100 problems ``a + b`` for a, b in [10, 99], prompts with an ``answer`` column
    (the sum, a string), in a fixed shuffled order (the same in every run and process)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(ORDER_SEED).shuffle(pairs)
    return PromptData([f"{SHOTS}{a} + {b} =" for a, b in pairs], {"answer": [str(a + b) for a, b in pairs]})


def task_prompts(name: str) -> PromptData:
    """The problems of built-in task ``name`` (:data:`TASKS`).

    Raises:
        KeyError: not a built-in task.
    """
    if name == ARITHMETIC:
        return arithmetic_problems()
    raise KeyError(f"data.prompts={name!r} is not a built-in task ({', '.join(TASKS)})")
