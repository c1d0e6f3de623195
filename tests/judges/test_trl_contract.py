"""tether calls reward functions and scores reward models exactly as TRL 1.16 does.

The oracle is TRL's own code: ``GRPOTrainer._calculate_rewards`` (and RLOO's, the same text) run on
a trainer built without its ``__init__`` (:func:`trl_rewards`), so each test compares tether's
call with the very call TRL makes, on the same completions and the same model.
"""

from __future__ import annotations

import copy
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")  # the test extra pins trl==1.16.0
rewards = pytest.importorskip("trl.rewards")

from tests.conftest import metric_rows  # noqa: E402
from tether.judges.contract import (  # noqa: E402
    RewardLog,
    WeightedReward,
    checked_scores,
    takes_prompts,
    trainer_state,
    trl_completions,
)
from tether.judges.scorers import RewardModelScorer, make_scorer  # noqa: E402

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
GEN_TEMPLATE = TEMPLATE + "{% if add_generation_prompt %}[assistant]{% endif %}"

CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the movie"}],
    [{"role": "user", "content": "a film that"}],
    [{"role": "user", "content": "the plot"}],
]
STRINGS = ["the movie", "a film that", "the plot"]
TEXTS = ["<think>\nit was good\n</think> great", " bad bad bad bad", "<think>no end"]
IDS = [[5, 6, 0], [7, 7, 7, 7, 7, 7], [8, 9]]  # 3, 6 and 2 tokens (the first ends with its EOS, 0)
COLUMNS = {"answer": ["great", "bad", "weak"], "id": [0, 1, 2]}


def trl_rewards(trainer_class, reward_funcs, processing_classes=None, step: int = 0):
    """TRL's own ``_calculate_rewards``, bound to a ``trainer_class`` instance made without its
    ``__init__`` and given the attributes that method reads. Returns
    ``f(prompts, completions, completion_ids, columns) -> (B, n_funcs) float32 tensor``."""
    from accelerate import Accelerator
    from transformers import TrainerState

    t = trainer_class.__new__(trainer_class)
    t.accelerator = Accelerator(cpu=True)
    t.args = SimpleNamespace(report_to=[], device=torch.device("cpu"))
    t.is_deepspeed_enabled = False
    t.reward_funcs = list(reward_funcs)
    t.reward_processing_classes = list(processing_classes or [None] * len(reward_funcs))
    t.reward_func_names = [f"f{i}" for i in range(len(reward_funcs))]
    t.state = TrainerState(global_step=step, max_steps=10, epoch=0.5)
    t.environments = None
    t.chat_template_kwargs = {}
    t._pending_extra_logs, t._pending_metrics = defaultdict(list), defaultdict(list)

    def call(prompts, completions, completion_ids, columns):
        inputs = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
        return t._calculate_rewards(inputs, prompts, completions, completion_ids)

    return call


TRAINERS = pytest.mark.parametrize("trainer_class", [trl.GRPOTrainer, trl.RLOOTrainer], ids=["grpo", "rloo"])


