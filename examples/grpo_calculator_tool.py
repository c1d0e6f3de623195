"""GRPO with a calculator tool on the built-in arithmetic task: multi-turn rollouts, offline.

The prompts are tether's two-digit additions (``data.prompts=arithmetic``), with worked examples
that call a calculator::

    12 + 35 = calc(12 + 35) -> 47
    23 + 41 = calc(23 + 41) -> 64
    58 + 17 =

A policy turn ends at ``)`` (``rollout.stop_strings``); the tool (:func:`calculator`, named by
``rollout.env``) reads the last ``calc(a + b)`` of the transcript and answers `` -> 75`` and a
newline, which the policy reads as context (no KL, no loss on it) before its next turn
(``rollout.max_turns=2``). The reward is 1 when the answer is the problem's ``answer``: a 0/1
reward. The answer is what the tool returned (the reward's ``env_replies``: a transcript is one
string, and a policy that writes `` -> 90`` itself, without calling the tool, must not pass for
the tool), or the response's leading integer when the policy answered without calling it.
samples.jsonl lists what the tool wrote under ``env``.

    python examples/grpo_calculator_tool.py            # the embedded SmolLM2-135M, under a minute
    python examples/grpo_calculator_tool.py --tiny     # a tiny random model, seconds (checks the script)
    python examples/grpo_calculator_tool.py --chat     # conversations: the reply a tool message

(A tiny random model never writes ``calc(...)``, so ``--tiny`` checks the script's wiring only;
the tool turns themselves are tested on tiny models in ``tests/e2e/test_turns.py``.)

On the embedded SmolLM2-135M (4 steps of 8 samples, 42 s on a 2-core AMD EPYC) the model follows
the worked examples and calls the tool in most samples: scores 0.875, 0.875, 0.750, 0.875 in
steps 0-3, 17.4-18.9 policy tokens and 4.4-5.4 tool tokens per response, step-0 KL exactly 0.0
and first ratio exactly 1, sampler against learner 3.9e-12 to 6.5e-12 nats per token. A
samples.jsonl row::

    "response": " calc(64 + 14) -> 78\n78 + 19 = calc(7", "score": 1.0, "columns": {"answer": "78"},
    "env": [" -> 78\n"], "env_at": [14], "policy_tokens": 19, "env_tokens": 5, "ended": false

(the policy goes on past its answer with the next problem of the pattern, cut by the token budget
and the turn limit: not ended). A sample of the last step, ``" calc(30 + 78 ≈ 99\n35 + 104 =
calc("``, never closed its call: the tool wrote nothing and it scores 0, as would a `` -> 108``
the policy wrote itself (before the reward read ``env_replies``, such a transcript scored 1:
step 1 read 1.000). The task is easy with the tool, so this shows the wiring, not a gain.

``--chat`` runs the same task as conversations (:func:`chat_rows`: the worked examples as user,
assistant, tool and assistant messages), so the tool's reply is a ``tool`` message through the
chat template (``rollout.env_format=auto``), the tool (:func:`chat_calculator`) and the reward
(:func:`chat_answer_reward`) get TRL's messages, and the budget is 40 tokens (the template frames
the tool's message in 13 more). On the embedded SmolLM2-135M-Instruct (51 s): scores 0.75, 1.0,
1.0, 1.0, step-0 KL 0.0 and first ratio 1, 10.5-15.4 policy and 9.75-14 tool tokens per response,
75-100% of the episodes ended by the policy (``response/eos_fraction``); a samples.jsonl row's
``messages``::

    [{"role": "assistant", "content": "calc(64 + 14)"}, {"role": "tool", "content": "78"},
     {"role": "assistant", "content": "78"}]

with 12 policy and 13 tool tokens: ``<|im_end|>\n<|im_start|>tool\n78<|im_end|>\n<|im_start|>assistant\n``
(the policy's turn ended at ``)``, so the closing of its message is the template's too), and the
policy's ``78<|im_end|>`` after it. The policy settles on this pattern at once: the run warns of
an entropy collapse at step 1 (0.37 -> 0.12 nats per token), which on this task is the point.
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


def final_answer(text: str, replies: list[str]) -> str | None:
    """The answer of a transcript: the number the tool's first reply holds (``replies``, what
    the environment wrote), else the transcript's leading integer (the policy answered without
    the tool), else None. A ``-> 90`` the policy wrote itself is neither."""
    m = _ANSWER.search(replies[0]) if replies else _LEADING.match(text)
    return m[1] if m else None


def answer_reward(
    completions: list[str], answer: list[str], env_replies: list[list[str]], **kwargs
) -> list[float]:
    """1.0 where the transcript's :func:`final_answer` is the row's ``answer``, else 0.0."""
    return [1.0 if final_answer(c, r) == a else 0.0 for c, r, a in zip(completions, env_replies, answer)]


def chat_calculator(prompt: list, completion: list[dict], turn: int, **columns) -> str | None:
    """The tool in the chat format (``--chat``): the value of the ``calc(a op b)`` the last
    assistant message ended with, as a tool message's text; None when it did not end with one."""
    reply = calculator("", completion[-1]["content"], turn)
    return reply.removeprefix(" -> ").strip() if reply is not None else None


