"""Multi-turn rollouts end to end: a tool answers between policy turns (rollout.env)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import metric_rows
from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main


@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo"])
def test_tool_turns_end_to_end(algo, tiny_model_dir, prompt_file, tmp_path):
    """Step 0 with tool turns: KL exactly 0, the first ratio exactly 1, the environment's tokens
    counted apart from the policy's, and samples.jsonl showing what the tool wrote."""
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + [
        f"train.algo={algo}",
        "train.steps=2",
        "rollout.max_new_tokens=16",
        "rollout.env=tests.conftest:tool_env",
        "rollout.max_turns=2",
        "rollout.stop_strings=e",  # in most of the tiny vocabulary's words
        # the transcript's length (groups that differ), from a reward that reads env_replies
        "reward.scorer=tests.conftest:replies_judge",
        "eval.judge=tests.conftest:replies_judge",
    ]
    if algo != "ppo":
        args.append("rollout.group_size=2")
    assert main(args) == 0
    rows = metric_rows(out)
    assert rows[0]["objective/kl"] == 0.0 and rows[0]["objective/kl_exact"] == 0.0
    assert rows[0]["policy/ratio_max_dev_first"] == 0.0
    assert rows[0]["rollout/logprob_mismatch"] < 1e-4  # the sampler's log-probs are the learner's
    assert all(r["rollout/env_tokens"] > 0 for r in rows), "the test needs rows that called the tool"
    assert rows[1]["objective/kl_exact"] > 0.0  # the update moved the policy
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if s["env"]]
    # one tool answer per called row, whole or cut at the token budget
    assert called and all(len(s["env"]) == 1 and " [tool: 42]".startswith(s["env"][0]) for s in called)
    assert any(s["env"] == [" [tool: 42]"] for s in called)
    assert all(s["env"][0] in s["response"] for s in called)  # the reward read the transcript
    # where each reply stands in the transcript, for the readers that mark it
    assert all(s["response"][s["env_at"][0] :].startswith(s["env"][0]) for s in called)
    assert all(s["policy_tokens"] + s["env_tokens"] <= 16 for s in samples)
    print(
        f"{algo}: per step, policy tokens per response {[r['response/length'] for r in rows]}, "
        f"environment tokens {[r['rollout/env_tokens'] for r in rows]}"
    )


