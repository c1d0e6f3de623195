"""The text anchor (anchor.*) end to end: logged in its units, once per optimizer step, resumable,
and refused with a clear error where it cannot run."""

import json
import math

import pytest

from tests.conftest import metric_rows
from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main


@pytest.fixture()
def anchor_file(tmp_path):
    p = tmp_path / "anchor.txt"
    p.write_text(
        "\n".join(f"some ordinary text number {i} about the weather and the news" for i in range(12)) + "\n"
    )
    return p


def _anchor(anchor_file, *extra):
    return [f"anchor.texts={anchor_file}", "anchor.coef=0.5", "anchor.batch_size=4", *extra]


@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo"])
def test_the_anchor_acts_once_per_optimizer_step_and_logs_nats_per_token(
    algo, tiny_model_dir, prompt_file, anchor_file, tmp_path, monkeypatch
):
    # one epoch of one minibatch: step 0's anchor term is taken at the reference's weights, so its
    # forward KL is exactly 0 (the same trunk and head slices); each optimizer step takes one term
    from tether.trainers.anchor import TextAnchor

    calls = []
    real = TextAnchor.term
    monkeypatch.setattr(TextAnchor, "term", lambda self: calls.append(self.position) or real(self))
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + [
        f"train.algo={algo}",
        "optim.epochs=1",
        "optim.minibatch_size=4",  # the whole batch: one optimizer step per step
    ]
    assert main(args + _anchor(anchor_file, "optim.lr=3e-2")) == 0
    rows = metric_rows(out)
    assert rows[0]["anchor/forward_kl"] == 0.0
    assert all(math.isfinite(r["anchor/nll"]) and r["anchor/nll"] > 0 for r in rows)
    assert rows[-1]["anchor/forward_kl"] > 0  # the policy moved off the reference on the text
    assert calls == list(range(len(rows)))  # one term per optimizer step, the batches in order
    card = (out / "policy" / "README.md").read_text()
    assert "| text anchor | `anchor.coef=0.5`" in card and "forward KL" in card


def test_dpo_takes_the_anchor_once_per_optimizer_step(
    tiny_model_dir, prompt_file, anchor_file, tmp_path, monkeypatch
):
    # DPO's update goes through the same minibatch_update: one anchor term per optimizer step
    from tether.trainers.anchor import TextAnchor

    calls = []
    real = TextAnchor.term
    monkeypatch.setattr(TextAnchor, "term", lambda self: calls.append(self.position) or real(self))
    out = tmp_path / "dpo"
    dpo = ["train.algo=dpo", "dpo.n_pairs=8", "dpo.candidates=2", "dpo.kl_eval_prompts=4", "train.steps=2"]
    dpo += ["reward.scorer=tests.conftest:length_judge"]  # scores that differ: pairs to sample
    assert main(_tiny_args(tiny_model_dir, prompt_file, out) + dpo + _anchor(anchor_file)) == 0
    rows = metric_rows(out)
    assert all(math.isfinite(r["anchor/forward_kl"]) and r["anchor/nll"] > 0 for r in rows)
    # 4 pairs a step in minibatches of 2, 2 epochs (tiny_cli_args): 4 optimizer steps a step
    assert calls == list(range(4 * len(rows)))


def test_the_anchor_holds_the_forward_kl_on_its_text(tiny_model_dir, prompt_file, anchor_file, tmp_path):
    # the same run without and with a heavy anchor: the anchored policy's forward KL on the text
    # is lower (it is what the term descends), measured by the anchor's own statistic in both
    # (anchor.coef tiny: logged, ~no pull)
    def last_fkl(coef, out):
        settings = [
            f"anchor.texts={anchor_file}",
            f"anchor.coef={coef}",
            "anchor.batch_size=12",
            "optim.lr=3e-2",
        ]
        assert main(_tiny_args(tiny_model_dir, prompt_file, out) + settings) == 0
        return metric_rows(out)[-1]["anchor/forward_kl"]

    loose, held = last_fkl(1e-9, tmp_path / "loose"), last_fkl(20.0, tmp_path / "held")
    assert held < 0.5 * loose, (held, loose)