# ---- Part 3: the reward-function contract -----------------------------------------------------
@TRAINERS
@pytest.mark.parametrize(
    "make, conversational",
    [
        (lambda: rewards.think_format_reward, True),
        (lambda: rewards.get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2), True),
        (lambda: rewards.get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2), False),
        (lambda: rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0), False),
    ],
    ids=["think_format", "soft_overlong_chat", "soft_overlong_text", "repetition"],
)
def test_trls_reward_functions_give_trls_values(trainer_class, make, conversational):
    """Each of ``trl.rewards``' functions, through tether's call and through TRL's, on the same
    completions: equal values. Hand-worked: think_format [1, 0, 0] (only the first opens and closes
    <think>); soft overlong (L_max 4, cache 2) on 3, 6, 2 tokens: 3 is in (2, 4] -> (2 - 3) / 2 =
    -0.5, 6 > 4 -> -1, 2 <= 2 -> 0; repetition (bigrams) [0, -(1 - 1/5) = -0.8, 0]."""
    f = make()
    prompts = CONVERSATIONS if conversational else STRINGS
    got = checked_scores(f, TEXTS, 0, prompts, COLUMNS, completion_ids=IDS)
    trl_scores = trl_rewards(trainer_class, [f])(prompts, trl_completions(prompts, TEXTS), IDS, COLUMNS)
    # both trainers hold rewards as float32 tensors (tether: torch.tensor(scores) in the step)
    assert torch.tensor(got, dtype=torch.float32).tolist() == trl_scores[:, 0].tolist()
    direct = f(prompts=prompts, completions=trl_completions(prompts, TEXTS), completion_ids=IDS, **COLUMNS)
    assert got == direct  # and the very Python floats of calling it as TRL does
    want = {
        "think_format_reward": [1.0, 0.0, 0.0],
        "soft_overlong_punishment_reward": [-0.5, -1.0, 0.0],
        "repetition_penalty_reward": [0.0, -0.8, 0.0],
    }[f.__name__]
    assert got == want


def test_completion_ids_are_token_ids_not_texts():
    """The case of the issue: two completions of 2 and 5 tokens, L_max 4, cache 2. TRL gives
    [0.0, -1.0]; called with the texts in place of the ids (tether before, which called it as a
    plain scorer), [-1.0, -1.0]."""
    f = rewards.get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)
    texts, ids = ["fine", "too long"], [[3, 0], [4, 4, 4, 4, 0]]
    assert f(completion_ids=ids) == [0.0, -1.0]
    # the texts' lengths in characters, 4 and 8: (2 - 4) / 2 = -1 and 8 > 4 -> -1
    assert f(completion_ids=texts) == [-1.0, -1.0]
    assert checked_scores(f, texts, 0, ["p", "q"], completion_ids=ids) == [0.0, -1.0]
    with pytest.raises(ValueError, match="it takes \\['completion_ids'\\].*no token ids came"):
        checked_scores(f, texts, 0, ["p", "q"])  # a call with texts only cannot score it


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("math_verify") is None,
    reason="rewards.accuracy_reward needs math_verify (not a tether dependency)",
)
@TRAINERS
def test_trls_accuracy_reward_gives_trls_values(trainer_class):
    f = rewards.accuracy_reward
    texts = [r"so \boxed{\frac{1}{3}}", r"so \boxed{\frac{1}{2}}"]
    columns = {"solution": [r"\frac{1}{3}", r"\frac{1}{3}"]}
    prompts = CONVERSATIONS[:2]
    got = checked_scores(f, texts, 0, prompts, columns, completion_ids=IDS[:2])
    want = trl_rewards(trainer_class, [f])(prompts, trl_completions(prompts, texts), IDS[:2], columns)
    assert got == want[:, 0].tolist() == [1.0, 0.0]


@TRAINERS
@pytest.mark.parametrize("conversational", [True, False], ids=["conversations", "strings"])
def test_a_reward_function_gets_trls_keywords(trainer_class, conversational):
    """A ``**kwargs`` function records what it gets: tether's keywords are TRL's, with TRL's values
    (prompts as the dataset has them; completions message lists for conversations, strings
    otherwise; completion_ids; every column; a TrainerState; the two log hooks)."""
    from transformers import TrainerState

    seen = []

    def record(**kwargs):
        seen.append(kwargs)
        return [0.0] * len(kwargs["completions"])

    prompts = CONVERSATIONS if conversational else STRINGS
    checked_scores(record, TEXTS, 3, prompts, COLUMNS, completion_ids=IDS, state=trainer_state(3, 10, 0.5))
    trl_rewards(trainer_class, [record], step=3)(prompts, trl_completions(prompts, TEXTS), IDS, COLUMNS)
    ours, theirs = seen
    assert sorted(ours) == sorted(theirs)
    assert sorted(ours) == sorted(
        [
            "prompts",
            "completions",
            "completion_ids",
            "trainer_state",
            "log_extra",
            "log_metric",
            "answer",
            "id",
        ]
    )
    for key in ("prompts", "completions", "completion_ids", "answer", "id"):
        assert ours[key] == theirs[key], key
    if conversational:
        assert ours["completions"][0] == [{"role": "assistant", "content": TEXTS[0]}]
    else:
        assert ours["completions"] == TEXTS
    assert isinstance(ours["trainer_state"], TrainerState)
    for attr in ("global_step", "max_steps", "epoch"):
        assert getattr(ours["trainer_state"], attr) == getattr(theirs["trainer_state"], attr), attr
    assert callable(ours["log_extra"]) and callable(ours["log_metric"])


