"""Issue #29 on a user's own task: checks before any heavy step, defaults that follow the data,
a config edited in Python resolved when the run starts, declared units, z printed as n/a."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import metric_rows, tiny_run_args
from tether import load_config, train
from tether.cli import main
from tether.data.prompts import prompt_key, split_prompts
from tether.run.config import FIELD_UNITS, Config, ConfigError, config_fields


def _tiny(tiny_model_dir, prompt_file, out, *extra: str) -> list[str]:
    overrides = {
        "train.steps": 2,
        "train.sample_every": 1,
        "eval.n_prompts": 2,
        "eval.every": 0,
        "eval.fluency_model": "none",
        "eval.judge": None,
        "reward.scorer": None,
    }
    return tiny_run_args(tiny_model_dir, prompt_file, out, overrides) + list(extra)


# ---- 5. a config that cannot lie -----------------------------------------------------------------
def test_python_edit_of_algo_gets_that_trainers_defaults():
    """The issue's edit: load the default config, set train.algo in Python. The run must get
    GRPO's defaults (groups of 4, KL in the loss), not PPO's resolved at load time."""
    c = load_config(None, [])
    assert (c.rollout.group_size, c.kl.kl_in_reward, c.kl.kl_in_loss) == (1, True, False)  # PPO's
    c.train.algo = "grpo"
    run = c.for_run()
    assert (run.rollout.group_size, run.kl.kl_in_reward, run.kl.kl_in_loss) == (4, False, True)
    assert run.kl.controller == "budget"
    # config.yaml's form: what the user gave, the defaults the run fills left null
    assert run.to_dict(resolved=False)["rollout"]["group_size"] is None
    c.train.algo = "dpo"
    assert c.for_run().kl.controller == "fixed"


def test_python_edit_of_a_defaulted_field_is_kept():
    """A value set in Python after load_config is the user's: it survives for_run, while the
    fields it did not touch are filled again."""
    c = load_config(None, [])
    c.rollout.group_size = 2
    c.train.algo = "rloo"
    run = c.for_run()
    assert run.rollout.group_size == 2
    assert (run.kl.kl_in_reward, run.kl.kl_in_loss) == (True, False)  # RLOO's placement, filled
    c.kl.kl_in_loss = True
    c.kl.kl_in_reward = False
    assert (c.for_run().kl.kl_in_reward, c.for_run().kl.kl_in_loss) == (False, True)


def test_python_edit_is_validated_when_the_run_starts():
    c = load_config(None, [])
    c.optim.lr = "fast"
    with pytest.raises(ConfigError, match="optim.lr='fast'"):
        c.for_run()
    c = load_config(None, [])
    c.train.algo = "grpo"
    c.rollout.group_size = 1  # GRPO needs groups: refused at start, not trained on silently
    with pytest.raises(ConfigError, match="rollout.group_size"):
        c.for_run()


@pytest.mark.numerics
def test_python_algo_edit_trains_grpo_end_to_end(tiny_model_dir, prompt_file, tmp_path):
    """train() on the edited object: groups of 4 in the samples, the KL in the loss, and a
    config.yaml that says grpo and reloads to the same run."""
    out = tmp_path / "run"
    # a small budget: GRPO's budget controller keeps a price on the KL at every step
    c = load_config(None, _tiny(tiny_model_dir, prompt_file, out, "eval.judge=none", "kl.budget=1e-3"))
    c.train.algo = "grpo"
    train(c, scorer=lambda texts: [len(t) / 10 for t in texts])
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in rows if r["step"] == 0]
    assert len(prompts) == 4 and len(set(prompts)) == 1  # one group of G=4 (batch 4)
    metrics = metric_rows(out, timings=True)
    # step 0 reads KL 0 against a budget of 1e-3: the dual steps from kl.kl_coef by a little and
    # beta stays above 0, so the KL term enters the loss from step 0 on
    assert all(r["objective/kl_coef"] > 0 for r in metrics)
    assert metrics[0]["kl/applied_in_loss"] > 0 and metrics[-1]["kl/applied_in_reward"] == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["algo"] == "grpo"
    again = load_config(out / "config.yaml", [])
    assert (again.rollout.group_size, again.kl.kl_in_loss) == (4, True)


# ---- 7. units ------------------------------------------------------------------------------------
def test_every_field_declares_its_unit():
    names = {f.name for f in config_fields()}
    assert names == set(FIELD_UNITS), names ^ set(FIELD_UNITS)
    units = {f.name: f.unit for f in config_fields()}
    # the labels the keyword guess got wrong
    assert "nats" not in units["optim.lr"]
    assert units["grpo.scale_by_std"] == "" and units["data.prompts"] == ""
    assert units["eval.fluency_model"] == "" and units["kl.budget_eta"] != "nats"
    assert units["kl.kl_coef"] == "reward units per nat"
    assert units["health.quality_distinct_share"] == "fraction of the reference's distinct-2"


def test_tether_config_prints_units(capsys):
    assert main(["config", "kl"]) == 0
    out = capsys.readouterr().out
    assert "kl.kl_coef: float = 0.05 [reward units per nat]" in out
    assert "kl.estimator" in out and "kl.estimator: one of ['k1', 'abs', 'k2', 'k3'] = 'k1'\n" in out


def test_z_is_none_and_printed_na_when_the_se_is_zero():
    from tether.run.announce import z_text as _z
    from tether.run.evaluation import EvalResult, compare

    # two prompts, one sample each; the policy scores 0.5 higher on both: every paired
    # difference is 0.5, so the paired SE is 0 and a z would be 0.5 / 0
    before = EvalResult("reference", ["a", "b"], [1.0, 1.0], {"proxy": [0.0, 1.0]}, 1)
    after = EvalResult("policy", ["c", "d"], [1.0, 1.0], {"proxy": [0.5, 1.5]}, 1)
    out = compare(before, after)
    assert out["gain"] == 0.5 and out["gain_se_paired"] == 0.0
    assert out["gain_z_paired"] is None
    assert _z(out["gain_z_paired"]) == "n/a" and _z(2.345) == "2.3"
    assert all(v is None or abs(v) < float("inf") for k, v in out.items() if k.endswith("_z_paired"))


# ---- 1. checks before any heavy step -------------------------------------------------------------
@pytest.fixture()
def no_heavy_steps(monkeypatch):
    """Every heavy step raises: the judge's fit, the model's load and caching, the demo data's
    download. A bad input must be reported before any of them."""
    import tether.data.prompts as prompts
    import tether.judges.reward_model as rm
    import tether.models.loading as loading
    import tether.run.setup as setup

    def heavy(name):
        def fail(*a, **k):
            raise AssertionError(f"heavy step reached: {name}")

        return fail

    monkeypatch.setattr(rm, "load_reward_model", heavy("judge fit"))
    monkeypatch.setattr(setup, "load_causal_lm", heavy("model load"))
    monkeypatch.setattr(loading, "embedded_model_folder", heavy("model caching"))
    monkeypatch.setattr(setup, "movie_prompts", heavy("demo data download"))
    monkeypatch.setattr(prompts, "icwsm_file", heavy("demo data download"))


BAD_INPUTS = {
    "model": (["model.name=/no/such/model"], FileNotFoundError, "model.name="),
    "tracker": (["train.report_to=no_such_tracker_pkg:Tracker"], ConfigError, "train.report_to"),
    "device": (["train.device=cuda"], ConfigError, "train.device=cuda"),
    "dataset": (["data.prompts=/no/such/prompts.jsonl"], FileNotFoundError, "data.prompts"),
    "scorer": (["reward.scorer=no_such_module_xyz:score"], ValueError, "reward.scorer"),
    "judge": (["eval.judge=no_such_module_xyz:judge"], ValueError, "eval.judge"),
    "fluency": (["eval.fluency_model=/no/such/judge"], FileNotFoundError, "eval.fluency_model"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_before_any_heavy_step(case, no_heavy_steps, tmp_path, monkeypatch):
    """On the embedded default (whose judge is the fitted MiniLM reward model), each bad input
    is refused before the judge fit, the model load and the data download, with nothing written."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides, error, field = BAD_INPUTS[case]
    out = tmp_path / "run"
    c = load_config(None, [f"train.output_dir={out}", "train.progress=false", *overrides])
    t0 = time.perf_counter()
    with pytest.raises(error, match=field.replace(".", r"\.")):
        train(c)
    assert time.perf_counter() - t0 < 10
    assert not out.exists()


