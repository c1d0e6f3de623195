"""A few checks on the real embedded default: SmolLM2-135M-Instruct and the ICWSM-2014 prompts.

The first run dequantizes the packaged GGUF and downloads the vaderSentiment source archive
(both cached under ~/.cache/tether); later runs take seconds.
"""

from __future__ import annotations

import pytest
import torch

from tether.core.kl import estimate_kl, sampled_estimators
from tether.core.masked import masked_sum
from tether.run.config import load_config
from tether.run.setup import build_run
from tether.trainers.ppo import PPOTrainer

pytestmark = pytest.mark.slow  # the real SmolLM2-135M and the real ICWSM prompts


def test_default_prompts_are_real_and_split():
    from tether.data.prompts import movie_prompts

    train, held = movie_prompts(seed=0)
    assert len(train) > 9000 and len(held) > 400
    assert not set(train) & set(held)
    lengths = {len(p.split()) for p in train[:2000]}
    assert min(lengths) >= 1 and max(lengths) <= 8
    assert train[:50] == movie_prompts(seed=0)[0][:50]  # reproducible


@pytest.fixture(scope="module")
def real_step(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "run"
    config = load_config(
        None,
        [
            "rollout.batch_size=4",
            "optim.minibatch_size=2",
            "rollout.max_new_tokens=8",
            "eval.n_prompts=0",
            "train.progress=false",
            f"train.output_dir={out}",
        ],
    )
    run = build_run(config)
    trainer = PPOTrainer(run)
    row = trainer.step(0)
    return run, trainer, row


def test_step_zero_kl_is_exactly_zero_and_ratio_one(real_step):
    run, trainer, row = real_step
    exp = trainer.last_experience
    mask = exp.rollout.response_mask
    assert mask.sum() > 0
    for name in sampled_estimators():
        kl = estimate_kl(exp.old_logprobs, exp.ref_logprobs, name)
        assert float(masked_sum(kl.abs(), mask)) == 0.0, name
    assert row["objective/kl"] == 0.0 and row["objective/kl_exact"] == 0.0
    assert row["policy/ratio_max_dev_first"] == 0.0


def test_real_reference_stays_frozen(real_step):
    run, trainer, row = real_step
    from tether.models.reference import fingerprint

    assert fingerprint(run.reference) == run.reference_fingerprint
    moved = any(not torch.equal(p, q) for p, q in zip(run.policy.lm.parameters(), run.reference.parameters()))
    assert moved, "after one PPO step the policy differs from the reference"