def test_plain_scorers_and_kwargs_only_functions_keep_working():
    """A plain ``list[str] -> list[float]`` gets the texts (also one with ``*args, **kwargs``,
    a wrapper); a keywords-only function is TRL-style; a named TRL argument makes one TRL-style."""

    def plain(texts):
        return [len(t) / 10 for t in texts]

    def wrapper(*args, **kwargs):
        return plain(*args, **kwargs)

    def keywords_only(**kwargs):
        return [len(c) / 10 for c in kwargs["completions"]]

    def ids_only(completion_ids, **kwargs):
        return [float(len(i)) for i in completion_ids]

    assert not takes_prompts(plain) and not takes_prompts(wrapper)
    assert takes_prompts(keywords_only) and takes_prompts(ids_only)
    assert checked_scores(plain, ["ab", "abcd"], 0, ["p", "q"]) == [0.2, 0.4]
    assert checked_scores(wrapper, ["ab", "abcd"], 0) == [0.2, 0.4]
    assert checked_scores(keywords_only, ["ab", "abcd"], 0, ["p", "q"]) == [0.2, 0.4]
    assert checked_scores(ids_only, ["ab", "abcd"], 0, completion_ids=[[1], [1, 2, 0]]) == [1.0, 3.0]


def test_a_reward_gets_the_environments_replies_when_it_asks_for_them():
    """env_replies (tether's, multi-turn only): a function naming it gets the B lists, through a
    reward list as well; one taking **kwargs gets TRL's keywords exactly, not these (a TRL reward
    that hands its **kwargs to a stricter function must not break in a multi-turn run); one naming
    it in a single-turn call is an error that says where they come from; a plain scorer never
    sees them."""
    from tether.judges.scorers import make_scorer

    replies = [[" -> 75\n"], []]

    def tool_answer(completions, env_replies, **kwargs):
        # 1.0 where the tool answered: the reward reads what the environment wrote, not the text
        return [1.0 if r else 0.0 for r in env_replies]

    def strict(completions, trainer_state, log_extra, log_metric, prompts, completion_ids=None):
        return [1.5] * len(completions)

    def kwargs_only(completions, **kwargs):
        assert "env_replies" not in kwargs
        return strict(completions, **kwargs)  # what a TRL reward wrapping another one does

    def plain(texts):
        return [0.5] * len(texts)

    texts = [" calc(58 + 17) -> 75\n", " calc(58 + 17 -> 75"]  # the second wrote the arrow itself
    assert checked_scores(tool_answer, texts, 0, ["p", "q"], env_replies=replies) == [1.0, 0.0]
    assert checked_scores(kwargs_only, texts, 0, ["p", "q"], env_replies=replies) == [1.5, 1.5]
    assert checked_scores(plain, texts, 0, env_replies=replies) == [0.5, 0.5]
    both = make_scorer([tool_answer, plain], [1.0, 2.0])  # 1 * tool + 2 * 0.5
    assert checked_scores(both, texts, 0, ["p", "q"], env_replies=replies) == [2.0, 1.0]
    with pytest.raises(ValueError, match=r"takes \['env_replies'\].*multi-turn rollout only: rollout.env"):
        checked_scores(tool_answer, texts, 0, ["p", "q"])
    with pytest.raises(ValueError, match="2 env_replies came with the 1 texts"):
        checked_scores(tool_answer, texts[:1], 0, ["p"], env_replies=replies)