def test_missing_column_fails_before_any_heavy_step(no_heavy_steps, tmp_path, prompt_file):
    out = tmp_path / "run"
    c = load_config(
        None,
        [
            f"data.prompts={prompt_file}",
            "reward.scorer=tests.conftest:answer_checker",  # needs an `answer` column
            f"train.output_dir={out}",
        ],
    )
    with pytest.raises(ValueError, match="needs the dataset column"):
        train(c)
    assert not out.exists()


# ---- 2. defaults that follow the task ------------------------------------------------------------
def test_user_data_gets_no_gold_judge_and_says_so(tiny_model_dir, prompt_file, tmp_path, capsys):
    c = load_config(None, [f"data.prompts={prompt_file}"])
    assert c.eval.judge == "none"  # the MiniLM judge of movie reviews is the demo's
    assert load_config(None, []).eval.judge == "minilm-rm"
    out = tmp_path / "run"
    assert main(["train", *_tiny(tiny_model_dir, prompt_file, out)]) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    assert "reward.scorer is unset, so the run trains on VADER sentiment" in text
    assert "no gold judge (eval.judge=none, the default on data other than the demo's" in text
    assert "rollout.max_prompt_tokens=" in text and "the data's longest prompt" in text
    ev = json.loads((out / "eval.json").read_text())
    assert "gold_gain" not in ev and "gain" in ev


