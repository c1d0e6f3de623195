"""GRPO with a calculator tool on the built-in arithmetic task: multi-turn rollouts, offline.

The prompts are tether's two-digit additions (``data.prompts=arithmetic``), with worked examples
that call a calculator::

    12 + 35 = calc(12 + 35) -> 47
    23 + 41 = calc(23 + 41) -> 64
    58 + 17 =

A policy turn ends at ``)`` (``rollout.stop_strings``); the tool (:func:`calculator`, named by
``rollout.env``) reads the last ``calc(a + b)`` of the transcript and answers `` -> 75`` and a
newline, which the policy reads as context (no KL, no loss on it) before its next turn
(``rollout.max_turns=2``). The reward is 1 when the transcript's answer (after its first
``->``, the tool's, or the response's leading integer when the policy did not call the tool) is the
problem's ``answer``: a 0/1 reward. samples.jsonl lists what the tool wrote under ``env``.

    python examples/grpo_calculator_tool.py            # the embedded SmolLM2-135M, under a minute
    python examples/grpo_calculator_tool.py --tiny     # a tiny random model, seconds (checks the script)

(A tiny random model never writes ``calc(...)``, so ``--tiny`` checks the script's wiring only;
the tool turns themselves are tested on tiny models in ``tests/e2e/test_turns.py``.)

On the embedded SmolLM2-135M (4 steps of 8 samples, 48 s on a 2-core CPU) the model follows the
worked examples and calls the tool in most samples: scores 0.875, 1.000, 0.750, 0.875 in steps
0-3, 17.4-18.9 policy tokens and 4.4-5.4 tool tokens per response, step-0 KL exactly 0.0 and
first ratio exactly 1, sampler against learner 6.5e-12 nats per token. A samples.jsonl row::

    "response": " calc(64 + 14) -> 78\n78 + 19 = calc(7", "score": 1.0, "columns": {"answer": "78"},
    "env": [" -> 78\n"], "policy_tokens": 19, "env_tokens": 5

(the policy goes on past its answer with the next problem of the pattern, cut by the token budget
and the turn limit). The task is easy with the tool, so this shows the wiring, not a gain.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

SHOTS = "12 + 35 = calc(12 + 35) -> 47\n23 + 41 = calc(23 + 41) -> 64\n"
"""The worked examples before every problem: each calls the calculator."""

_CALL = re.compile(r"calc\(\s*(-?\d{1,9})\s*([-+*])\s*(-?\d{1,9})\s*\)\s*$")
_ANSWER = re.compile(r"->\s*(-?\d+)")
_LEADING = re.compile(r"\s*(-?\d+)")


def calculator(prompt: str, completion: str, turn: int, **columns) -> str | None:
    """The tool: the value of the ``calc(a op b)`` the policy's turn ended with (op one of + - *),
    as `` -> value`` and a newline; None (the episode ends) when the turn did not end with a call."""
    m = _CALL.search(completion)
    if m is None:
        return None
    a, op, b = int(m[1]), m[2], int(m[3])
    return f" -> {a + b if op == '+' else a - b if op == '-' else a * b}\n"


def final_answer(text: str) -> str | None:
    """The answer a transcript gives: the number after its first ``->`` (the tool's), else its
    leading integer (the policy answered alone), else None."""
    m = _ANSWER.search(text) or _LEADING.match(text)
    return m[1] if m else None


def answer_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 where the transcript's :func:`final_answer` is the row's ``answer``, else 0.0."""
    return [1.0 if final_answer(c) == a else 0.0 for c, a in zip(completions, answer)]


def tool_rows(n: int) -> list[dict]:
    """The first ``n`` of tether's arithmetic problems (its fixed order), with :data:`SHOTS`."""
    from tether.data.tasks import SHOTS as PLAIN_SHOTS
    from tether.data.tasks import arithmetic_problems

    problems = arithmetic_problems()
    return [
        {"prompt": SHOTS + p[len(PLAIN_SHOTS) :], "answer": a}
        for p, a in zip(problems.prompts[:n], problems.columns["answer"][:n])
    ]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random model: checks the script in seconds"
    )
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default 4, or 2 with --tiny)")
    parser.add_argument("--out", default=None, help="run directory (default runs/grpo-<date-time>)")
    args = parser.parse_args(argv)

    from tether import load_config, train

    rows = tool_rows(200)
    steps = args.steps or (2 if args.tiny else 4)
    overrides = [
        "train.algo=grpo",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.max_new_tokens=24",  # the call, the tool's answer and a little more
        "rollout.env=grpo_calculator_tool:calculator",  # this file, importable from examples/
        "rollout.max_turns=2",
        "rollout.stop_strings=)",
        "optim.lr=5e-5",
        "optim.minibatch_size=8",
        f"train.steps={steps}",
        "data.heldout_fraction=0.1",
    ]
    from _tiny import small_run

    overrides += small_run(args.tiny, args.out)  # a short evaluation, no checkpoint, no saved policy
    config = load_config(None, overrides)
    objects = {}
    if args.tiny:
        from _tiny import tiny_policy, tiny_tokenizer

        tok = tiny_tokenizer([r["prompt"] for r in rows] + [" -> 75\n"])
        objects = {"model": tiny_policy(tok), "tokenizer": tok}
    run_dir = train(config, scorer=answer_reward, train_dataset=rows, **objects)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    keys = ("objective/scores", "response/length", "rollout/env_tokens", "objective/kl")
    print("last step: " + ", ".join(f"{k} {last[k]:.3f}" for k in keys if k in last))
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for sample in [s for s in samples if s["step"] == samples[-1]["step"]][:4]:  # the last step's
        print(f"  {sample['prompt'][len(SHOTS) :]!r} -> {sample['response']!r}  tool wrote {sample['env']}")
    return run_dir


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # for _tiny, and rollout.env's module
    main()