@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo"])
def test_chat_tool_turns_end_to_end(algo, chat_model_dir, chat_prompt_file, tmp_path):
    """Conversational prompts: the tool's reply goes through the chat template as a tool message
    (rollout.env_format=auto), the environment and a TRL-style reward get messages, and step 0
    is exact (KL 0, first ratio 1, the sampler's log-probs the learner's)."""
    out = tmp_path / "run"
    args = _tiny_args(chat_model_dir, chat_prompt_file, out) + [
        f"train.algo={algo}",
        "train.steps=2",
        "rollout.max_new_tokens=40",
        "rollout.env=tests.conftest:chat_tool_env",  # asserts it gets messages
        "rollout.max_turns=2",
        "rollout.stop_strings=e",
        "reward.scorer=tests.conftest:messages_judge",  # asserts it gets messages
        "eval.judge=tests.conftest:messages_judge",
    ]
    if algo != "ppo":
        args.append("rollout.group_size=2")
    assert main(args) == 0
    rows = metric_rows(out)
    assert rows[0]["objective/kl"] == 0.0 and rows[0]["objective/kl_exact"] == 0.0
    assert rows[0]["policy/ratio_max_dev_first"] == 0.0
    assert rows[0]["rollout/logprob_mismatch"] < 1e-4
    assert all(r["rollout/env_tokens"] > 0 for r in rows), "the test needs rows that called the tool"
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if s["env"]]
    assert called and all(s["env"] == ["42"] and "42" in s["response"] for s in called)
    # the template's framing is the environment's: the turn ended at a stop string, so the
    # assistant's closing too, "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
    # 20 tokens of the tiny tokenizer (closing 2, the tool header 6, "42" 2, closing 2, the
    # assistant header 8)
    assert all(s["env_tokens"] == 20 for s in called), [s["env_tokens"] for s in called]
    assert all("<|im_start|>" not in s["response"] for s in samples)  # the reward's text: contents only
    # samples.jsonl keeps the messages, and the gold judge got them as the reward did: a called
    # row's last assistant message is its second turn, shorter than the joined text
    for s in called:
        assert [m["role"] for m in s["messages"]] == ["assistant", "tool", "assistant"]
        assert s["score"] == pytest.approx(len(s["messages"][-1]["content"]) / 10)
        assert s["gold"] == pytest.approx(s["score"]) and len(s["response"]) / 10 > s["score"]
    print(
        f"{algo} (chat): per step, policy tokens per response {[r['response/length'] for r in rows]}, "
        f"environment tokens {[r['rollout/env_tokens'] for r in rows]}"
    )


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["rollout.env=tests.conftest:tool_env", "rollout.stop_strings=e"], "rollout.max_turns"),
        (["rollout.env=tests.conftest:tool_env", "rollout.max_turns=2"], "rollout.stop_strings"),
        (  # text prompts the chat template does not render
            ["rollout.env=tests.conftest:tool_env", "rollout.max_turns=2", "rollout.env_format=chat"],
            "rollout.env_format",
        ),
        (
            [
                "rollout.env=tests.conftest:tool_env",
                "rollout.max_turns=2",
                "rollout.stop_strings=e",
                "rollout.env_format=raw",
                "rollout.env_format=json",
            ],
            "rollout.env_format",
        ),
        (["rollout.env_format=raw"], "rollout.env_format"),  # no env: it would be ignored
        (["rollout.max_turns=3"], "rollout.max_turns"),
        (["rollout.stop_strings=e"], "rollout.stop_strings"),  # no env: it would be ignored
        (
            [
                "rollout.env=tests.conftest:tool_env",
                "rollout.max_turns=2",
                "rollout.stop_strings=[Answer: x]",
            ],
            "rollout.stop_strings",
        ),
        (  # reads as a list, and YAML cannot parse it: it was the literal stop string '[a, b]]'
            ["rollout.env=tests.conftest:tool_env", "rollout.max_turns=2", "rollout.stop_strings=[a, b]]"],
            "rollout.stop_strings",
        ),
        (
            [
                "rollout.env=tests.conftest:tool_env",
                "rollout.max_turns=2",
                "rollout.stop_strings=e",
                "train.algo=dpo",
            ],
            "rollout.env",
        ),
        (
            ["rollout.env=tests.conftest:no_such_tool", "rollout.max_turns=2", "rollout.stop_strings=e"],
            "rollout.env",
        ),
    ],
)
def test_tool_turn_settings_are_checked(overrides, field, tiny_model_dir, prompt_file, tmp_path, capsys):
    assert main(_tiny_args(tiny_model_dir, prompt_file, tmp_path / "run") + overrides) != 0
    assert field in capsys.readouterr().err