def test_the_anchors_frozen_blocks_kept_across_steps_change_no_number(
    tiny_model_dir, prompt_file, anchor_file, tmp_path, monkeypatch
):
    # model.trainable_layers=1: the anchor's 3 batches come round every 3 optimizer steps and
    # replay block 0's kept output; the rows equal those of a run that runs block 0 every time
    from tether.models.frozen import FrozenBlocks

    replays = []
    real = FrozenBlocks._replaying
    monkeypatch.setattr(FrozenBlocks, "_replaying", lambda *a: replays.append(1) or real(*a))

    def rows(out, *extra):
        args = _tiny_args(tiny_model_dir, prompt_file, out) + _anchor(anchor_file, "model.trainable_layers=1")
        assert main(args + ["optim.lr=3e-2", *extra]) == 0
        return metric_rows(out)

    on = rows(tmp_path / "on")
    n_on = len(replays)
    assert on == rows(tmp_path / "off", "model.replay_frozen_blocks=false")
    assert n_on > 0 and len(replays) == n_on


def test_a_run_with_the_anchor_resumed_equals_the_uninterrupted_one(
    tiny_model_dir, prompt_file, anchor_file, tmp_path
):
    # the anchor's position (its next batch) is checkpointed; the resumed rows equal bit for bit
    def run(out, steps, resumed):
        quiet = ["train.checkpoint_every=1", "eval.n_prompts=0", "eval.every=0", f"train.steps={steps}"]
        assert main(_tiny_args(tiny_model_dir, prompt_file, out) + _anchor(anchor_file) + quiet) == 0
        if resumed:
            assert main(["train", "--resume", str(out), *resumed]) == 0
        # kl/reference_forwards counts the reference's passes: a resumed run scores the anchor's
        # batches with the reference again (its cache of them is not checkpointed), so it reads more
        return [{k: v for k, v in r.items() if k != "kl/reference_forwards"} for r in metric_rows(out)]

    whole = run(tmp_path / "whole", 3, [])
    assert run(tmp_path / "cut", 2, ["train.steps=3"]) == whole
    assert len(whole) == 3 and all("anchor/forward_kl" in r for r in whole)


def test_bad_anchor_input_is_refused_naming_the_field(tiny_model_dir, prompt_file, tmp_path, capsys):
    args = _tiny_args(tiny_model_dir, prompt_file, tmp_path / "run")
    assert main(args + ["anchor.coef=1", f"anchor.texts={tmp_path / 'missing.txt'}"]) != 0
    assert "anchor.texts" in capsys.readouterr().err
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"text": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(args + ["anchor.coef=1", f"anchor.texts={chats}"]) != 0
    assert "not text" in capsys.readouterr().err
    few = tmp_path / "few.txt"
    few.write_text("one text only\n")
    assert main(args + ["anchor.coef=1", f"anchor.texts={few}"]) != 0
    assert "anchor.batch_size" in capsys.readouterr().err
    assert main(args + ["anchor.coef=-1"]) != 0
    assert "anchor.coef" in capsys.readouterr().err
    assert main(args + ["anchor.coef=1", "anchor.kind=js"]) != 0
    assert "anchor.kind" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_anchor_budget_moves_the_weight_on_the_batch_it_weighs(
    tiny_model_dir, prompt_file, anchor_file, tmp_path, monkeypatch
):
    # anchor.budget: each optimizer step's weight is the controller's after it read that very
    # batch's forward KL (no lag). Recorded per term: the KL read and the weight the loss took.
    from tether.core.controllers import BudgetKLController
    from tether.trainers.anchor import TextAnchor

    seen = []
    real = TextAnchor.term

    def term(self):
        out, share = real(self)
        seen.append((out.stats["anchor/forward_kl"].item(), out.stats["anchor/coef"]))
        return out, share

    monkeypatch.setattr(TextAnchor, "term", term)
    out = tmp_path / "run"
    budget = ["anchor.budget=0.002", "anchor.coef=0", "anchor.budget_eta=2", "anchor.budget_kp=3"]
    settings = [f"anchor.texts={anchor_file}", "anchor.batch_size=4", "optim.lr=3e-2", *budget]
    assert main(_tiny_args(tiny_model_dir, prompt_file, out) + settings + ["train.steps=4"]) == 0
    # the same rule by hand, step by step, from the KLs read: budget 1 on forward_kl / 0.002
    twin = BudgetKLController(kl_coef=0.0, budget=1.0, eta=2.0, kp=3.0)
    for fkl, coef in seen:
        assert coef == twin.update(fkl / 0.002, n_steps=1)
    assert seen[0] == (0.0, 0.0)  # step 0: the reference's weights, KL 0, under budget: weight 0
    assert max(c for _, c in seen) > 0  # the KL crossed the budget and the weight rose
    rows = metric_rows(out)
    per_step = len(seen) // len(rows)  # 2 epochs x 2 minibatches (tiny_cli_args)
    for k, r in enumerate(rows):  # the row's anchor/coef: the mean of its optimizer steps' weights
        mine = [c for _, c in seen[k * per_step : (k + 1) * per_step]]
        assert r["anchor/coef"] == pytest.approx(sum(mine) / per_step, rel=1e-12, abs=1e-15)
    card = (out / "policy" / "README.md").read_text()
    assert "`anchor.budget=0.002` nats per token" in card


