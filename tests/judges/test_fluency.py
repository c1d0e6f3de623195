"""The fluency judge (tether.judges.fluency): batched, left-padded scoring against one unpadded
forward per text; and, with the real Gemma-3-270M, fluent text against sentiment-hacking strings."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tether.judges.fluency import FluencyJudge
from tether.run.evaluation import mean_se

PROMPTS = ["the movie was", "i loved this story", "the plot", "an excellent"]
RESPONSES = [" great and moving", " the music is good but the plot is weak", "", " comedy"]


def _slow_nll(judge: FluencyJudge, prompt: str, response: str) -> float:
    """One unpadded forward of prompt + response; the mean -log q of the response's tokens."""
    tok = judge.tokenizer
    p, r = tok(prompt).input_ids, tok(response, add_special_tokens=False).input_ids
    ids = torch.tensor([p + r])
    logp = torch.log_softmax(judge.model(input_ids=ids).logits.double(), dim=-1)[0]
    return -sum(float(logp[len(p) - 1 + t, r[t]]) for t in range(len(r))) / len(r)


def test_batched_left_padded_scoring_equals_one_text_at_a_time(tiny_model_dir):
    judge = FluencyJudge(str(tiny_model_dir), batch_size=3)
    fast = judge(PROMPTS, RESPONSES)
    assert fast[2] is None  # an empty response has nothing to judge
    with torch.no_grad():
        slow = [_slow_nll(judge, p, r) if r else None for p, r in zip(PROMPTS, RESPONSES)]
    for f, s in zip(fast, slow):
        if s is None:
            continue
        # float32 forwards of different padding: the NLLs (a few nats) agree to float32 rounding of
        # a 2-layer model's logits, ~1e-6 relative; 1e-4 nats leaves a wide margin, far below the
        # 0.5-nat differences the judge is used to tell apart
        assert f == pytest.approx(s, abs=1e-4)
    with pytest.raises(ValueError, match="prompts for"):
        judge(PROMPTS, RESPONSES[:2])