def test_the_calculator_example_tool_and_reward():
    """examples/grpo_calculator_tool.py's tool and 0/1 reward, hand-worked."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from grpo_calculator_tool import answer_reward, calculator, final_answer

    assert calculator("", " calc(58 + 17)", 0) == " -> 75\n"  # 58 + 17 = 75
    assert (
        calculator("", " calc(9 * 12)", 0) == " -> 108\n" and calculator("", " calc(5 - 7)", 0) == " -> -2\n"
    )
    assert calculator("", " 75 (done)", 0) is None  # the turn did not end with a call: the episode ends
    # the tool's answer, not what follows it
    assert final_answer(" calc(58 + 17) -> 75\n80 + 1", [" -> 75\n"]) == "75"
    assert (
        final_answer(" 75\n", []) == "75" and final_answer(" no", []) is None
    )  # no call: the leading integer
    # a policy that writes the tool's "-> 75" itself, the tool never called: not the tool's answer
    assert final_answer(" calc(58 + 17 -> 75", []) is None
    completions = [" calc(58 + 17) -> 75\n", " calc(58 + 18) -> 76\n", " 75", " calc(58 + 17 -> 75"]
    replies = [[" -> 75\n"], [" -> 76\n"], [], []]
    assert answer_reward(completions, ["75"] * 4, env_replies=replies) == [1.0, 0.0, 1.0, 0.0]


def test_the_calculator_examples_chat_tool_and_reward():
    """examples/grpo_calculator_tool.py --chat: the tool reads the last assistant message, the
    reward the first tool message (else the first assistant message's leading integer)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from grpo_calculator_tool import chat_answer_reward, chat_calculator, chat_rows

    said = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert chat_calculator([], said("calc(58 + 17)"), 0) == "75"  # 58 + 17 = 75
    assert chat_calculator([], said("75"), 0) is None  # no call: the episode ends
    called = said("calc(58 + 17)") + [{"role": "tool", "content": "75"}] + said("80")
    assert chat_answer_reward([called, said("75"), said("76")], ["75"] * 3) == [1.0, 1.0, 0.0]
    row = chat_rows(1)[0]
    # two worked examples of four messages each (user, assistant's call, tool, assistant), then
    # the problem, whose answer is the row's
    assert [m["role"] for m in row["prompt"]] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert row["prompt"][1]["content"] == "calc(12 + 35)" and row["prompt"][2]["content"] == "47"
    a, b = row["prompt"][-1]["content"].removesuffix(" =").split(" + ")
    assert str(int(a) + int(b)) == row["answer"]


def test_the_report_marks_what_the_environment_wrote(tmp_path):
    from tether.analysis.report import marked_response, write_report

    row = {"response": " calc(1 + 2) -> 3\n<b> calc(", "env": [" -> 3\n"]}
    assert marked_response(row) == " calc(1 + 2)<mark title='environment'> -&gt; 3\n</mark>&lt;b&gt; calc("
    assert marked_response({"response": "a<b"}) == "a&lt;b"  # a one-turn row: escaped as it is
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "objective/scores": 1.0}\n')
    (tmp_path / "samples.jsonl").write_text(
        '{"step": 0, "prompt": "p", "response": " calc(1 + 2) -> 3\\n", "env": [" -> 3\\n"], '
        '"policy_tokens": 6, "env_tokens": 3, "score": 1.0, "kl": 0.0, "reward": 1.0}\n'
    )
    (tmp_path / "config.yaml").write_text("train:\n  algo: grpo\n")
    page = write_report(tmp_path).read_text()
    assert "<mark title='environment'> -&gt; 3\n</mark>" in page and "<th>env_tokens</th>" in page


def test_chat_rows_are_read_by_their_messages():
    """A chat row's tool message is marked by its role, not by searching its text in the
    transcript (a tool's "8" would match the "8" of "calc(8 + 0)"); the contents read one per
    line, so the tool's 78 and the answer 78 do not run together as 7878; the console's sample
    table marks the environment's text in ⟦ ⟧ too, and the report shows a conversation's
    messages, not their Python repr."""
    from tether.analysis.report import marked_response as html_marked
    from tether.analysis.report import shown_prompt
    from tether.judges.contract import completion_texts
    from tether.run.metrics import marked_response, sample_table

    messages = [
        {"role": "assistant", "content": "calc(8 + 0)"},
        {"role": "tool", "content": "8"},
        {"role": "assistant", "content": "8"},
    ]
    row = {"response": completion_texts([messages])[0], "messages": messages, "env": ["8"]}
    assert row["response"] == "calc(8 + 0)\n8\n8"
    assert marked_response(row) == "calc(8 + 0)\n⟦8⟧\n8"
    assert html_marked(row) == "calc(8 + 0)\n<mark title='environment'>8</mark>\n8"
    raw = {"response": " calc(1 + 2) -> 3\n3", "env": [" -> 3\n"]}
    assert marked_response(raw) == " calc(1 + 2)⟦ -> 3\n⟧3"
    # the policy wrote " -> 90" itself before it called the tool: env_at marks the tool's, not the
    # first match (the fake env_replies exists to tell apart)
    faked = {"response": "45+45 -> 90 so calc(45 + 45) -> 90", "env": [" -> 90"], "env_at": [28]}
    assert marked_response(faked) == "45+45 -> 90 so calc(45 + 45)⟦ -> 90⟧"
    assert marked_response({**faked, "env_at": None}) == "45+45⟦ -> 90⟧ so calc(45 + 45) -> 90"  # searched
    assert marked_response({"response": "ab", "messages": ["not a message"], "env": [1]}) == "ab"
    table = sample_table([{**raw, "prompt": "1 + 2 =", "score": 1.0, "kl": 0.0, "reward": 1.0}])
    assert "calc(1 + 2)⟦ -> 3 ⟧3" in table  # newlines shown as spaces in the table
    assert shown_prompt([{"role": "user", "content": "1 + 2 ="}]) == "user: 1 + 2 ="