def test_gold_by_needs_a_judge_with_user_data(prompt_file):
    with pytest.raises(ConfigError, match="the default with your own data"):
        load_config(None, [f"data.prompts={prompt_file}", "eval.best_by=gold"])


def test_max_prompt_tokens_follows_the_data(tiny_model_dir, tiny_tokenizer, tmp_path):
    """Unset, rollout.max_prompt_tokens is the longest prompt's length; a prompt and a response
    that cannot fit the model's positions (128 in the tiny Llama) are refused before work."""
    from tether.run.setup import build_run

    prompts = tmp_path / "p.txt"
    lines = [f"short prompt {i}" for i in range(30)] + [("a much longer prompt " * 6).strip()]
    prompts.write_text("\n".join(lines) + "\n")
    longest = max(len(tiny_tokenizer(p)["input_ids"]) for p in lines)
    c = load_config(None, _tiny(tiny_model_dir, prompts, tmp_path / "a"))
    run = build_run(c.for_run())
    assert run.config.rollout.max_prompt_tokens == longest
    assert run.config.to_dict(resolved=False)["rollout"]["max_prompt_tokens"] is None
    too_long = 128 - longest + 1  # longest + too_long = 129 > 128 positions
    c = load_config(
        None, _tiny(tiny_model_dir, prompts, tmp_path / "b", f"rollout.max_new_tokens={too_long}")
    )
    with pytest.raises(ValueError, match=r"p\.txt:31: .* run past the model's 128 positions"):
        build_run(c.for_run())
    assert not (tmp_path / "b").exists()


def _pairs(path: Path, n: int = 60) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"the movie number {i} was", "chosen": "great fun", "rejected": "bad bad"})
            + "\n"
            for i in range(n)
        )
    )
    return path


def test_dpo_pairs_file_is_the_prompt_set(tiny_model_dir, tmp_path, monkeypatch):
    """DPO given only dpo.pairs: its held-out prompts are the pairs' own (no demo data fetched),
    and no pair whose prompt is held out is trained on."""
    import tether.run.setup as setup
    from tether.trainers.dpo import DPOTrainer

    monkeypatch.setattr(setup, "movie_prompts", lambda *a, **k: pytest.fail("demo prompts fetched"))
    pairs = _pairs(tmp_path / "pairs.jsonl")
    c = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "train.algo=dpo",
            f"dpo.pairs={pairs}",
            "data.heldout_fraction=0.2",
            "reward.scorer=tests.conftest:length_judge",
            "train.progress=false",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    assert c.eval.judge == "none"
    run = setup.build_run(c.for_run())
    held = {prompt_key(p) for p in run.heldout_prompts.prompts}
    assert held and all(p.startswith("the movie number") for p in run.heldout_prompts.prompts)
    trainer = DPOTrainer(run)
    trained = {prompt_key(p) for p in trainer.pairs.prompts}
    assert trained and not trained & held
    assert len(trained) + len(held) == 60


@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo", "dpo"])
def test_no_trainer_trains_on_a_heldout_prompt(algo, tiny_model_dir, tmp_path):
    """Whatever the trainer and the source (a prompt file that is also DPO's pairs file), the
    prompts trained on and the held-out prompts are disjoint."""
    from tether.run.setup import build_run
    from tether.training import TRAINERS

    pairs = _pairs(tmp_path / "pairs.jsonl")
    extra = ["rollout.group_size=2"] if algo in ("grpo", "rloo") else []
    if algo == "dpo":
        extra += [f"dpo.pairs={pairs}"]
    c = load_config(
        None,
        _tiny(tiny_model_dir, pairs, tmp_path / "run", f"train.algo={algo}", "eval.judge=none", *extra)
        + ["reward.scorer=tests.conftest:length_judge"],
    )
    run = build_run(c.for_run())
    _, expected_held = split_prompts([json.loads(x)["prompt"] for x in pairs.read_text().splitlines()], 0.2)
    held = {prompt_key(p) for p in run.heldout_prompts.prompts}
    assert held == {prompt_key(p) for p in expected_held} and held
    trainer = TRAINERS[algo](run)
    if algo == "dpo":
        trained = {prompt_key(p) for p in trainer.pairs.prompts}
    else:
        trained = {prompt_key(p) for _ in range(30) for p in trainer.sampler.next_batch(4)}
    assert trained and not trained & held


