"""Numbers with no value (issue 50's adversarial review): a mean of no scored sample, a distinct-2 of
responses under two words. NaN in memory, null in eval.json; the console, the model card and the
report say ``n/a`` (and why), and never end in a TypeError."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_run_args
from tether.cli import main


@pytest.mark.real_plots
def test_a_run_whose_reward_and_judge_score_nothing_writes_its_card_and_report(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """A reward and a judge returning None for every sample, and one-token responses (so no
    bigram: distinct-2 NaN), saved as null: the card crashed formatting None ("unsupported
    format string passed to NoneType.__format__"), leaving no policy/README.md, and ``tether
    report`` crashed the same way; the console said "proxy score nan -> nan (gain +nan ± nan SE)"."""
    out = tmp_path / "run"
    overrides = {
        "reward.scorer": "tests.conftest:never_scores",
        "eval.judge": "tests.conftest:never_scores",
        "eval.n_prompts": 4,
        "eval.every": 0,
        "rollout.max_new_tokens": 1,
        "train.save_model": "true",
        "train.steps": 2,
    }
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, overrides, command=True)) == 0
    said = capsys.readouterr().out
    assert (
        "tether: reference held-out proxy score n/a: no sample was scored, gold n/a: no sample was scored"
        in said
    )
    assert (
        "tether: held-out proxy score n/a: no sample was scored (the reward returned None for all 8 of the "
        "reference's samples and all 8 of the policy's); gold n/a (no prompt has a sample the judge scored "
        "for both)"
    ) in said, said
    assert "distinct-2 n/a -> n/a (n/a)" in said and "nan" not in said
    card = (out / "policy" / "README.md").read_text()
    assert "| reward (proxy) | n/a | n/a | n/a |" in card and "| gold judge | n/a | n/a | n/a |" in card
    assert "| distinct-2 | n/a | n/a | n/a |" in card
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "<p>proxy gain n/a; gold gain n/a; " in page and "; distinct-2 change n/a;" in page
    assert "<td>n/a</td>" in page and "None" not in page and "nan" not in page