def tool_that_needs_an_answer(prompt, completion, turn, answer):
    """An environment that names a column (``answer``) and takes no other."""
    return f" {answer}" if turn == 0 else None


def test_the_preflight_refuses_what_sampling_would_refuse_later():
    """Before any weights load: an environment whose parameter no column fills, and a template
    that trims an assistant's text (it passed when only '2 + 3 =' was probed, then failed mid-run
    at the first turn ending in a space)."""
    import copy

    from tests.conftest import make_chat_tokenizer
    from tether.data.prompts import PromptData
    from tether.run.config import load_config
    from tether.run.setup import check_env_format

    def check(tok, prompts, columns, *env):
        cfg = load_config(None, ["rollout.max_turns=2", "rollout.stop_strings=e", *env])
        check_env_format(cfg, tok, parts=(PromptData(prompts, columns),))

    tok = make_chat_tokenizer()
    texts, chats = ["a", "b"], [[{"role": "user", "content": "a"}]] * 2
    here = "rollout.env=tests.e2e.test_turns:tool_that_needs_an_answer"
    check(tok, texts, {"answer": [1, 2]}, here)  # the column is there
    with pytest.raises(ValueError, match=r"rollout.env: .*cannot be called.*answer"):
        check(tok, texts, {"other": [1, 2]}, here)
    check(tok, chats, {}, "rollout.env=tests.conftest:chat_tool_env")
    trims = copy.deepcopy(tok)
    trims.chat_template = tok.chat_template.replace("m['content'] }}", "m['content'] | trim }}")
    with pytest.raises(ValueError, match="verbatim before a tool message"):
        check(trims, chats, {}, "rollout.env=tests.conftest:chat_tool_env")


def test_a_resume_that_changes_the_environment_evaluates_the_reference_again(
    tiny_model_dir, prompt_file, tmp_path, caplog
):
    """The reference's held-out evaluation is kept for the final comparison; it was sampled with
    the tool, and a resume without it compared the policy against those numbers. Now the kept
    evaluation records its settings, and a resume that changes one evaluates the frozen reference
    again: its samples are then those of a run that never had the tool."""
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    tool = ["rollout.env=tests.conftest:tool_env", "rollout.max_turns=2", "rollout.stop_strings=e"]
    args = _tiny_args(tiny_model_dir, prompt_file, out) + ["rollout.max_new_tokens=12", "train.steps=1"]
    assert main(args + tool + ["train.checkpoint_every=1"]) == 0
    with_tool = json.loads((out / "eval_reference.json").read_text())
    assert with_tool["settings"]["rollout.env"] == "tests.conftest:tool_env"
    untouched = ["rollout.env=null", "rollout.max_turns=1", "rollout.stop_strings=[]"]
    with caplog.at_level("WARNING"):
        assert main(["train", "--resume", str(out), "train.steps=2", *untouched]) == 0
    assert "evaluating the frozen reference again" in caplog.text and "rollout.env:" in caplog.text
    again = json.loads((out / "eval_reference.json").read_text())
    assert again["settings"]["rollout.env"] is None
    no_tool_args = _tiny_args(tiny_model_dir, prompt_file, fresh) + [
        "rollout.max_new_tokens=12",
        "train.steps=1",
    ]
    assert main(no_tool_args) == 0
    never = json.loads((fresh / "eval_reference.json").read_text())
    assert again["responses"] == never["responses"] != with_tool["responses"]
    assert again["scores"] == never["scores"]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["reference"]["proxy_mean"] == pytest.approx(
        sum(never["scores"]["proxy"]) / len(never["scores"]["proxy"])
    )


