"""RLOO with a reward model, as TRL scores one.

A port of TRL 1.16's RLOO recipe (``trl/scripts/rloo.py``)::

    trl rloo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/tldr \
        --reward_model_name_or_path ORG/REWARD_MODEL --num_generations 4 ...

to tether: ``train.algo=rloo`` with a sequence classifier as the reward. The reward model reads
``prompt + completion`` (string prompts; conversations through its own chat template), without
added special tokens, padded on the right, and its logit 0 is the reward (docs/trl.md). It is
passed from Python as TRL's ``reward_funcs`` entry and ``reward_processing_classes`` entry, the
pair ``(model, tokenizer)``; ``reward.scorer=hf:FOLDER`` on the command line is the same.

    python examples/rloo_reward_model.py --reward-model FOLDER_OR_HUB_ID   # embedded SmolLM2 policy
    python examples/rloo_reward_model.py --tiny     # tiny random policy and reward model, seconds

A Hub id is read from the Hugging Face cache (``HF_HUB_OFFLINE=1`` to stay offline).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

POSTS = [
    "I moved to a new city and I have no friends yet, what should I do",
    "my landlord kept my deposit after I cleaned the flat twice",
    "I want to learn to cook but I burn everything",
    "my cat wakes me up at four every morning",
    "I got a job offer that pays more but the commute is two hours",
    "my brother borrowed my car and returned it with an empty tank",
    "I can't decide between studying biology or computer science",
    "my neighbours play loud music every night until one",
]


def tldr_prompts() -> list[str]:
    """TRL's trl-lib/tldr format in small: standard prompts (strings) ending in ``TL;DR:``."""
    return [f"POST: {p}\n\nTL;DR:" for p in POSTS for _ in range(4)]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random policy and reward model: seconds")
    parser.add_argument("--reward-model", default=None, help="a sequence classifier folder or Hub id")
    parser.add_argument("--steps", type=int, default=None, help="RLOO steps (default 8, or 2 with --tiny)")
    parser.add_argument("--out", default=None, help="run directory (default runs/rloo-<date-time>)")
    args = parser.parse_args(argv)
    if not args.tiny and not args.reward_model:
        parser.error("give --reward-model FOLDER_OR_HUB_ID (a sequence classifier), or --tiny")

    from tether import load_config, train

    prompts = tldr_prompts()
    steps = args.steps or (2 if args.tiny else 8)
    overrides = [
        "train.algo=rloo",
        "rollout.group_size=4",  # TRL's num_generations (RLOO's k)
        "rollout.batch_size=8" if args.tiny else "rollout.batch_size=16",
        "rollout.max_new_tokens=8" if args.tiny else "rollout.max_new_tokens=32",
        "optim.lr=1e-4" if args.tiny else "optim.lr=1e-5",
        "optim.epochs=1",  # num_iterations
        "optim.minibatch_size=8" if args.tiny else "optim.minibatch_size=16",
        "kl.kl_coef=0.05",  # RLOOConfig.beta's default
        "kl.controller=fixed",
        f"train.steps={steps}",
        "data.heldout_fraction=0.15",
    ]
    from _tiny import small_run

    overrides += small_run(args.tiny, args.out)  # a short evaluation, no checkpoint, no saved policy
    config = load_config(None, overrides)
    objects = {}
    if args.tiny:
        from _tiny import tiny_policy, tiny_reward_model, tiny_tokenizer

        tok = tiny_tokenizer(prompts)
        objects = {"model": tiny_policy(tok), "tokenizer": tok}
        reward = (tiny_reward_model(tok), tok)  # TRL: reward_funcs=[model], reward_processing_classes=[tok]
    else:  # as TRL loads reward_funcs="ORG/NAME": the classifier and its tokenizer
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from tether.models.loading import hub_folder, is_hub_id

        folder = hub_folder(args.reward_model) if is_hub_id(args.reward_model) else args.reward_model
        reward = (
            AutoModelForSequenceClassification.from_pretrained(folder),
            AutoTokenizer.from_pretrained(folder),
        )
    run_dir = train(config, scorer=reward, train_dataset=[{"prompt": p} for p in prompts], **objects)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    keys = ("objective/scores", "objective/kl", "objective/kl_coef")
    print("last step: " + ", ".join(f"{k} {last[k]:.4f}" for k in keys if k in last))
    return run_dir


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # for _tiny
    main()