def chat_answer_reward(completions: list[list[dict]], answer: list[str], **kwargs) -> list[float]:
    """``--chat``'s reward on TRL's messages: 1.0 where the first tool message's text, or else the
    first assistant message's leading integer, is the row's ``answer``."""
    out = []
    for messages, a in zip(completions, answer):
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        got = tools[0].strip() if tools else final_answer(messages[0]["content"], [])
        out.append(1.0 if got == a else 0.0)
    return out


def chat_rows(n: int) -> list[dict]:
    """:func:`tool_rows` as conversations: the worked examples as user, assistant (the call),
    tool and assistant (the answer) messages, then the problem as the last user message."""
    shots = []
    for line in SHOTS.splitlines():
        question, call = line.split(" = ", 1)
        call, value = call.split(" -> ")
        shots += [
            {"role": "user", "content": question + " ="},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": value},
        ]
    rows = tool_rows(n)
    return [
        {
            "prompt": shots + [{"role": "user", "content": r["prompt"][len(SHOTS) :].strip()}],
            "answer": r["answer"],
        }
        for r in rows
    ]


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
    parser.add_argument(
        "--chat",
        action="store_true",
        help="conversational prompts: the tool's reply a tool message through the chat template",
    )
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default 4, or 2 with --tiny)")
    parser.add_argument("--out", default=None, help="run directory (default runs/grpo-<date-time>)")
    args = parser.parse_args(argv)

    from tether import load_config, train

    rows = chat_rows(200) if args.chat else tool_rows(200)
    steps = args.steps or (2 if args.tiny else 4)
    overrides = [
        "train.algo=grpo",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        # the call, the tool's answer and a little more (in chat the tool's message is framed by
        # 13 tokens of the template, so the answer after it needs more room)
        f"rollout.max_new_tokens={40 if args.chat else 24}",
        # this file, importable from examples/
        f"rollout.env=grpo_calculator_tool:{'chat_calculator' if args.chat else 'calculator'}",
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

        texts = (
            [m["content"] for r in rows for m in r["prompt"]] if args.chat else [r["prompt"] for r in rows]
        )
        tok = tiny_tokenizer(texts + [" -> 75\n"])
        objects = {"model": tiny_policy(tok), "tokenizer": tok}
    reward = chat_answer_reward if args.chat else answer_reward
    run_dir = train(config, scorer=reward, train_dataset=rows, **objects)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    keys = ("objective/scores", "response/length", "rollout/env_tokens", "objective/kl")
    print("last step: " + ", ".join(f"{k} {last[k]:.3f}" for k in keys if k in last))
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for sample in [s for s in samples if s["step"] == samples[-1]["step"]][:4]:  # the last step's
        prompt = sample["prompt"][-1]["content"] if args.chat else sample["prompt"][len(SHOTS) :]
        print(f"  {prompt!r} -> {sample.get('messages', sample['response'])!r}  tool wrote {sample['env']}")
    return run_dir


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # for _tiny, and rollout.env's module
    main()