def test_weights_for_a_python_reward_list():
    """``reward.weights`` with reward.scorer unset is counted against the scorers passed from
    Python (they are built with it), not against the config's default scorer; a count that does
    not match the built list is refused there; with reward.scorer given, the config counts."""
    from tether.run.config import ConfigError, load_config

    config = load_config(None, ["reward.weights=[1.0, 0.2]"])  # refused before: 2 weights, 1 scorer
    assert config.reward.weights == [1.0, 0.2]

    def f(texts):
        return [1.0] * len(texts)

    def g(completions, **kwargs):
        return [2.0] * len(completions)

    reward = make_scorer([f, g], config.reward.weights)
    # 1.0 * 1.0 + 0.2 * 2.0 = 1.4
    assert checked_scores(reward, ["a", "b"], 0, ["p", "q"]) == pytest.approx([1.4, 1.4])
    with pytest.raises(ValueError, match="one finite weight per reward.scorer"):
        make_scorer([f], config.reward.weights)
    with pytest.raises(ValueError, match="one finite weight per reward.scorer"):
        make_scorer(f, config.reward.weights)
    weighted = make_scorer(f, [3.0])  # one scorer, one weight other than 1: applied
    assert checked_scores(weighted, ["a"], 0) == [3.0]
    assert make_scorer(f, [1.0]) is f
    # a list built already (tether frontier passes one to each run) keeps its weights
    assert make_scorer(reward, config.reward.weights) is reward
    with pytest.raises(ValueError, match="has its own weights"):
        make_scorer(reward, [1.0, 0.5])
    with pytest.raises(ConfigError, match="reward.weights"):
        load_config(None, ["reward.scorer=vader,vader", "reward.weights=[1.0]"])
    with pytest.raises(ConfigError, match="reward.weights"):
        load_config(None, ["reward.weights=[1.0, .nan]"])


@TRAINERS
def test_a_sample_no_reward_scores_is_unscored_as_in_trl(trainer_class):
    """Two rewards returning [None/None, 1/0, 0.25/None, 1/0]: TRL's rewards_per_func has the
    all-NaN row 0 (its ``unscorable_mask``); tether's reward list returns None there (unscored:
    trainers leave it out of every statistic) and the NaN-sums of the others, [1, 0.25, 1]. A
    single reward's None is TRL's unscorable too; where a caller cannot leave a sample out, None
    is refused."""

    def first(completions, **kwargs):
        return [None, 1.0, 0.25, 1.0]

    def second(completions, **kwargs):
        return [None, 0.0, None, 0.0]

    texts = ["a", "b", "c", "d"]
    trl_out = trl_rewards(trainer_class, [first, second])(texts, texts, [[1]] * 4, {})
    assert torch.isnan(trl_out).all(dim=1).tolist() == [True, False, False, False]
    got = checked_scores(WeightedReward({"f": first, "s": second}), texts, 0, texts, allow_none=True)
    assert math.isnan(got[0]) and got[1:] == [1.0, 0.25, 1.0]
    assert trl_out.nansum(dim=1)[1:].tolist() == got[1:]
    alone = checked_scores(first, texts, 0, texts, allow_none=True)
    assert math.isnan(alone[0]) and alone[1:] == [1.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="returned None for a sample; this call needs a score"):
        checked_scores(WeightedReward({"f": first, "s": second}), texts, 0, texts)


