"""Bring your own data and rewards: dataset formats, columns that travel, reward lists, end ids."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal

import pytest
import torch

from tests.conftest import (
    SHA,
    TINY_RUN,
    answer_checker,
    hub_cache,
    length_judge,
    metric_rows,
    offline_cli,
    sometimes_none,
    tiny_run_args,
)
from tether.cli import main
from tether.data.prompts import (
    PromptData,
    load_prompt_data,
    load_rows,
    pair_prompts,
    read_prompt_file,
    split_prompts,
)
from tether.judges.contract import WeightedReward, checked_scores
from tether.judges.scorers import make_scorer

ROWS = [
    {"prompt": f"the movie number {i} was", "answer": f"ans:the movie number {i} was", "id": i}
    for i in range(40)
]


def _jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_format_gives_the_same_rows_with_their_columns(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.to_csv(str(tmp_path / "rows.csv"), index=False)
    specs = [
        _jsonl(tmp_path / "rows.jsonl"),
        tmp_path / "saved",
        tmp_path / "rows.parquet",
        tmp_path / "rows.csv",
    ]
    for spec in specs:
        data = load_prompt_data(str(spec))
        assert data.prompts == [r["prompt"] for r in ROWS], spec
        assert data.columns["answer"] == [r["answer"] for r in ROWS], spec
        assert [int(x) for x in data.columns["id"]] == list(range(40)), spec


def test_the_held_out_split_and_selection_keep_columns_with_their_rows(tmp_path):
    data = load_prompt_data(str(_jsonl(tmp_path / "rows.jsonl")))
    train, held = split_prompts(data, 0.2)
    assert len(train) + len(held) == 40 and len(held) > 0
    for part in (train, held):
        assert all(a == f"ans:{p}" for p, a in zip(part.prompts, part.columns["answer"]))
    # the split is a hash of the prompt alone: the same as for the bare texts
    assert split_prompts([r["prompt"] for r in ROWS], 0.2) == (train.prompts, held.prompts)
    picked = train.select([3, 3, 0])
    assert picked.prompts == [train[3], train[3], train[0]] and picked.row(0) == train.row(3)
    assert train[1:3] == PromptData(train.prompts[1:3], {k: v[1:3] for k, v in train.columns.items()})


def test_a_missing_prompt_column_names_the_field_and_the_columns(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", [{"question": "a"}])
    with pytest.raises(ValueError, match=r"q.jsonl:1.*data.prompt_column='prompt'.*columns \['question'\]"):
        load_prompt_data(str(path))
    assert load_prompt_data(str(path), prompt_column="question").prompts == ["a"]
    import datasets

    datasets.Dataset.from_list([{"question": "a"}]).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"data.prompt_column='prompt'.*\['question'\]"):
        load_prompt_data(str(tmp_path / "d"))


def test_conversations_are_rendered_by_the_chat_template(tiny_tokenizer):
    import copy

    from tether.models.sampling import prompt_texts

    tok = copy.deepcopy(tiny_tokenizer)  # a copy: the session's tokenizer keeps no template
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    convo = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "the movie"}]
    assert prompt_texts(tok, [convo, "plain"]) == ["<system>be kind<user>the movie<assistant>", "plain"]
    with pytest.raises(ValueError, match="no chat template"):
        prompt_texts(tiny_tokenizer, [convo])


def test_weighted_rewards_sum_and_skip_none():
    """r1 = length / 100, r2 = 1.0 for even lengths and None for odd ones, weights [1, 0.5]:
    'ab' -> 0.02 + 0.5 * 1.0 = 0.52; 'abc' -> 0.03 (r2 left out); '' -> 0.0 + 0.5 = 0.5."""
    reward = make_scorer(["tests.conftest:length_judge", "tests.conftest:sometimes_none"], [1.0, 0.5])
    assert isinstance(reward, WeightedReward)
    assert list(reward.scorers) == ["length_judge", "sometimes_none"]
    assert checked_scores(reward, ["ab", "abc", ""], 0, ["p", "q", "r"]) == pytest.approx([0.52, 0.03, 0.5])
    parts = reward.scored(["p", "q", "r"], ["ab", "abc", ""]).parts  # each reward's values, by name
    assert parts["length_judge"] == pytest.approx([0.02, 0.03, 0.0])
    assert parts["sometimes_none"][0] == 1.0 and math.isnan(parts["sometimes_none"][1])
    with pytest.raises(ValueError, match="returned None for a sample"):  # alone, None is no score
        checked_scores(sometimes_none, ["abc"], 0)
    with pytest.raises(ValueError, match="one finite weight per reward.scorer"):
        WeightedReward({"a": length_judge}, [1.0, 2.0])


def test_a_reward_function_gets_the_columns_it_names():
    got = checked_scores(
        answer_checker, ["xx", "y"], 0, ["a", "b"], {"answer": ["ans:a", "ans:b"], "id": [1, 2]}
    )
    assert got == [0.2, 0.1]
    with pytest.raises(ValueError, match="answer 'ans:b' came with prompt 'a'"):
        checked_scores(answer_checker, ["x"], 0, ["a"], {"answer": ["ans:b"]})
    with pytest.raises(ValueError, match=r"it takes \['answer'\]"):
        checked_scores(answer_checker, ["x"], 0, ["a"])


def _train(tmp_path, data, *extra):
    return [
        "train",
        f"data.prompts={data}",
        "data.heldout_fraction=0.2",
        "rollout.batch_size=8",
        "rollout.max_new_tokens=4",
        "optim.minibatch_size=4",
        "optim.epochs=1",
        "train.steps=2",
        "train.sample_every=1",
        "eval.n_prompts=4",
        "eval.every=0",
        "eval.judge=tests.conftest:answer_checker",
        "train.progress=false",
        "train.save_model=false",
        "train.checkpoint_every=0",
        f"train.output_dir={tmp_path / 'run'}",
        *extra,
    ]


def test_grpo_reward_gets_each_rows_answer_and_two_rewards_are_logged(tiny_model_dir, tmp_path):
    """GRPO with G = 4: the answer column is repeated with its prompt across the group; the samples
    keep it. Two rewards with weights [1, 0.5]: both logged, and the score is their weighted sum."""
    data = _jsonl(tmp_path / "rows.jsonl")
    args = _train(
        tmp_path,
        data,
        f"model.name={tiny_model_dir}",
        "train.algo=grpo",
        "rollout.group_size=4",
        "reward.scorer=tests.conftest:answer_checker,tests.conftest:constant_scorer",
        "reward.weights=[1.0, 0.5]",
    )
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        # mean of (r1 + 0.5 * r2) = mean(r1) + 0.5 * 0.5; float32 sums of 8 values ~1: 8 * 2**-23 * 2
        assert r["objective/scores"] == pytest.approx(r["reward/answer_checker"] + 0.25, abs=8 * 2**-23 * 2)
        assert r["reward/constant_scorer"] == 0.5
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["columns"]["answer"] == f"ans:{s['prompt']}" for s in samples)


def test_a_cached_hub_dataset_trains_offline(tiny_model_dir, tmp_path):
    home = tmp_path / "hf"
    hub_cache(home, "tiny-org/tiny-llama", tiny_model_dir)
    (tmp_path / "empty").mkdir()
    snap = hub_cache(home, "tiny-org/reviews", tmp_path / "empty", kind="datasets") / "snapshots" / SHA
    _jsonl(snap / "train.jsonl")
    p = offline_cli(
        home,
        *_train(
            tmp_path,
            "tiny-org/reviews",
            "model.name=tiny-org/tiny-llama",
            "reward.scorer=tests.conftest:answer_checker",
        ),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    p = offline_cli(home, *_train(tmp_path / "x", "tiny-org/not-cached", "model.name=tiny-org/tiny-llama"))
    assert (
        p.returncode == 1
        and "data.prompts='tiny-org/not-cached'" in p.stderr
        and "HF_HUB_OFFLINE=1" in p.stderr
    )


def test_a_tracker_gets_every_metric_row_and_the_sample_tables(tiny_model_dir, prompt_file, tmp_path):
    from tests.conftest import RecordingTracker

    RecordingTracker.rows, RecordingTracker.tables, RecordingTracker.finished = [], [], False
    args = _train(
        tmp_path,
        prompt_file,
        f"model.name={tiny_model_dir}",
        "reward.scorer=tests.conftest:length_judge",
        "eval.judge=none",
        "train.report_to=tests.conftest:RecordingTracker",
    )
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the metric rows (the final evaluation's and the alarms' are tests/e2e/test_reporting.py's)
    got = [(s, v) for s, v in RecordingTracker.rows if not any(k.startswith(("final/", "alarm")) for k in v)]
    assert [s for s, _ in got] == [r["step"] for r in rows]
    for (_, values), row in zip(got, rows):
        assert values == {k: v for k, v in row.items() if k != "step"}  # the very numbers of metrics.jsonl
    assert RecordingTracker.config["kl.kl_coef"] == 0.05 and RecordingTracker.finished
    assert [(t[0], t[1]) for t in RecordingTracker.tables] == [("samples", 0), ("samples", 1)]
    assert RecordingTracker.tables[0][2][:3] == ["prompt", "response", "score"]


def test_an_uninstalled_tracker_is_a_config_error_before_anything_is_written(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = tmp_path / "run"
    assert main(["train", "train.report_to=wandb", f"train.output_dir={out}"]) == 2
    assert "train.report_to='wandb'" in capsys.readouterr().err and not out.exists()
    assert main(["train", "train.report_to=nope"]) == 2


def test_train_takes_a_model_a_tokenizer_a_dataset_and_a_scorer_as_objects(tiny_lm, tiny_tokenizer, tmp_path):
    """TRL's way: objects, not names. model.name stays the default, which is never loaded."""
    from tether import load_config, train

    config = load_config(
        None,
        [
            "data.heldout_fraction=0.2",
            "rollout.batch_size=4",
            "rollout.max_new_tokens=4",
            "optim.minibatch_size=2",
            "optim.epochs=1",
            "train.steps=1",
            "eval.n_prompts=0",
            "eval.judge=none",
            "train.progress=false",
            "train.save_model=false",
            "train.checkpoint_every=0",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    out = train(config, scorer=answer_checker, model=tiny_lm, tokenizer=tiny_tokenizer, train_dataset=ROWS)
    rows = metric_rows(out, timings=True)
    assert rows[0]["objective/kl"] == 0.0 and rows[0]["objective/scores"] >= 0.0


def test_reward_funcs_is_trls_name_for_scorer(tiny_lm, tiny_tokenizer, tmp_path):
    """README's `tether.train(config, model=..., train_dataset=..., reward_funcs=...)` (issue 50):
    TRL's keyword trains on the reward as scorer= does; both at once are refused by name."""
    import yaml

    from tether import load_config, train

    config = load_config(None, [f"{k}={v}" for k, v in TINY_RUN.items() if k != "reward.scorer"])
    config.train.output_dir = str(tmp_path / "both")
    with pytest.raises(TypeError, match=r"both scorer=\.\.\. and reward_funcs=\.\.\."):
        train(
            config, scorer=length_judge, reward_funcs=answer_checker, model=tiny_lm, tokenizer=tiny_tokenizer
        )
    assert not (tmp_path / "both").exists()
    config.train.output_dir = str(tmp_path / "run")
    out = train(
        config, model=tiny_lm, tokenizer=tiny_tokenizer, train_dataset=ROWS, reward_funcs=answer_checker
    )
    assert yaml.safe_load((out / "config.yaml").read_text())["reward"]["scorer"] == [
        "(from Python) answer_checker"
    ]
    assert metric_rows(out, timings=True)[0]["objective/scores"] >= 0.0  # answer_checker checked every row


def test_dpo_reads_trls_preference_formats(tiny_tokenizer, tmp_path):
    """Standard (strings) and conversational (messages) rows, from a saved dataset; a text
    response gets EOS, a conversational one is the chat template's tokens (below)."""
    import datasets

    from tests.conftest import make_chat_tokenizer
    from tether.trainers.dpo import read_pair_file

    standard = {"prompt": "the movie", "chosen": " was great", "rejected": " was bad"}
    convo = {
        "prompt": [{"role": "user", "content": "the movie"}],
        "chosen": [{"role": "assistant", "content": " was great"}],
        "rejected": [{"role": "assistant", "content": " was bad"}],
    }
    eos = tiny_tokenizer.eos_token_id
    want = [
        tiny_tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in (" was great", " was bad")
    ]
    datasets.Dataset.from_list([standard, standard]).save_to_disk(str(tmp_path / "d"))
    prompts, chosen, rejected = read_pair_file(str(tmp_path / "d"), tiny_tokenizer)
    assert prompts == [standard["prompt"]] * 2
    assert [chosen[0].tolist(), rejected[0].tolist()] == want
    chat = make_chat_tokenizer()
    datasets.Dataset.from_list([convo, convo]).save_to_disk(str(tmp_path / "c"))
    prompts, chosen, rejected = read_pair_file(str(tmp_path / "c"), chat)
    assert prompts == [convo["prompt"]] * 2
    # ChatML: the response's text, then <|im_end|> (301) and the newline after it, no EOS
    assert chat.decode(chosen[0]) == " was great<|im_end|>\n" and chosen[0].tolist()[-2] == 301
    datasets.Dataset.from_list([{"prompt": "x", "chosen": "", "rejected": "y"}]).save_to_disk(
        str(tmp_path / "e")
    )
    with pytest.raises(ValueError, match=r"row 1 needs non-empty"):
        read_pair_file(str(tmp_path / "e"), tiny_tokenizer)


def _trl_dpo_ids(tokenizer, row):
    """TRL 1.16's DPO tokens of one row, by its own functions in its own order
    (DPOTrainer._prepare_dataset: extract_prompt if no prompt, EOS for text, then tokenize_fn)."""
    from trl.data_utils import _tokenize, common_prefix_length, extract_prompt, is_conversational

    if "prompt" not in row:
        row = extract_prompt(row)
    if not is_conversational(row):
        row = {**row, **{k: row[k] + tokenizer.eos_token for k in ("chosen", "rejected")}}
        p = _tokenize(tokenizer, row["prompt"])["input_ids"]
        pc = _tokenize(tokenizer, row["prompt"] + row["chosen"])["input_ids"]
        pr = _tokenize(tokenizer, row["prompt"] + row["rejected"])["input_ids"]
    else:
        p = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True)["input_ids"]
        pc = _tokenize(tokenizer, row["prompt"] + row["chosen"])["input_ids"]
        pr = _tokenize(tokenizer, row["prompt"] + row["rejected"])["input_ids"]
    n = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
    return row["prompt"], pc[n:], pr[n:]


@pytest.mark.parametrize("explicit", [True, False])
def test_conversational_pairs_are_trls_tokens_implicit_prompt_included(tmp_path, explicit):
    """A conversational pair, with its prompt given or implicit (TRL's extract_prompt: the common
    prefix of messages): the same prompt, and the same chosen and rejected ids as TRL's DPO."""
    import json

    from tests.conftest import make_chat_tokenizer
    from tether.trainers.dpo import read_pair_file

    chat = make_chat_tokenizer()
    user = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the movie was"}]
    good, bad = [{"role": "assistant", "content": "great fun"}], [{"role": "assistant", "content": "dull"}]
    row = (
        {"prompt": user, "chosen": good, "rejected": bad}
        if explicit
        else {"chosen": user + good, "rejected": user + bad}
    )
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    prompts, chosen, rejected = read_pair_file(str(tmp_path / "p.jsonl"), chat)
    prompt, want_c, want_r = _trl_dpo_ids(chat, row)
    assert prompts == [prompt] == [user]
    assert (chosen[0].tolist(), rejected[0].tolist()) == (want_c, want_r)


def test_implicit_text_prompts_are_trls_and_degenerate_rows_are_refused(tiny_tokenizer, tmp_path):
    import json

    from tether.data.prompts import explicit_pair
    from tether.trainers.dpo import read_pair_file

    row = {"chosen": "the movie was great", "rejected": "the movie was bad"}
    # TRL: the common prefix 'the movie was ' loses its last space to the responses
    assert explicit_pair(row, "r") == {"prompt": "the movie was", "chosen": " great", "rejected": " bad"}
    from trl.data_utils import extract_prompt

    assert explicit_pair(row, "r") == extract_prompt(row)
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    prompts, chosen, _ = read_pair_file(str(tmp_path / "p.jsonl"), tiny_tokenizer)
    assert prompts == ["the movie was"]
    assert chosen[0].tolist() == tiny_tokenizer(" great", add_special_tokens=False)["input_ids"] + [
        tiny_tokenizer.eos_token_id
    ]
    with pytest.raises(ValueError, match="share no prompt to extract \\(they differ from the start\\)"):
        explicit_pair({"chosen": "good", "rejected": "bad"}, "p.jsonl:1")
    with pytest.raises(ValueError, match="share no prompt to extract \\(one is the other's start\\)"):
        explicit_pair({"chosen": "the movie", "rejected": "the movie was bad"}, "p.jsonl:1")
    with pytest.raises(ValueError, match="unpaired preference row .* TRL's KTOTrainer"):
        explicit_pair({"prompt": "a", "completion": "b", "label": True}, "p.jsonl:1")


def test_dpo_refuses_a_response_holding_a_tools_message(tiny_tokenizer, tmp_path):
    """A tool's message in "chosen" is not the policy's text: joined into the response, its tokens
    would get DPO's gradient as the policy's. Refused, the row, the field and the role named."""
    import json

    from tether.trainers.dpo import read_pair_file

    row = {
        "prompt": [{"role": "user", "content": "the movie"}],
        "chosen": [
            {"role": "assistant", "content": "was"},
            {"role": "tool", "content": " great acting"},
            {"role": "assistant", "content": " fun"},
        ],
        "rejected": [{"role": "assistant", "content": "was bad"}],
    }
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1 \"chosen\" holds \['tool'\] messages"):
        read_pair_file(str(tmp_path / "p.jsonl"), tiny_tokenizer)