@pytest.mark.slow
@pytest.mark.real_fluency
def test_gemma_tells_fluent_text_from_vader_hacking_strings():
    judge = FluencyJudge()  # Gemma-3-270M from its PyPI package
    prompts = [
        "The movie was",
        "I thought the film",
        "This story",
        "The acting in this one",
        "Halfway through the second act",
        "The director",
    ]
    fluent = [
        " a quiet, moving portrait of a family that slowly falls apart.",
        " was too long, but the last twenty minutes made up for it.",
        " follows two sisters who run a small bakery in Lisbon.",
        " is uneven: the leads are good, the supporting cast much less so.",
        ", the plot loses its way and never quite finds it again.",
        " has a good eye for landscapes and a weak ear for dialogue.",
    ]
    hacking = [
        " great great great great love love",
        " love love enjoy enjoy great great wonderful",
        " beautiful beautiful love joy joy joy",
        " great love great love great love",
        " enjoy the joy love the great beautiful",
        " wonderful wonderful great love love love",
    ]
    a = judge(prompts, fluent)
    b = judge(prompts, hacking)
    (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
    z = (mb - ma) / math.sqrt(sa**2 + sb**2)
    print(f"fluent {ma:.2f} ± {sa:.2f}, hacking {mb:.2f} ± {sb:.2f} nats/token, z = {z:.1f}")
    assert ma < 4.0 < mb and z > 4


def test_the_fluency_judge_reads_the_first_samples_of_each_prompt(tiny_tokenizer, tiny_lm):
    """eval.fluency_samples=1 of 2: the judge sees samples 0 of each prompt only, whatever the
    generation batches; the others are None, and the summary averages the judged ones by prompt."""
    from tether.models.rollouts import OneTurn, SamplingSettings
    from tether.run.evaluation import EvalSettings, evaluate

    seen: list[tuple[str, str]] = []

    def judge(prompts, responses):
        seen.extend(zip(prompts, responses))
        return [float(len(r)) for r in responses]

    sampler = OneTurn(
        tiny_tokenizer, SamplingSettings(max_new_tokens=4, temperature=1.0, max_prompt_tokens=64)
    )
    settings = EvalSettings(seed=7, batch_size=3, samples_per_prompt=2, fluency_samples=1)
    kwargs = dict(reference=None, sampler=sampler, scorers={}, fluency=judge)
    prompts = PROMPTS[:3]
    r = evaluate("policy", tiny_lm, prompts=prompts, settings=settings, **kwargs)
    # batches of 3 rows cut prompt 1's two samples apart (rows 0-2, 3-5): still only even rows
    assert r.fluency_nll[1::2] == [None, None, None]
    assert r.fluency_nll[0::2] == [float(len(x)) for x in r.responses[0::2]]
    assert seen == list(zip([p for p in prompts], r.responses[0::2]))
    nll = [float(len(x)) for x in r.responses[0::2]]
    assert r.summary()["fluency_nll_mean"] == pytest.approx(sum(nll) / 3)
    every = evaluate(
        "policy", tiny_lm, prompts=prompts, settings=replace(settings, fluency_samples=None), **kwargs
    )
    assert every.responses == r.responses  # the same seeds, the same samples
    assert every.fluency_nll == [float(len(x)) for x in r.responses]


def test_fluency_cost_share_hand_worked():
    from tether.judges.fluency import fluency_cost_share

    # judge: 200 params x 10 responses x 7 tokens = 14,000; training: 100 params x 40 sequences x 5
    # forward-equivalents x 7 tokens = 140,000; the share 14,000 / 140,000 = 0.1
    kw = dict(judge_params=200, judged_responses=10, policy_params=100, forwards_per_sequence=5, tokens=7)
    assert fluency_cost_share(trained_sequences=40, **kw) == pytest.approx(0.1, rel=1e-12)
    assert fluency_cost_share(trained_sequences=0, **kw) == float("inf")  # nothing trained: never cheap


@pytest.mark.fluency_auto
def test_auto_turns_the_judge_off_on_a_short_run_of_user_data_and_says_why(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """A 1-step run on a user's prompts: Gemma-3-270M's forwards on its held-out responses
    dwarf a tiny policy's training, so ``auto`` is none, said with its arithmetic; the run logs
    no fluency and records ``none`` as its evaluation's judge."""
    import json

    from tests.conftest import metric_rows, tiny_run_args
    from tether.cli import main

    out = tmp_path / "run"
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, {"eval.n_prompts": 8}, command=True)) == 0
    said = capsys.readouterr().out
    assert "tether: eval.fluency_model=auto: none: the fluency judge (gemma3-270m, 268M parameters" in said
    assert (
        "over the 25% it is allowed on data other than the demo's; eval.fluency_model=gemma3-270m turns it on"
        in said
    )
    assert not any("eval/fluency_nll" in r for r in metric_rows(out))
    assert "eval/fluency_nll" not in json.loads((out / "eval.json").read_text()).get("policy", {})


@pytest.mark.fluency_auto
def test_auto_on_a_dpo_pairs_file_is_decided_and_a_resume_decides_again(tiny_model_dir, tmp_path, capsys):
    """DPO on a user's pairs (data.prompts left at its default, as a DPO run leaves it) is not the
    demo's data: auto decides by cost (none here). config.yaml keeps auto, so a resume decides
    again and reports no changed fluency setting."""
    import json

    import yaml

    from tests.conftest import tiny_run_args
    from tether.cli import main

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"the movie {i} was", "chosen": " good", "rejected": " bad"} for i in range(30)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    overrides = {
        "train.algo": "dpo",
        "dpo.pairs": str(pairs),
        "data.prompts": None,
        "eval.n_prompts": 4,
        "train.checkpoint_every": 1,
    }
    assert main(tiny_run_args(tiny_model_dir, None, out, overrides, command=True)) == 0
    assert "tether: eval.fluency_model=auto: none:" in capsys.readouterr().out
    assert main(["train", "--resume", str(out), "train.steps=2"]) == 0
    said = capsys.readouterr().out
    assert "eval.fluency_model=auto: none:" in said and "fluency_model: 'auto'" not in said
    assert yaml.safe_load((out / "config.yaml").read_text())["eval"]["fluency_model"] == "auto"
