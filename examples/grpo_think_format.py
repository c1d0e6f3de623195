"""GRPO with conversational prompts, TRL's think-format reward and an accuracy reward.

A port of TRL 1.16's GRPO recipe (``trl/scripts/grpo.py``)::

    trl grpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name ... \
        --reward_funcs think_format_reward accuracy_reward --num_generations 4 ...

to tether, on a small arithmetic dataset this script builds (prompts as message lists with a
system prompt asking for ``<think>...</think>``, and an ``answer`` column). The rewards are
TRL's own ``trl.rewards.think_format_reward`` and an exact-match accuracy reward on the
``answer`` column (TRL's ``accuracy_reward`` needs the ``math_verify`` package); both get
exactly what TRL passes them (docs/trl.md, "The reward contract").

    python examples/grpo_think_format.py            # the embedded SmolLM2-135M-Instruct (see below)
    python examples/grpo_think_format.py --tiny     # a tiny random model, seconds (checks the script)

On the embedded model one step (16 completions of up to 48 tokens) took 102 s on this project's
busy 2-core CPU (3.5 min in all with loading and the two held-out evaluations, ``--steps 1``),
and both rewards were 0.000 in it: the script shows the wiring, not a result (a model that
already writes ``<think>`` blocks gives GRPO something to work with).

Needs ``trl`` for its reward function (``pip install -e '.[test]'``, or ``trl==1.16.0``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SYSTEM = "Think step by step inside <think> </think>, then give the answer."


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows ``{"prompt": [system, user], "answer": "a + b"}``: TRL's conversational
    prompt-only format, with the column the accuracy reward reads."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                ],
                "answer": str(a + b),
            }
        )
    return rows


def accuracy_reward(completions: list[list[dict]], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the text after ``</think>`` (or the whole completion) holds the row's answer.

    Args:
        completions: B conversational completions, each ``[{"role": "assistant", "content": text}]``.
        answer: the dataset's ``answer`` column, one per completion (repeated across a group).

    Returns:
        B floats in {0, 1}.
    """
    out = []
    for completion, gold in zip(completions, answer):
        final = completion[0]["content"].rsplit("</think>", 1)[-1]
        out.append(1.0 if gold in final.split() else 0.0)
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random model: checks the script in seconds"
    )
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default 8, or 2 with --tiny)")
    parser.add_argument("--out", default=None, help="run directory (default runs/grpo-<date-time>)")
    args = parser.parse_args(argv)

    from trl.rewards import think_format_reward

    from tether import load_config, train

    rows = arithmetic_rows(64)
    steps = args.steps or (2 if args.tiny else 8)
    overrides = [
        "train.algo=grpo",
        "rollout.group_size=4",  # TRL's num_generations
        "rollout.batch_size=8" if args.tiny else "rollout.batch_size=16",
        "rollout.max_new_tokens=8" if args.tiny else "rollout.max_new_tokens=48",  # max_completion_length
        "rollout.max_prompt_tokens=128",  # max_prompt_length (a longer prompt is an error, not cut)
        "rollout.temperature=1.0",
        "optim.lr=1e-5" if not args.tiny else "optim.lr=1e-4",
        "optim.epochs=1",  # num_iterations
        "optim.minibatch_size=8" if args.tiny else "optim.minibatch_size=16",
        "kl.kl_coef=0.04",  # beta (TRL 1.16's default is 0.0, no KL at all; tether warns of that)
        "kl.controller=fixed",
        "reward.weights=[1.0, 1.0]",  # reward_weights, one per function below
        f"train.steps={steps}",
        "data.heldout_fraction=0.1",
    ]
    from _tiny import small_run

    overrides += small_run(args.tiny, args.out)  # a short evaluation, no checkpoint, no saved policy
    config = load_config(None, overrides)
    objects = {}
    if args.tiny:
        from _tiny import tiny_policy, tiny_tokenizer

        tok = tiny_tokenizer([m["content"] for r in rows for m in r["prompt"]] + ["<think> </think> 12"])
        objects = {"model": tiny_policy(tok), "tokenizer": tok}
    run_dir = train(config, scorer=[think_format_reward, accuracy_reward], train_dataset=rows, **objects)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    keys = ("objective/scores", "reward/think_format_reward", "reward/accuracy_reward", "objective/kl")
    print("last step: " + ", ".join(f"{k} {last[k]:.3f}" for k in keys if k in last))
    return run_dir


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # for _tiny
    main()