def test_an_environments_random_draws_are_seeded_kept_from_evaluation_and_resumed(
    tiny_model_dir, prompt_file, tmp_path
):
    """An environment drawing from Python's and NumPy's global generators gets the numbers an
    uninterrupted run without evaluations gets: periodic evaluations (which call it too) and a
    judge of the training samples that draws from them too draw from forked generators, and a
    checkpoint keeps NumPy's state beside Python's and torch's."""
    tool = ["rollout.env=tests.conftest:random_tool_env", "rollout.max_turns=2", "rollout.stop_strings=e"]
    small = ["rollout.max_new_tokens=32", "train.sample_every=1", "eval.periodic_prompts=4"]

    def run(out, *extra):
        assert main(_tiny_args(tiny_model_dir, prompt_file, out) + tool + small + list(extra)) == 0

    def tool_texts(out) -> list[list[str]]:
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        return [r["env"] for r in rows]

    evaluated, resumed = tmp_path / "evaluated", tmp_path / "resumed"
    # evaluations before and between the steps, and a judge of every step's samples, all drawing
    run(evaluated, "train.steps=2", "eval.every=1", "eval.judge=tests.conftest:random_judge")
    run(resumed, "train.steps=1", "eval.every=0", "eval.judge=none", "train.checkpoint_every=1")
    assert main(["train", "--resume", str(resumed), "train.steps=2"]) == 0
    want = tool_texts(evaluated)
    assert sum(bool(e) for e in want) >= 4, "the test needs rows that called the tool"
    assert tool_texts(resumed) == want


def test_a_reward_taking_env_replies_needs_an_environment():
    """Checked before any model loads: a reward naming env_replies in a run without rollout.env
    would fail at its first call; a dataset column of that name would be shadowed by them."""
    from tests.conftest import make_tokenizer
    from tether.data.prompts import PromptData
    from tether.run.config import load_config
    from tether.run.setup import check_env_format, check_scorer_columns

    def reward(completions, env_replies, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="takes env_replies.*has no rollout.env"):
        check_scorer_columns(reward, {})
    check_scorer_columns(reward, {}, multi_turn=True)
    config = load_config(
        None, ["rollout.env=tests.conftest:tool_env", "rollout.max_turns=2", "rollout.stop_strings=e"]
    )
    rows = PromptData(["the movie"], {"env_replies": ["x"]})
    with pytest.raises(ValueError, match="a column is named 'env_replies'"):
        check_env_format(config, make_tokenizer(), parts=(rows,))


class LockedTool:
    """An environment object as a tool client often is: stateful, holding a lock."""

    def __init__(self):
        import threading

        self.lock, self.calls = threading.Lock(), 0

    def __call__(self, prompt, completion, turn, **columns):
        from tests.conftest import tool_env

        with self.lock:
            self.calls += 1
            return tool_env(prompt, completion, turn)


def test_an_environment_passed_from_python(tiny_model_dir, prompt_file, tmp_path, capsys, caplog):
    """TRL takes its tools as objects; tether.train takes the environment as one too, as
    train(config, env=f) or config.rollout.env = f (a TRL habit that was refused as "must be
    module:function"). config.yaml names it, so a resume from the command line asks for it by
    name and writes nothing; from Python with env= it goes on."""
    from tests.conftest import tool_env
    from tether import load_config, train

    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out)[1:] + [
        "train.steps=1",
        "train.checkpoint_every=1",
        "rollout.max_new_tokens=12",
    ]
    config = load_config(None, args)
    # Python edits, checked whole when the run starts (a loaded max_turns=2 needs an environment);
    # a tool client holding a lock, which no deep copy of the config may copy
    config.rollout.env = tool = LockedTool()
    config.rollout.max_turns, config.rollout.stop_strings = 2, ["e"]
    with pytest.raises(ValueError, match="both give the environment"):
        train(config, env=tool_env)
    assert not out.exists()
    run_dir = train(config)
    recorded = (run_dir / "config.yaml").read_text()
    assert "env: (from Python) tests.e2e.test_turns:LockedTool" in recorded and tool.calls > 0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any(s["env"] == [" [tool: 42]"] for s in samples), "the test needs rows that called the tool"
    before = sorted(p.name for p in run_dir.rglob("*"))
    assert main(["train", "--resume", str(run_dir), "train.steps=2"]) == 1
    err = capsys.readouterr().err
    assert "rollout.env names an environment that was passed from Python" in err and "env=..." in err
    assert sorted(p.name for p in run_dir.rglob("*")) == before  # nothing written, nothing lost
    resumed = load_config(str(run_dir / "config.yaml"), ["train.steps=2", f"train.output_dir={run_dir}"])
    assert train(resumed, env=tool_env, resume=True) == run_dir
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["rollout/env_tokens"] >= 0
    assert "env: (from Python) tests.conftest:tool_env" in (run_dir / "config.yaml").read_text()
    # resumed again with an object of the same recorded name: it may be another environment (two
    # functools.partial, two instances of a class share a name), so the reference is evaluated
    # again rather than compared under the old one
    again = load_config(str(run_dir / "config.yaml"), ["train.steps=3", f"train.output_dir={run_dir}"])
    with caplog.at_level("WARNING"):
        train(again, env=tool_env, resume=True)
    assert (
        "an object passed from Python" in caplog.text
        and "evaluating the frozen reference again" in caplog.text
    )


