"""Each variant has one home (issue 51): a toy controller, estimator and trainer, each written and
registered in the test alone, run through the CLI. They fail if adding one needs an edit in
trainers/, run/monitor.py, run/card.py, training.py or the config's rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from tests.conftest import metric_rows, tiny_run_args
from tether.cli import main
from tether.core import controllers


@dataclass
class CountingController(controllers.Controller):
    """A toy: beta = kl_coef_0 * (1 + updates) / (1 + budget * updates), its update count its
    state (so a resume that dropped the state would give another beta), holding kl.budget."""

    name: ClassVar[str] = "counting"
    fields: ClassVar[dict[str, str]] = {"budget": "budget"}
    state: ClassVar[tuple[str, ...]] = ("kl_coef", "updates")
    held: ClassVar[str | None] = "budget"
    raises_from_zero: ClassVar[bool] = False

    kl_coef: float
    budget: float = 1.0
    start: float | None = None
    updates: int = 0

    def __post_init__(self) -> None:
        self.start = self.kl_coef if self.start is None else self.start

    def update(self, kl: float, n_steps: int) -> float:
        self.updates += 1
        self.kl_coef = self.start * (1 + self.updates) / (1 + self.budget * self.updates)
        return self.kl_coef


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setitem(controllers.CONTROLLERS, "counting", CountingController)


def _args(tiny_model_dir, prompt_file, out, **overrides):
    settings = {
        "kl.controller": "counting",
        "kl.kl_coef": 0.2,
        "kl.budget": 0.5,
        "train.steps": 4,
        "train.checkpoint_every": 1,
        "eval.n_prompts": 0,  # no evaluation at the cut run's end: its rows stay the full run's
        "eval.every": 0,
        "eval.fluency_model": "none",
        "train.save_model": "true",
        **overrides,
    }
    return tiny_run_args(tiny_model_dir, prompt_file, out, settings, command=True)


def test_a_toy_controller_needs_its_own_file_only_and_resumes_bit_for_bit(
    counting, tiny_model_dir, prompt_file, tmp_path
):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_args(tiny_model_dir, prompt_file, full)) == 0
    assert main(_args(tiny_model_dir, prompt_file, cut, **{"train.steps": 2})) == 0
    assert main(["train", "--resume", str(cut), "train.steps=4"]) == 0
    rows = metric_rows(full)
    # the controller reads step t's KL before step t's update, so beta of step t is the one after
    # t + 1 updates: 0.2 * (2 + t) / (1 + 0.5 (t + 1)); step 0's: 0.2 * 2 / 1.5 = 0.26667
    betas = [0.2 * (2 + t) / (1 + 0.5 * (t + 1)) for t in range(4)]
    assert [r["objective/kl_coef"] for r in rows] == pytest.approx(betas, rel=1e-12)
    assert metric_rows(cut) == rows  # the update count survived the resume
    card = (full / "policy" / "README.md").read_text()
    assert "`kl.controller=counting`, budget 0.5 nats per sequence" in card  # its own describe()


@pytest.fixture
def toy_estimators(monkeypatch):
    """k1 and k2 again under other names, each one record registered here (its value, its mean,
    its standing in the reward and in the loss): nothing else of tether is edited."""
    from tether.core import kl

    k1, k2 = kl.ESTIMATORS["k1"], kl.ESTIMATORS["k2"]
    monkeypatch.setitem(
        kl.ESTIMATORS, "toy_k1", kl.Estimator("toy_k1", value=k1.value, mean_is_kl=True, reward=k1.reward)
    )
    monkeypatch.setitem(
        kl.ESTIMATORS, "toy_k2", kl.Estimator("toy_k2", loss=k2.loss, loss_terms=k2.loss_terms)
    )


def _rows(tiny_model_dir, prompt_file, out, **overrides):
    settings = {
        "kl.controller": "fixed",
        "kl.kl_coef": 0.1,
        "train.steps": 2,
        "eval.n_prompts": 0,
        **overrides,
    }
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, settings, command=True)) == 0
    return metric_rows(out)


def test_a_toy_estimator_is_one_record_in_both_placements(
    toy_estimators, tiny_model_dir, prompt_file, tmp_path
):
    # in the reward (PPO): the toy k1 trains exactly as k1 (the same numbers); its mean is the KL,
    # so the budget controller may read it
    toy = _rows(tiny_model_dir, prompt_file, tmp_path / "toy", **{"kl.estimator": "toy_k1"})
    ref = _rows(tiny_model_dir, prompt_file, tmp_path / "k1", **{"kl.estimator": "k1"})
    for a, b in zip(toy, ref):
        assert a["objective/kl"] == b["objective/kl"] and a["objective/scores"] == b["objective/scores"]
    # in the loss (GRPO): the toy k2 as k2; off-policy it is k2's, so the run is warned as k2's is
    toy = _rows(
        tiny_model_dir,
        prompt_file,
        tmp_path / "toy2",
        **{"train.algo": "grpo", "kl.loss_estimator": "toy_k2"},
    )
    ref = _rows(
        tiny_model_dir, prompt_file, tmp_path / "k2", **{"train.algo": "grpo", "kl.loss_estimator": "k2"}
    )
    assert [r["policy/kl_loss"] for r in toy] == [r["policy/kl_loss"] for r in ref]
    # and the placement check reads its record: not a reward estimator, so refused there by name
    from tether.run.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="kl.estimator='toy_k2'|kl.estimator: .*toy_k2"):
        load_config(None, ["kl.estimator=toy_k2"])


def test_a_toy_trainer_is_its_class_its_advantage_and_a_row_of_defaults(
    monkeypatch, tiny_model_dir, prompt_file, tmp_path
):
    """An on-policy trainer in three places, all in this test: its class (the trainer's file), its
    step-6 advantage registered in ADVANTAGES, a row of TRAINER_DEFAULTS, and its name in
    training.TRAINERS. Its advantage here: the score minus the group's best other score."""
    import torch

    from tether import training
    from tether.run import config
    from tether.trainers import steps
    from tether.trainers.group import GroupTrainer

    def best_other(leashed, mask, values, settings, *, scored):
        seq = (leashed.rewards * mask).sum(-1).view(-1, settings.group_size)  # (groups, G)
        others = torch.stack(
            [seq[:, [j for j in range(seq.shape[1]) if j != i]].amax(-1) for i in range(seq.shape[1])], -1
        )
        adv = steps.broadcast_sequence_advantages((seq - others).reshape(-1), mask)
        return steps.Advantages(advantages=adv, returns=None, return_scale=None)

    class ToyTrainer(GroupTrainer):
        name = "toy"

    monkeypatch.setitem(steps.ADVANTAGES, "toy", best_other)
    monkeypatch.setitem(config.TRAINER_DEFAULTS, "toy", config.TrainerDefaults(2, 2, "reward", "fixed"))
    monkeypatch.setitem(training.TRAINERS, "toy", ToyTrainer)
    rows = _rows(tiny_model_dir, prompt_file, tmp_path / "toy", **{"train.algo": "toy"})
    assert len(rows) == 2 and rows[0]["objective/kl"] == 0.0  # step 0: the policy is the reference
    saved = (tmp_path / "toy" / "config.yaml").read_text()
    assert "algo: toy" in saved and "group_size: null" in saved  # its default, left to the table


def test_a_half_registered_variant_is_refused_before_anything_loads(monkeypatch, tmp_path):
    """A trainer row without its class or its advantage, a controller whose fields name no config
    field, a name registered twice, a controller state no tether wrote: each refused by name."""
    from tether import training
    from tether.core import controllers, kl
    from tether.run import config
    from tether.run.config import ConfigError, load_config

    monkeypatch.setitem(config.TRAINER_DEFAULTS, "half", config.TrainerDefaults(2, 2, "reward", "fixed"))
    with pytest.raises(ConfigError, match="no trainer class is registered"):
        training.train(load_config(None, ["train.algo=half", f"train.output_dir={tmp_path / 'r'}"]))
    monkeypatch.setitem(training.TRAINERS, "half", training.TRAINERS["rloo"])
    with pytest.raises(ConfigError, match="no advantage is registered"):
        training.train(load_config(None, ["train.algo=half", f"train.output_dir={tmp_path / 'r'}"]))
    assert not (tmp_path / "r").exists()

    class Typo(CountingController):
        name = "typo"
        fields = {"budget": "budegt"}

    with pytest.raises(ValueError, match=r"reads \['kl.budegt'\]"):
        Typo.from_fields(0.1, vars(load_config(None, []).kl))
    with pytest.raises(ValueError, match="registered already"):
        controllers.register(type("Shadow", (controllers.BudgetKLController,), {}))
    with pytest.raises(ValueError, match="registered already"):
        kl.register_estimator(kl.Estimator("k1", value=kl.kl_k2))
    budget = controllers.make_controller("budget", 0.1, budget=1.0)
    for saved in ({}, {"kind": "budget", "kl_coef": "0.2"}, {"kind": "budget", "kl_coef": float("nan")}):
        with pytest.raises(ValueError, match="not one tether wrote"):
            budget.load_state_dict(saved)
    # a state of this kind without "dual" is not an old one: kp and kd stay
    budget = controllers.make_controller("budget", 0.1, budget=1.0, kp=3.0)
    budget.load_state_dict(
        {"kind": "budget", "kl_coef": 0.2, "budget": 1.0, "eta": 0.1, "kp": 3.0, "kd": 0.0}
    )
    assert budget.kp == 3.0