def test_a_reward_model_reads_prompt_and_completion_together(tiny_tokenizer, tmp_path):
    """hf:FOLDER scores prompt + completion (a conversation through the classifier's chat
    template), not the completion alone: its scores equal the classifier's logits of those texts."""
    import copy

    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    clf = LlamaForSequenceClassification(cfg).eval()
    tok = copy.deepcopy(tiny_tokenizer)
    tok.padding_side = "right"
    for template in (None, "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"):
        tok.chat_template = template
        folder = tmp_path / f"rm-{template is not None}"
        clf.save_pretrained(folder)
        tok.save_pretrained(folder)
        score = make_scorer(f"hf:{folder}")
        # as TRL: string prompts are concatenated with the completion, conversations go through
        # the reward model's template (tests/judges/test_trl_contract.py checks TRL's rule in full)
        prompts = (
            ["the movie", "the film"]
            if template is None
            else [[{"role": "user", "content": "the movie"}], [{"role": "user", "content": "the film"}]]
        )
        got = checked_scores(score, [" was great", " was bad"], 0, prompts)
        texts = (
            ["the movie was great", "the film was bad"]
            if template is None
            else ["[user]the movie[assistant] was great", "[user]the film[assistant] was bad"]
        )
        loaded = AutoModelForSequenceClassification.from_pretrained(folder).eval()  # as the scorer loads it
        with torch.no_grad():  # the same padded batch the scorer builds: the same numbers, bit for bit
            want = (
                loaded(**tok(texts, return_tensors="pt", padding=True, truncation=True)).logits[:, 0].tolist()
            )
        assert got == want, template