def test_config_is_still_a_dataclass_roundtrip():
    """for_run() of a loaded config is an equal config (nothing changed, nothing lost)."""
    c = load_config(None, ["kl.kl_coef=0.1", "train.algo=rloo"])
    again = c.for_run()
    assert isinstance(again, Config) and again.to_dict() == c.to_dict()


# ---- found by trying to break it -----------------------------------------------------------------
def _answer_judge(prompts, completions, answer, **kwargs):
    return [0.0 for _ in completions]


def test_python_reward_is_named_in_config_yaml_and_a_cli_resume_asks_for_it(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """A run trained with a reward passed from Python must not go on with VADER when resumed from
    the CLI: config.yaml names the object, and the resume is refused until a reward is named."""
    out = tmp_path / "run"
    c = load_config(
        None, _tiny(tiny_model_dir, prompt_file, out, "eval.judge=none", "train.checkpoint_every=1")
    )

    def five(completions, **kwargs):
        return [5.0] * len(completions)

    named = load_config(None, _tiny(tiny_model_dir, prompt_file, out, "reward.scorer=vader"))
    with pytest.raises(
        ValueError, match=r"train\(scorer=...\) and reward.scorer='vader' both give the reward"
    ):
        train(named, scorer=five)  # config.yaml would name VADER while the run trained on five
    assert not out.exists()
    train(c, scorer=five)
    assert yaml.safe_load((out / "config.yaml").read_text())["reward"]["scorer"] == ["(from Python) five"]
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "train.steps=3"]) == 1
    err = capsys.readouterr().err
    assert "reward was passed from Python (five)" in err and "scorer=..., resume=True" in err
    # from Python, with the object again, it goes on (the recorded name is not a spec to build)
    train(load_config(out / "config.yaml", ["train.steps=3"]), scorer=five, resume=True)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def test_a_callable_put_in_the_config_is_the_reward(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "run"
    c = load_config(None, _tiny(tiny_model_dir, prompt_file, out, "eval.judge=none"))

    def two(completions, **kwargs):
        return [2.0] * len(completions)

    c.reward.scorer = two  # what a TRL user writes for reward_funcs
    train(c)
    rows = metric_rows(out, timings=True)
    assert rows[0]["objective/scores"] == 2.0


def test_replaced_sections_still_follow_the_algo():
    import dataclasses

    c = load_config(None, [])
    c.kl = dataclasses.replace(c.kl, kl_coef=0.1)  # a new section object: no fill marks
    c.rollout = dataclasses.replace(c.rollout, temperature=0.9)
    c.train.algo = "grpo"
    run = c.for_run()
    assert (run.kl.kl_in_reward, run.kl.kl_in_loss, run.rollout.group_size) == (False, True, 4)
    assert run.kl.kl_coef == 0.1 and run.rollout.temperature == 0.9
    c = load_config(None, [])
    whole = dataclasses.replace(c, train=dataclasses.replace(c.train, algo="rloo"))
    assert (whole.rollout.group_size, whole.kl.kl_in_reward) == (4, True)
    assert (c.train.algo, c.rollout.group_size) == ("ppo", 1)  # the first config is untouched


@pytest.mark.parametrize(
    "weights,words",
    [("2", "expected a list"), ("1 0.2", "give a list of numbers"), ("[1,x]", "reward.weights='x'")],
)
def test_reward_weights_of_the_wrong_type_name_the_field(weights, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        load_config(None, [f"reward.weights={weights}"])
    c = load_config(None, [])
    c.reward.weights = [1, "x"]
    with pytest.raises(ConfigError, match="reward.weights='x'"):
        c.for_run()


def test_resume_with_other_data_is_refused_before_anything_changes(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    out = tmp_path / "run"
    assert (
        main(
            ["train", *_tiny(tiny_model_dir, prompt_file, out, "eval.judge=none", "train.checkpoint_every=1")]
        )
        == 0
    )
    before = (out / "config.yaml").read_text(), (out / "metrics.jsonl").read_text()
    small = tmp_path / "small.txt"
    small.write_text("".join(f"tiny {i}\n" for i in range(6)))
    capsys.readouterr()
    for override in (f"data.prompts={small}", "train.algo=rloo"):
        assert main(["train", "--resume", str(out), "train.steps=3", override]) == 2
        err = capsys.readouterr().err
        assert "--resume:" in err and override.split("=")[0] in err and "keeps its trainer, its data" in err
    assert ((out / "config.yaml").read_text(), (out / "metrics.jsonl").read_text()) == before


def test_a_judge_needing_a_missing_column_is_refused_before_the_model_loads(
    no_heavy_steps, prompt_file, tmp_path
):
    out = tmp_path / "run"
    c = load_config(
        None,
        [
            f"data.prompts={prompt_file}",
            "eval.judge=tests.e2e.test_task_defaults:_answer_judge",
            f"train.output_dir={out}",
        ],
    )
    with pytest.raises(
        ValueError, match=r"eval\.judge '_answer_judge' needs the dataset column\(s\) \['answer'\]"
    ):
        train(c)
    assert not out.exists()


def test_dpo_pairs_all_held_out_names_the_pairs_file(tiny_model_dir, tmp_path):
    from tether.run.setup import build_run

    pairs = _pairs(tmp_path / "pairs.jsonl", n=3)
    c = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "train.algo=dpo",
            f"dpo.pairs={pairs}",
            "data.heldout_fraction=0.999",
            "reward.scorer=tests.conftest:length_judge",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(ValueError, match=r"dpo\.pairs=.*pairs\.jsonl: no training prompts left"):
        build_run(c.for_run())


def test_an_args_kwargs_reward_that_fails_is_told_how_it_was_called():
    from tether.judges.contract import checked_scores

    def trl_style(*args, **kwargs):
        return [len(c) for c in kwargs["completions"]]

    with pytest.raises(ValueError, match=r"called as a plain scorer, f\(texts\)"):
        checked_scores(trl_style, ["a", "bb"], 0, prompts=["p", "q"])


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    from tether.models.loading import is_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my").mkdir()
    assert not is_hub_id("my/maths.jsonl")  # "my" is a folder here: a local path, mistyped
    assert not is_hub_id("nobody/prompts.jsonl")  # a file's suffix
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and is_hub_id("trl-lib/tldr")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        train(load_config(None, ["data.prompts=my/maths.jsonl", f"train.output_dir={tmp_path / 'r'}"]))


def test_first_lines_name_the_fluency_judge_and_a_tiny_heldout_set():
    from tether.run.announce import task_defaults_lines

    auto = load_config(None, ["data.prompts=p.txt"])  # auto says its choice when it decides
    assert "fluency_model" not in "\n".join(task_defaults_lines(auto, has_judge=False, n_heldout=8))
    c = load_config(None, ["data.prompts=p.txt", "eval.fluency_model=gemma3-270m"])
    lines = "\n".join(task_defaults_lines(c, has_judge=False, n_heldout=1))
    assert "eval.fluency_model=gemma3-270m" in lines
    assert "only 1 held-out prompt(s)" in lines and "undefined (nan)" in lines
    assert "only" not in "\n".join(task_defaults_lines(c, has_judge=False, n_heldout=8))


def test_a_task_run_at_the_demos_defaults_is_told_the_measured_settings():
    from tether.run.announce import task_defaults_lines

    def note(*overrides: str) -> list[str]:
        c = load_config(None, ["data.prompts=arithmetic", "train.algo=grpo", *overrides]).for_run()
        return [x for x in task_defaults_lines(c, has_judge=False, n_heldout=394) if "measured at" in x]

    assert note() == [
        "tether: note: data.prompts=arithmetic was measured at rollout.max_new_tokens=5 optim.lr=5e-5 "
        "kl.budget=0.5 anchor.coef=3; this run keeps the demo's defaults there (README, \"Verifiable "
        'rewards": what each one changes)'
    ]
    assert (
        "optim.lr=5e-5" in note("rollout.max_new_tokens=5")[0]
        and "max_new_tokens" not in note("rollout.max_new_tokens=5")[0]
    )
    # a setting of the user's own, or the measured ones: no note
    own = ("rollout.max_new_tokens=8", "optim.lr=1e-4", "kl.budget=2", "anchor.coef=0.5")
    assert note(*own) == []
    assert note("rollout.max_new_tokens=5", "optim.lr=5e-5", "kl.budget=0.5", "anchor.coef=3") == []
    # what the note names is what the benchmark runs: COMMON, and the recommended row of RUNS
    from tests.conftest import REPO

    bench = (REPO / "benchmarks" / "rlvr.py").read_text()
    assert '"rollout.max_new_tokens=5",' in bench and '"optim.lr=5e-5",' in bench
    assert '"budget 0.5 + anchor 3": ["kl.budget=0.5", "anchor.coef=3"]' in bench