def test_async_reward_functions_are_awaited_alone_and_together():
    """TRL awaits ``async def`` reward functions (PR #4567), running a list's together
    (``asyncio.gather``). Alone: the same scores as the sync function. In a list: concurrently,
    on one loop -- ``waits`` returns only once ``sets`` has run, so a one-by-one call would time
    out (a deterministic check, not a timing). Before, the coroutine itself was taken as the
    scores: "TypeError: 'coroutine' object is not iterable"."""
    import asyncio

    async def lengths(completions, **kwargs):
        await asyncio.sleep(0)
        return [len(c) / 10 for c in completions]

    assert checked_scores(lengths, ["ab", "abc"], 0, ["p", "q"]) == pytest.approx([0.2, 0.3])

    async def plain(texts):  # a plain async scorer, called scorer(texts)
        return [1.0 for _ in texts]

    assert checked_scores(plain, ["ab"], 0) == [1.0]
    state: dict = {}

    async def waits(completions, **kwargs):
        await asyncio.wait_for(state.setdefault("go", asyncio.Event()).wait(), timeout=10)
        return [1.0] * len(completions)

    async def sets(completions, **kwargs):
        state.setdefault("go", asyncio.Event()).set()
        return [2.0] * len(completions)

    both = WeightedReward({"waits": waits, "sets": sets, "sync": lambda completions, **kw: [3.0] * 2})
    assert checked_scores(both, ["x", "y"], 0, ["p", "q"]) == [6.0, 6.0]
    state.clear()
    assert both.scored(["p", "q"], ["x", "y"]).parts == {
        "waits": [1.0, 1.0],
        "sets": [2.0, 2.0],
        "sync": [3.0, 3.0],
    }

    async def fails(completions, **kwargs):
        raise KeyError("boom")

    with pytest.raises(ValueError, match=r"reward 'fails': the scorer failed on 1 texts \(KeyError"):
        checked_scores(WeightedReward({"ok": lengths, "fails": fails}), ["x"], 0, ["p"])

    async def exits(completions, **kwargs):
        raise SystemExit(3)

    from tether.judges.contract import ScorerStopped

    with pytest.raises(ScorerStopped, match="SystemExit"):  # a list's SystemExit is not a 'failure'
        checked_scores(WeightedReward({"ok": lengths, "exits": exits}), ["x"], 0, ["p"])
    with pytest.raises(ScorerStopped, match="SystemExit"):
        checked_scores(exits, ["x"], 0, ["p"])


def test_log_metric_and_log_extra_reach_the_step_log_through_a_reward_list():
    """TRL's ``log_metric`` / ``log_extra`` hooks: what a function logs, also inside a reward list,
    lands in the call's RewardLog; ``step_metrics`` averages each name (one process here)."""

    def logs(completions, log_metric, log_extra, **kwargs):
        log_metric("mean_len", sum(len(c) for c in completions) / len(completions))
        log_extra("lengths", [len(c) for c in completions])
        return [0.0] * len(completions)

    log = RewardLog()
    reward = WeightedReward({"logs": logs, "again": logs})
    checked_scores(reward, ["ab", "abcd"], 0, ["p", "q"], reward_log=log)
    assert log.metrics["mean_len"] == [3.0, 3.0]  # (2 + 4) / 2, once per function
    assert log.extra["lengths"] == [2, 4, 2, 4]
    assert log.step_metrics() == {"reward_metric/mean_len": 3.0}


def test_rollout_completion_ids_are_trls():
    """``Rollout.completion_ids`` keeps each row's tokens up to and including its first end
    token and drops the padding, TRL's ``completion_ids_list`` (``c[m].tolist()``, m True up to
    the first EOS)."""
    from tether.models.sampling import Rollout

    response_ids = torch.tensor([[5, 6, 0, 0], [7, 7, 7, 7], [0, 0, 0, 0]])  # pad = EOS = 0
    # TRL's rule, as in GRPOTrainer._generate_single_turn
    is_eos = response_ids == 0
    eos_idx = torch.full((3,), 4)
    eos_idx[is_eos.any(1)] = is_eos.int().argmax(1)[is_eos.any(1)]
    mask = torch.arange(4).expand(3, -1) <= eos_idx[:, None]
    ro = Rollout(
        ["a", "b", "c"],
        torch.zeros(3, 1),
        prompt_mask=torch.ones(3, 1),
        response_ids=response_ids,
        response_mask=mask,
        responses=["", "", ""],
    )
    assert ro.completion_ids == [[5, 6, 0], [7, 7, 7, 7], [0]]
    assert ro.completion_ids == [c[m].tolist() for c, m in zip(response_ids, mask)]