def test_train_dataset_types_are_read_or_refused(tiny_tokenizer):
    """A DatasetDict gives its data.split, a DataFrame its rows; a path string is refused, not read
    character by character."""
    import datasets
    import pandas as pd

    from tether.run.config import load_config
    from tether.run.setup import dataset_prompts

    cfg = load_config(None, ["data.heldout_fraction=0.2"])
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:3])}
    )
    for given in (dd, pd.DataFrame(ROWS), ROWS):
        train, held = dataset_prompts(given, cfg)
        assert sorted(train.prompts + held.prompts) == sorted(r["prompt"] for r in ROWS), type(given)
        assert all(a == f"ans:{p}" for p, a in zip(train.prompts, train.columns["answer"]))
    with pytest.raises(ValueError, match="a str is not a dataset"):
        dataset_prompts("rows.jsonl", cfg)
    with pytest.raises(ValueError, match="data.split='validation'"):
        dataset_prompts(dd, load_config(None, ["data.split=validation"]))
    with pytest.raises(ValueError, match="holds no rows"):
        dataset_prompts([], cfg)


def test_a_reward_needing_a_missing_column_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"the movie {i}\n" for i in range(20)))
    args = [
        "train",
        f"data.prompts={prompts}",
        "reward.scorer=tests.conftest:answer_checker",
        f"train.output_dir={out}",
    ]
    import tether.run.setup as setup

    # the embedded model's name checks in a second; its caching and load would come after the data
    def no_load(*a, **k):
        raise AssertionError("the model loaded before the column check")

    monkeypatch.setattr(setup, "resolve_model_path", no_load)
    monkeypatch.setattr(setup, "load_causal_lm", no_load)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "needs the dataset column(s) ['answer']" in err and "data.prompts" in err and not out.exists()