def test_a_budget_anchor_resumed_carries_its_weight_on(
    tiny_model_dir, prompt_file, anchor_file, tmp_path, caplog
):
    # the controller's weight and dual are checkpointed: a resumed run equals the uninterrupted
    # one; a resume with changed settings says so, with what the anchor goes on from. Each resume
    # goes on from a copy of one 2-step run.
    import shutil

    quiet = ["train.checkpoint_every=1", "eval.n_prompts=0", "eval.every=0"]
    args = _tiny_args(tiny_model_dir, prompt_file, tmp_path / "x") + quiet
    args += _anchor(anchor_file, "optim.lr=3e-2", "anchor.budget=0.002", "anchor.budget_eta=2")

    def trained(out, steps):
        assert main([*args, f"train.output_dir={out}", f"train.steps={steps}"]) == 0

    def rows(out):
        return [{k: v for k, v in r.items() if k != "kl/reference_forwards"} for r in metric_rows(out)]

    trained(tmp_path / "whole", 3)
    trained(tmp_path / "two", 2)
    resumed = shutil.copytree(tmp_path / "two", tmp_path / "cut")
    assert main(["train", "--resume", str(resumed), "train.steps=3"]) == 0
    whole = rows(tmp_path / "whole")
    assert rows(resumed) == whole
    assert len({r["anchor/coef"] for r in whole}) > 1  # the weight moved: the test reads a state
    for changed, said in (
        (["anchor.budget_kp=1"], "anchor.budget's settings changed (anchor.budget_kp 4 -> 1)"),
        (["anchor.budget=0.004"], "anchor.budget 0.002 -> 0.004 nats per token"),
        (
            ["anchor.coef=3"],
            "anchor.coef 0.5 -> 3, which under anchor.budget is only where a new dual starts",
        ),
        (["anchor.budget=null"], "anchor.budget off: the fixed anchor.coef from here"),
        (["anchor.budget=null", "anchor.coef=0"], "resuming with the text anchor off"),
    ):
        out = shutil.copytree(tmp_path / "two", tmp_path / "-".join(changed))
        caplog.clear()
        assert main(["train", "--resume", str(out), "train.steps=3", *changed]) == 0
        assert said in caplog.text, (changed, caplog.text)


def test_bad_anchor_budget_is_refused_naming_the_field(tiny_model_dir, prompt_file, tmp_path, capsys):
    args = _tiny_args(tiny_model_dir, prompt_file, tmp_path / "r")
    for bad, field in (
        (["anchor.budget=0"], "anchor.budget"),
        (["anchor.budget=-0.1"], "anchor.budget"),
        (["anchor.budget=nan"], "anchor.budget"),
        (["anchor.budget=0.1", "anchor.kind=ptx"], "anchor.budget"),
        (["anchor.budget=0.1", "anchor.kind=js"], "anchor.kind"),  # the kind's own error first
        (["anchor.budget=0.1", "anchor.budget_eta=0"], "anchor.budget_eta"),
        (["anchor.budget=0.1", "anchor.budget_kp=-1"], "anchor.budget_kp"),
    ):
        assert main(args + bad) != 0, bad
        assert field in capsys.readouterr().err, bad
    assert not (tmp_path / "r").exists()
