"""The fluency judge (tether.judges.fluency): batched, left-padded scoring against one unpadded
forward per text; and, with the real Gemma-3-270M, fluent text against sentiment-hacking strings."""

from __future__ import annotations

import math

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