def test_tensorboard_through_report_to(tiny_model_dir, prompt_file, tmp_path):
    args = _train(
        tmp_path,
        prompt_file,
        f"model.name={tiny_model_dir}",
        "reward.scorer=tests.conftest:length_judge",
        "eval.judge=none",
        "train.report_to=tensorboard",
    )
    assert main(args) == 0
    assert list((tmp_path / "run").rglob("events.out.tfevents.*"))


def test_jsonl_objects_numbers_lines_and_refuses_what_is_not_an_object(tmp_path):
    """The one strict reader of a user's .jsonl (prompt files and data.prompts rows alike)."""
    from tether.data.prompts import jsonl_objects, read_prompt_file

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b", "answer": 2}\n')  # line 2 is blank
    assert jsonl_objects(good) == [(1, {"prompt": "a"}), (3, {"prompt": "b", "answer": 2})]
    assert read_prompt_file(good) == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"data.reward_data: .*bad.jsonl:2 needs a JSON object"):
        jsonl_objects(bad, "data.reward_data")
    with pytest.raises(ValueError, match=r"data.prompts: .*bad.jsonl:2 needs a JSON object"):
        read_prompt_file(bad)


def test_an_async_reward_with_unscored_samples_trains_as_trl_does(tiny_model_dir, tmp_path):
    """GRPO, G = 4, an ``async def`` reward (awaited, as TRL awaits one) that returns None for the
    first sample of each group: that sample leaves its group's statistics. Each step logs
    ``reward/unscored_fraction`` 1/4, samples.jsonl has score and reward None for it, and the
    step's score is the mean of the scored samples alone (the old code averaged the 0 it put there)."""
    data = _jsonl(tmp_path / "rows.jsonl")
    args = _train(
        tmp_path,
        data,
        f"model.name={tiny_model_dir}",
        "train.algo=grpo",
        "rollout.group_size=4",
        "reward.scorer=tests.conftest:async_first_of_four_unscored",
        "eval.judge=tests.conftest:async_length_judge",
    )
    assert main(args) == 0
    rows = metric_rows(tmp_path / "run")
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["reward/unscored_fraction"] == 0.25
        mine = [s for s in samples if s["step"] == r["step"]]
        assert len(mine) == 8
        assert [s["score"] is None for s in mine] == [True, False, False, False] * 2
        assert all((s["reward"] is None) == (s["score"] is None) for s in mine)
        scored = [s["score"] for s in mine if s["score"] is not None]
        # float32 scores of 6 values <= 0.5: rounding 6 * 2**-24 at most
        assert r["objective/scores"] == pytest.approx(sum(scored) / len(scored), abs=6 * 2**-24)
        # the gold judge (an async function too) scored every sample of the step
        assert all(isinstance(s["gold"], float) for s in mine)
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["policy"]["proxy_mean"] == report["policy"]["proxy_mean"]  # held-out: a number, not NaN


