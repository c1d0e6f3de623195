"""DPO on a preference dataset.

A port of TRL 1.16's DPO recipe (``trl/scripts/dpo.py``)::

    trl dpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct \
        --dataset_name trl-lib/ultrafeedback_binarized --beta 0.1 --learning_rate 5e-7 ...

to tether: ``train.algo=dpo`` with ``dpo.pairs`` pointing at a preference file in TRL's format
(``prompt``, ``chosen``, ``rejected``; here conversational: a message list and one assistant
message each), which this script writes itself. Its prompts are split by tether's hash into
training and held-out ones; each step also samples the policy on held-out prompts
(``dpo.kl_eval_prompts``) and scores them with the run's reward, so a DPO run lands on the same
score-against-KL axes as the RL trainers (the reward is any tether scorer: here a TRL-style
function that rewards a completion ending in a full stop).

    python examples/dpo_preferences.py            # the embedded SmolLM2-135M-Instruct
    python examples/dpo_preferences.py --tiny     # a tiny random model, seconds (checks the script)

On the embedded model a step took 4 s on this project's 2-core CPU (12 s in all with loading and
the held-out evaluations, ``--steps 1``; the first step's margins are exactly 0, the policy
being the reference).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

QUESTIONS = [
    ("What colour is the sky?", "The sky is blue on a clear day.", "idk"),
    ("Name a fruit.", "An apple is a fruit.", "car"),
    ("How many legs does a spider have?", "A spider has eight legs.", "lots lol"),
    ("What is the capital of France?", "The capital of France is Paris.", "france has one"),
    ("What do bees make?", "Bees make honey.", "buzz"),
    ("Which planet is closest to the sun?", "Mercury is the closest planet to the sun.", "the hot one"),
    ("What is frozen water called?", "Frozen water is called ice.", "cold"),
    ("How many days are in a week?", "A week has seven days.", "many"),
]


def preference_rows(repeat: int = 4) -> list[dict]:
    """TRL's conversational preference format: ``{"prompt": [user message], "chosen": [assistant
    message], "rejected": [assistant message]}``; each question in ``repeat`` wordings."""
    rows = []
    for i in range(repeat):
        for q, good, bad in QUESTIONS:
            prompt = q if i == 0 else f"{q} ({i})"
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                }
            )
    return rows


def ends_a_sentence(completions: list[list[dict]], **kwargs) -> list[float]:
    """1.0 for a completion whose text ends with a full stop (a TRL-style reward function)."""
    return [float(c[0]["content"].strip().endswith(".")) for c in completions]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random model: checks the script in seconds"
    )
    parser.add_argument("--steps", type=int, default=None, help="DPO steps (default 8, or 2 with --tiny)")
    parser.add_argument("--out", default=None, help="run directory (default runs/dpo-<date-time>)")
    parser.add_argument(
        "--pairs", default=None, help="where to write the preference file (default a temp dir)"
    )
    args = parser.parse_args(argv)

    from tether import load_config, train

    rows = preference_rows()
    pairs = Path(args.pairs or tempfile.mkdtemp(prefix="tether-dpo-")) / "preferences.jsonl"
    pairs.parent.mkdir(parents=True, exist_ok=True)
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = args.steps or (2 if args.tiny else 8)
    overrides = [
        "train.algo=dpo",
        f"dpo.pairs={pairs}",
        "dpo.beta=0.1",  # DPOConfig.beta
        "dpo.kl_eval_prompts=4",
        "rollout.batch_size=8",  # pairs per step (per_device_train_batch_size x processes x accumulation)
        "rollout.max_new_tokens=8" if args.tiny else "rollout.max_new_tokens=24",  # the probe's samples
        "optim.minibatch_size=8",
        "optim.epochs=1",
        "optim.lr=1e-4" if args.tiny else "optim.lr=5e-6",
        f"train.steps={steps}",
        "data.heldout_fraction=0.2",
    ]
    from _tiny import small_run

    overrides += small_run(args.tiny, args.out)  # a short evaluation, no checkpoint, no saved policy
    config = load_config(None, overrides)
    objects = {}
    if args.tiny:
        from _tiny import tiny_policy, tiny_tokenizer

        texts = [m["content"] for r in rows for k in ("prompt", "chosen", "rejected") for m in r[k]]
        tok = tiny_tokenizer(texts)
        objects = {"model": tiny_policy(tok), "tokenizer": tok}
    run_dir = train(config, scorer=ends_a_sentence, **objects)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    keys = [k for k in last if k.startswith(("dpo/", "objective/scores", "objective/kl"))]
    print("last step: " + ", ".join(f"{k} {last[k]:.4f}" for k in keys if isinstance(last[k], (int, float))))
    return run_dir


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # for _tiny
    main()