# ---- faults from a user's environment (issue 50's fault campaign) -----------------------------------
@pytest.mark.parametrize("fault", ["hang", "interrupt"])
def test_an_environment_that_fails_mid_run_keeps_the_trained_steps(
    fault, tiny_model_dir, prompt_file, tmp_path, capsys, monkeypatch
):
    """An environment that failed at step 2 lost steps 0 and 1 (no checkpoint: a scorer's
    SystemExit got one, an environment's failure did not), and one that hung hung the run forever.
    Now a call past rollout.env_timeout, or any exception from it (KeyboardInterrupt included),
    stops the run with the checkpoint of the step before, the step and the field named, and the
    resume gives every metric of the run that never failed."""
    import tests.conftest as helpers
    from tether.run.checkpoint import latest_checkpoint

    out, full = tmp_path / "run", tmp_path / "full"
    tool = [
        "rollout.env=tests.conftest:faulty_env",
        "rollout.max_turns=2",
        "rollout.stop_strings=e",
        "rollout.max_new_tokens=16",
        "rollout.env_timeout=1",
        "train.checkpoint_every=0",
    ]
    monkeypatch.setenv("TETHER_TEST_ENV_METRICS", str(out / "metrics.jsonl"))
    monkeypatch.setenv("TETHER_TEST_ENV_AFTER", "2")  # at step 2's first call
    monkeypatch.setenv("TETHER_TEST_ENV_MARKER", str(tmp_path / "faulted"))
    monkeypatch.setenv("TETHER_TEST_ENV_FAULT", fault)
    try:
        assert main(_tiny_args(tiny_model_dir, prompt_file, out) + tool) == 1
    finally:
        helpers.RELEASE.set()  # the abandoned call ends
        helpers.RELEASE.clear()
    err = capsys.readouterr().err
    said = {
        "hang": "step 2: rollout.env did not answer within rollout.env_timeout=1 s on row",
        "interrupt": "step 2: rollout.env raised KeyboardInterrupt on row",
    }[fault]
    assert said in err and "holds the run after step 1" in err and f"tether train --resume {out}" in err, err
    assert (tmp_path / "faulted").exists() and latest_checkpoint(out).name == "step-000001"
    if fault != "hang":
        return
    assert main(["train", "--resume", str(out)]) == 0
    monkeypatch.delenv("TETHER_TEST_ENV_FAULT")
    assert main(_tiny_args(tiny_model_dir, prompt_file, full) + tool) == 0
    assert metric_rows(out) == metric_rows(full)


def test_turn_settings_load_before_the_environment_is_passed(tiny_model_dir, prompt_file, tmp_path):
    """rollout.max_turns and rollout.stop_strings written in the config of a run whose environment
    comes as train(env=f) were refused when the config loaded, before f could be given; now they
    load, train with f, and without any environment are refused when the run starts, by name,
    before anything is written."""
    from tests.conftest import tiny_run_args, tool_env
    from tether import train
    from tether.run.config import ConfigError, load_config

    turns = {"rollout.max_turns": 2, "rollout.stop_strings": "e", "rollout.max_new_tokens": 8}
    config = load_config(None, tiny_run_args(tiny_model_dir, prompt_file, tmp_path / "run", turns))
    assert config.rollout.max_turns == 2 and config.rollout.env is None
    out = train(config, env=tool_env)
    assert any(r["rollout/env_tokens"] > 0 for r in metric_rows(out))
    alone = load_config(None, tiny_run_args(tiny_model_dir, prompt_file, tmp_path / "alone", turns))
    with pytest.raises(
        ConfigError, match=r"rollout.max_turns=2 .*needs rollout.env or rollout.tools \(train\(env=...\)"
    ):
        train(alone)
    assert not (tmp_path / "alone").exists()