# ---- Part 4: reward models --------------------------------------------------------------------
def _bos_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with a BOS that it adds itself (``add_special_tokens=True``), and a chat
    template that writes BOS too, as Llama's do."""
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)]
    )
    tok.chat_template = "{{ bos_token }}" + TEMPLATE
    tok.padding_side = "left"  # as a policy tokenizer is: TRL pads reward inputs right anyway
    return tok


def _classifier(vocab_size: int, pad_token_id: int, num_labels: int = 1, seed: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
    )
    return LlamaForSequenceClassification(cfg).eval()


@pytest.fixture()
def reward_model_dir(tiny_tokenizer, tmp_path):
    """A saved tiny random one-label Llama sequence classifier with a BOS-adding tokenizer."""
    tok = _bos_tokenizer(tiny_tokenizer)
    folder = tmp_path / "rm"
    _classifier(len(tok), tok.pad_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@TRAINERS
@pytest.mark.parametrize("conversational", [True, False], ids=["conversations", "strings"])
def test_a_reward_model_scores_as_trl_scores_it(trainer_class, conversational, reward_model_dir):
    """``hf:FOLDER`` gives the logits TRL's ``_calculate_rewards`` gives with the same model and
    tokenizer, and TRL's rule written out by hand: conversations through the template, strings
    concatenated, ``add_special_tokens=False``, right padding, logit 0 (float32). Bit for bit:
    the same batch through the same kernels."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts = CONVERSATIONS if conversational else STRINGS
    completions = trl_completions(prompts, TEXTS)
    ours = checked_scores(make_scorer(f"hf:{reward_model_dir}"), TEXTS, 0, prompts, completion_ids=IDS)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    theirs = trl_rewards(trainer_class, [model], [tok])(prompts, completions, IDS, {})[:, 0].tolist()
    assert ours == theirs
    if conversational:
        texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    enc = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        by_hand = model(**enc).logits[:, 0].float().tolist()
    assert ours == by_hand
    assert all(isinstance(s, float) for s in ours)


def test_a_template_that_writes_bos_gets_one_bos(reward_model_dir):
    """The template writes BOS and the tokenizer adds one too when asked: the reward model reads
    exactly one (add_special_tokens=False, as TRL), where the default tokenization would give two."""
    scorer = make_scorer(f"hf:{reward_model_dir}")
    tok, bos = scorer.tokenizer, scorer.tokenizer.bos_token_id
    seen = []
    scorer.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"]), with_kwargs=True)
    checked_scores(scorer, TEXTS, 0, CONVERSATIONS)
    (input_ids,) = seen
    assert [int((row == bos).sum()) for row in input_ids] == [1, 1, 1]
    assert (input_ids[:, 0] == bos).all()  # right padding: BOS first in every row
    text = scorer.texts(CONVERSATIONS, trl_completions(CONVERSATIONS, TEXTS))[0]
    assert tok(text)["input_ids"][:2] == [bos, bos]  # what add_special_tokens=True would have read
    seen.clear()
    checked_scores(scorer, TEXTS, 0, STRINGS)  # strings: no template, and no BOS (TRL's choice)
    assert int((seen[0] == bos).sum()) == 0


@pytest.mark.device
def test_a_reward_model_runs_on_the_requested_device(device, reward_model_dir):
    """The model goes to the run's device; the scores come back float32 values as Python floats."""
    from transformers import AutoModelForSequenceClassification

    scorer = make_scorer(f"hf:{reward_model_dir}", device=torch.device(device))
    assert all(p.device.type == torch.device(device).type for p in scorer.model.parameters())
    got = checked_scores(scorer, TEXTS, 0, STRINGS)
    assert all(isinstance(s, float) and s == float(torch.tensor(s, dtype=torch.float32)) for s in got)
    obj = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    moved = make_scorer(obj, device=torch.device(device))  # a model object moves too
    assert next(moved.model.parameters()).device.type == torch.device(device).type
    assert checked_scores(moved, TEXTS, 0, STRINGS) == pytest.approx(got, abs=1e-6)


def test_reward_model_objects_from_python(reward_model_dir):
    """TRL's reward_funcs entries: a model object (its tokenizer loaded from its name_or_path, as
    TRL does), a (model, tokenizer) pair, and either in a weighted list; each named as TRL names
    it (the last part of the model id) and scoring as hf:FOLDER."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    want = checked_scores(make_scorer(f"hf:{reward_model_dir}"), TEXTS, 0, STRINGS)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    alone = make_scorer(model)
    assert isinstance(alone, RewardModelScorer) and alone.__name__ == "rm"
    assert checked_scores(alone, TEXTS, 0, STRINGS) == want
    assert checked_scores(make_scorer((model, tok)), TEXTS, 0, STRINGS) == want

    def one(texts):
        return [1.0] * len(texts)

    listed = make_scorer([one, (model, tok)], [1.0, 0.5])
    assert list(listed.scorers) == ["one", "rm"]
    assert checked_scores(listed, TEXTS, 0, STRINGS) == pytest.approx([1.0 + 0.5 * w for w in want])


def test_a_label_names_a_logit_of_a_multi_label_classifier(tiny_tokenizer, tmp_path):
    """``#LABEL`` reads another logit than TRL's only one: the default is the last label, ``#0``
    TRL's logit 0; an unknown label is refused."""
    tok = _bos_tokenizer(tiny_tokenizer)
    clf = _classifier(len(tok), tok.pad_token_id, num_labels=2)
    clf.config.id2label, clf.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    clf.save_pretrained(tmp_path / "clf")
    tok.save_pretrained(tmp_path / "clf")
    enc = tok(text=[p + t for p, t in zip(STRINGS, TEXTS)], return_tensors="pt", padding=True,
              padding_side="right", add_special_tokens=False)  # fmt: skip
    with torch.inference_mode():
        logits = clf(**enc).logits.float()  # (3, 2)
    for spec, col in (("", 1), ("#pos", 1), ("#0", 0), ("#neg", 0)):
        got = checked_scores(make_scorer(f"hf:{tmp_path / 'clf'}{spec}"), TEXTS, 0, STRINGS)
        assert got == logits[:, col].tolist(), spec
    with pytest.raises(ValueError, match="labels are"):
        make_scorer(f"hf:{tmp_path / 'clf'}#happy")


def test_conversations_without_a_reward_model_template_are_refused(tiny_tokenizer, tmp_path):
    tok = copy.deepcopy(tiny_tokenizer)
    scorer = RewardModelScorer(_classifier(len(tok), tok.pad_token_id), tok)
    with pytest.raises(ValueError, match="no chat template"):
        checked_scores(scorer, TEXTS, 0, CONVERSATIONS)


# ---- end to end: one GRPO step ------------------------------------------------------------------
def test_a_grpo_step_passes_messages_and_completion_ids(tiny_lm, tiny_tokenizer, tmp_path):
    """One GRPO step on a tiny random model and conversational rows, two Python rewards with
    weights [1, 0.2]: the recording reward gets the prompts as message lists, the completions as
    TRL's one assistant message, completion_ids that decode to that message's content, each
    row's answer, and the trainer state of step 0 of 1; the weighted sum is objective/scores."""
    from transformers import TrainerState

    from tether import load_config, train

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = GEN_TEMPLATE
    rows = [
        {"prompt": [{"role": "user", "content": f"the movie number {i} was"}], "answer": f"a{i}"}
        for i in range(20)
    ]
    seen = []

    def record(prompts, completions, completion_ids, answer, trainer_state, log_metric, **kwargs):
        seen.append(dict(prompts=prompts, completions=completions, ids=completion_ids, answer=answer))
        seen[-1]["state"] = trainer_state
        log_metric("calls", 1.0)
        return [len(ids) / 10 for ids in completion_ids]

    config = load_config(
        None,
        [
            "train.algo=grpo",
            "rollout.group_size=4",
            "rollout.batch_size=8",
            "rollout.max_new_tokens=6",
            "optim.minibatch_size=8",
            "optim.epochs=1",
            "train.steps=1",
            "data.heldout_fraction=0.2",
            "eval.n_prompts=0",
            "eval.every=0",
            "eval.judge=none",
            "train.progress=false",
            "train.save_model=false",
            "train.checkpoint_every=0",
            "reward.weights=[1.0, 0.2]",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    out = train(
        config,
        scorer=[record, rewards.think_format_reward],
        model=tiny_lm,
        tokenizer=tok,
        train_dataset=rows,
    )
    (call,) = seen
    by_prompt = {r["prompt"][0]["content"]: r["answer"] for r in rows}
    assert len(call["prompts"]) == 8
    for p, c, ids, a in zip(call["prompts"], call["completions"], call["ids"], call["answer"]):
        assert isinstance(p, list) and p[0]["role"] == "user" and by_prompt[p[0]["content"]] == a
        assert c == [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}]
        assert 1 <= len(ids) <= 6 and all(isinstance(t, int) for t in ids)
        assert tok.eos_token_id not in ids[:-1]  # up to and including the first EOS
    assert isinstance(call["state"], TrainerState)
    assert (call["state"].global_step, call["state"].max_steps) == (0, 1)
    (row,) = metric_rows(out, timings=True)
    r1 = sum(len(ids) / 10 for ids in call["ids"]) / 8
    assert row["reward/record"] == pytest.approx(r1, abs=1e-6)
    assert row["reward/think_format_reward"] == 0.0  # a random model writes no <think> block
    assert row["objective/scores"] == pytest.approx(r1 + 0.2 * 0.0, abs=1e-6)
    assert row["reward_metric/calls"] == 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    # the run's own record of the responses: the completions' contents, in order; no token ids
    assert [s["response"] for s in samples] == [c[0]["content"] for c in call["completions"]]
    assert not any("completion_ids" in s for s in samples)
    assert not math.isnan(row["objective/kl"])


def test_a_rollout_is_scored_in_one_place_with_its_reward_parts():
    """score_rollout turns a Rollout into TRL's keywords (texts, prompts, columns, completion_ids,
    messages, env_replies) and returns a reward list's parts with the sums: no state is left on
    the scorer between calls."""
    from tether.judges.contract import score_rollout
    from tether.models.sampling import Rollout

    got = {}

    def spy(prompts, completions, completion_ids, answer, env_replies, **kwargs):
        got.update(
            prompts=prompts, completions=completions, ids=completion_ids, answer=answer, env=env_replies
        )
        return [1.0, None]

    ro = Rollout(
        prompts=["p", "q"],
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.tensor([[5, 6], [7, 0]]),
        response_mask=torch.tensor([[True, True], [True, False]]),
        responses=["ab", "c"],
        columns={"answer": ["x", "y"]},
        env_texts=[["t"], []],
        messages=[[{"role": "assistant", "content": "ab"}], [{"role": "assistant", "content": "c"}]],
    )
    out = score_rollout(WeightedReward({"spy": spy, "two": lambda completions, **kw: [2.0, 2.0]}), ro, 3)
    assert out.total[0] == 3.0 and out.total[1] == 2.0  # the None of spy left out of the sum
    assert out.parts["spy"][0] == 1.0 and math.isnan(out.parts["spy"][1]) and out.parts["two"] == [2.0, 2.0]
    assert got == {
        "prompts": ["p", "q"],
        "completions": ro.messages,
        "ids": [[5, 6], [7]],
        "answer": ["x", "y"],
        "env": [["t"], []],
    }
    alone = score_rollout(spy, ro, 3)
    assert alone.parts == {} and alone.total[0] == 1.0 and math.isnan(alone.total[1])
    with pytest.raises(ValueError, match="returned None for a sample"):
        score_rollout(spy, ro, 3, allow_none=False)
