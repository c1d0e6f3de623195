"""DPO's reference log-probabilities: scored with the policy's, so step-0 margins are exactly 0."""

from __future__ import annotations

import json

import pytest
import torch

from tether.run.config import load_config
from tether.run.setup import build_run
from tether.trainers.dpo import DPOTrainer

pytestmark = pytest.mark.numerics  # every test here compares two computational paths


def test_step0_margins_are_exactly_zero(tiny_model_dir, prompt_file, tmp_path):
    """At step 0 the policy is the reference, so every implicit reward and margin is 0.0.

    NeMo-Aligner issue #227: reference log-probs precomputed in other batches than the update's
    are padded to other widths, and the policy's and reference's sequence log-probs of one pair
    then differ by float rounding (3.8e-6 nats was measured here). The prompts below have 1 to 12
    words, so every micro-batch of 1, 2 or 3 pairs is padded to its own width.
    """
    pairs = tmp_path / "pairs.jsonl"
    words = "the movie was great and the acting was wonderful but the plot".split()
    pairs.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": " ".join(words[: 1 + i % 12]),
                    "chosen": "great and fun " * (1 + i % 3),
                    "rejected": "bad " * (1 + i % 5),
                }
            )
            + "\n"
            for i in range(12)
        )
    )
    cfg = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            f"data.prompts={prompt_file}",
            "train.algo=dpo",
            f"dpo.pairs={pairs}",
            "rollout.forward_batch_size=5",
            "eval.n_prompts=0",
            "eval.judge=none",
            "train.progress=false",
            "reward.scorer=tests.conftest:length_judge",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    trainer = DPOTrainer(build_run(cfg))
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    for size in (1, 2, 3, 12):
        for rows in order.split(size):
            out = trainer.pair_loss(rows)
            assert torch.equal(out.chosen_rewards, torch.zeros(len(rows))), (size, out.chosen_rewards)
            assert torch.equal(out.rejected_rewards, torch.zeros(len(rows))), (size, out.rejected_rewards)
            assert float(out.margin) == 0.0 and float(out.accuracy) == 0.0
            # -log sigmoid(0) = log 2, exactly as float32 rounds it
            assert float(out.loss.detach()) == float(torch.nn.functional.logsigmoid(torch.zeros(1)).neg())
