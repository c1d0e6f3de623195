"""A new rollout kind needs only its own class and its registration (tether.models.rollouts)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import metric_rows
from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main
from tether.models import rollouts
from tether.models.sampling import Rollout, tokenize_prompts

REPLY = " the acting was wonderful and the music is good"


@pytest.fixture
def toy_kind(monkeypatch):
    """A toy kind registered here, and picked for the run, as a new kind's file would be: every
    response is ``REPLY`` and an end id. The registration is undone after the test."""
    monkeypatch.setattr(rollouts, "SAMPLERS", dict(rollouts.SAMPLERS))
    calls = []

    @rollouts.register("toy")
    class Toy(rollouts.Sampler):
        def sample(self, lm, prompts, seeds, *, weights=None, share_prefix=False) -> Rollout:
            calls.append(len(prompts))
            tok, device = self.tokenizer, next(lm.parameters()).device
            prompt_ids, prompt_mask = tokenize_prompts(
                tok, list(prompts), self.settings.max_prompt_tokens, device
            )
            reply = tok(REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            B = len(prompts)
            return Rollout(
                list(prompts),
                prompt_ids,
                prompt_mask=prompt_mask,
                response_ids=torch.tensor([reply] * B, device=device),
                response_mask=torch.ones(B, len(reply), dtype=torch.bool, device=device),
                responses=[REPLY] * B,
                ended=torch.ones(B, dtype=torch.bool, device=device),
                columns=getattr(prompts, "columns", None),
                seeds=list(seeds) if seeds is not None else None,
            )

    monkeypatch.setattr(rollouts, "rollout_kind", lambda env: "toy")
    return calls


def test_a_registered_kind_samples_the_training_steps_and_the_evaluations(
    toy_kind, tiny_model_dir, prompt_file, tmp_path
):
    out = tmp_path / "run"
    assert main(_tiny_args(tiny_model_dir, prompt_file, out)) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["response"] == REPLY for s in samples)
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["policy"]["n"] > 0
    rows = metric_rows(out)
    assert len(rows) == 3 and all(r["response/eos_fraction"] == 1.0 for r in rows)
    assert "rollout/logprob_mismatch" not in rows[0]  # the toy kind keeps no sampler log-probs
    # the steps' rollouts (4 rows each), the reference's and the policy's evaluations, the periodic ones
    assert toy_kind.count(4) >= 3 and len(toy_kind) > 3