def test_copies_of_a_held_out_prompt_count_once(tiny_model_dir, tmp_path, caplog):
    """30 prompts x 3 copies, the hash's 25% share: 4 distinct prompts are held out (reviews 1, 7,
    11, 20). Every copy hashes to the same side; the held-out set keeps each prompt once, so the
    final evaluation reports n_prompts 4 with SEs over 4 units, not 12 (the old count, which made
    every SE too small). The training side keeps its copies (the data's weighting, as TRL's)."""
    from tether.run.setup import train_on_the_rest, unique_prompts

    prompts = [f"review {i}: the film" for i in range(30)] * 3
    train, held = split_prompts(PromptData(prompts), 0.25)
    assert unique_prompts(held, "data.prompts").prompts == [f"review {i}: the film" for i in (1, 7, 11, 20)]
    assert len(train) == 26 * 3 and len(held) == 4 * 3  # both sides keep their copies
    assert "holds 8 repeated prompt(s)" in caplog.text
    # with its own held-out set, a run trains on both sides with every copy: 90 - 3 copies of the
    # one prompt the evaluation holds (a held-out share kept once lost its copies here)
    kept = train_on_the_rest(train, held, PromptData(["review 20: the film"]))
    assert len(kept) == 87 and kept.prompts.count("review 7: the film") == 3
    data = tmp_path / "copies.txt"
    data.write_text("\n".join(prompts) + "\n")
    args = tiny_run_args(
        tiny_model_dir,
        data,
        tmp_path / "run",
        {"data.heldout_fraction": 0.25, "eval.n_prompts": 64, "eval.fluency_model": "none"},
        command=True,
    )
    assert main(args) == 0
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["n_prompts"] == 4  # 12 before
    assert report["policy"]["n"] == 4 * report["samples_per_prompt"]


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail where tether would read a FIFO or a device forever, instead of hanging the tests."""

    def fail(*_):
        raise TimeoutError(f"still reading after {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("kind", ["a character device", "a FIFO (named pipe)"])
def test_a_device_or_a_fifo_named_as_data_is_refused_unread(
    kind, tiny_model_dir, prompt_file, tmp_path, capsys
):
    """``data.prompts=/dev/zero`` was called a Hub id not in the cache (a path that exists but is
    neither a file nor a folder went to the Hub branch), and a FIFO named as a prompt file was
    read, which never ends while no one writes to it. Every reader of a data source refuses both,
    naming the field and what the path is, before reading a byte."""
    path = "/dev/zero"
    if kind.startswith("a FIFO"):
        path = str(tmp_path / "prompts.jsonl")
        os.mkfifo(path)
    readers = [
        ("data.prompts", lambda: load_prompt_data(path)),
        ("data.prompts", lambda: read_prompt_file(path)),
        ("dpo.pairs", lambda: load_rows(path, field_name="dpo.pairs")),
        ("dpo.pairs", lambda: pair_prompts(path)),
    ]
    with _deadline(60):
        for field, read in readers:
            with pytest.raises(ValueError, match=re.escape(f"{field}='{path}' is {kind}, not a file of")):
                read()
        base = [
            "train",
            f"model.name={tiny_model_dir}",
            "train.steps=1",
            f"train.output_dir={tmp_path / 'run'}",
        ]
        for given in (
            [f"data.prompts={path}"],
            [f"data.prompts={prompt_file}", f"data.eval_prompts={path}"],
            ["train.algo=dpo", f"dpo.pairs={path}"],
        ):
            assert main(base + given) == 1
            err = capsys.readouterr().err
            field = given[-1].split("=")[0]
            assert f"{field}='{path}' is {kind}, not a file of" in err and "Hugging Face cache" not in err
            assert not (tmp_path / "run").exists()


def test_a_step_no_reward_scores_logs_no_score(tiny_model_dir, tmp_path, capsys):
    """Every sample unscored: the step has no score, so objective/scores, its std and the rlhf
    reward are left out of the row (a 0 there would read as a score; TRL logs NaN), the KL is still
    logged, the advantages are all 0, and the evaluation says every sample was unscored."""
    data = _jsonl(tmp_path / "rows.jsonl")
    args = _train(tmp_path, data, f"model.name={tiny_model_dir}", "train.algo=grpo", "rollout.group_size=4")
    args += ["reward.scorer=tests.conftest:never_scores", "eval.judge=none"]
    assert main(args) == 0
    for r in metric_rows(tmp_path / "run"):
        assert "objective/scores" not in r and "objective/rlhf_reward" not in r
        assert r["reward/unscored_fraction"] == 1.0 and "objective/kl" in r
    out = capsys.readouterr().out
    assert "8 of 8 samples unscored, left out" in out


def test_a_ppo_step_with_nothing_scored_leaves_the_weights_as_they_were(tiny_model_dir, tmp_path):
    """PPO leaves unscored samples out of its update: with none scored its minibatches hold no valid
    token, and no optimizer step is taken (before: the loss was 0, yet AdamW's momentum and weight
    decay moved the weights). The saved policy is the starting model, bit for bit."""
    from safetensors.torch import load_file

    data = _jsonl(tmp_path / "rows.jsonl")
    args = _train(tmp_path, data, f"model.name={tiny_model_dir}", "reward.scorer=tests.conftest:never_scores")
    args += ["train.save_model=true", "eval.judge=none", "eval.n_prompts=0", "optim.weight_decay=0.1"]
    assert main(args) == 0
    rows = metric_rows(tmp_path / "run")
    assert all(
        r["optim/skipped_steps"] == 2.0 and r["policy/grad_norm"] == 0.0 for r in rows
    )  # 2 minibatches
    start = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    end = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    assert all(torch.equal(start[k], end[k]) for k in start)


def test_dpo_eos_is_not_doubled_and_mixed_formats_are_refused(tiny_tokenizer, tmp_path):
    """TRL's add_eos: a text response that already ends with EOS gets none more; a row mixing a
    text prompt with message responses has no one rendering (TRL refuses it too)."""
    import json

    from tether.trainers.dpo import read_pair_file

    eos = tiny_tokenizer.eos_token
    row = {"prompt": "the movie", "chosen": " was great" + eos, "rejected": " was bad"}
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    _, chosen, rejected = read_pair_file(str(tmp_path / "p.jsonl"), tiny_tokenizer)
    assert chosen[0].tolist() == tiny_tokenizer(" was great", add_special_tokens=False)["input_ids"] + [
        tiny_tokenizer.eos_token_id
    ]
    assert (
        rejected[0].tolist()[-1] == tiny_tokenizer.eos_token_id
        and rejected[0].tolist()[-2] != tiny_tokenizer.eos_token_id
    )
    mixed = {
        "prompt": "hi",
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}],
    }
    (tmp_path / "m.jsonl").write_text(json.dumps(mixed) + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:1 mixes formats: \"prompt\" is text"):
        read_pair_file(str(tmp_path / "m.jsonl"), tiny_tokenizer)


def test_a_dpo_tools_column_on_a_text_prompt_is_refused_not_ignored(tiny_tokenizer, tmp_path):
    """A text prompt is rendered by no chat template, so a row's `tools` would change nothing (TRL
    ignores it there): refused by name. Conversational rows: tests/e2e/test_tools.py."""
    import json

    from tether.trainers.dpo import read_pair_file

    row = {"prompt": "a", "chosen": " b", "rejected": " c", "tools": [{"type": "function"}]}
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(
        ValueError, match=r'p.jsonl:1 has a "tools" or "chat_template_kwargs" column and a text'
    ):
        read_pair_file(str(tmp_path / "p.jsonl"), tiny_tokenizer)
    row = {"prompt": [{"role": "user", "content": "a"}], "chosen": [], "rejected": [], "tools": "[{"}
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r'p.jsonl:1: its "tools" column is text that is not JSON'):
        read_pair_file(str(tmp_path / "p.jsonl"), tiny_tokenizer)
