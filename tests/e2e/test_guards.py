"""Guards found by trying to break tether: each test reproduces a way it once went wrong."""

from __future__ import annotations

import json

import torch

from tests.conftest import CHAT, metric_rows
from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main


def test_partial_run_folder_is_refused(tiny_model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "eval_reference.json").write_text("{}")  # left by a run that failed before step 0
    assert main(_tiny_args(tiny_model_dir, prompt_file, out)) == 1
    assert "not empty" in capsys.readouterr().err
    assert (out / "eval_reference.json").read_text() == "{}"


def test_dpo_with_only_ties_stops_with_a_reason(tiny_model_dir, prompt_file, tmp_path, capsys):
    args = _tiny_args(tiny_model_dir, prompt_file, tmp_path / "d") + [
        "train.algo=dpo",
        "dpo.n_pairs=4",
        "dpo.candidates=2",
        "reward.scorer=tests.conftest:constant_scorer",
    ]
    assert main(args) == 1
    assert "dpo.candidates" in capsys.readouterr().err


def test_reference_forwards_are_counted(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "c"
    assert main(_tiny_args(tiny_model_dir, prompt_file, out)) == 0
    rows = metric_rows(out, timings=True)
    counts = [r["kl/reference_forwards"] for r in rows]
    assert counts[0] > 0 and counts == sorted(counts) and counts[-1] > counts[0]


def test_scorer_that_raises_names_the_step(tiny_model_dir, prompt_file, tmp_path, capsys):
    args = _tiny_args(tiny_model_dir, prompt_file, tmp_path / "s") + [
        "reward.scorer=tests.conftest:broken_scorer",
        "eval.n_prompts=0",
        "eval.every=0",  # else the reference's periodic evaluation meets the scorer first
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "step 0" in err and "scorer failed" in err and "Traceback" not in err


def test_a_reference_that_moves_stops_the_run_without_a_checkpoint(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch, capsys
):
    # with train.checkpoint_every=0 no checkpoint checks the fingerprint: the check after the
    # last step must still catch a reference changed during training, before eval and policy
    from tether import training as train_module

    class Nudging(train_module.TRAINERS["ppo"]):
        def step(self, step):
            row = super().step(step)
            with torch.no_grad():
                next(self.run.reference.parameters()).add_(1e-3)  # what a shared-storage bug would do
            return row

    monkeypatch.setitem(train_module.TRAINERS, "ppo", Nudging)
    out = tmp_path / "run"
    assert main(_tiny_args(tiny_model_dir, prompt_file, out) + ["train.checkpoint_every=0"]) == 1
    err = capsys.readouterr().err
    assert "after the last step (2)" in err and "reference model's weights changed" in err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # the logged steps stay
    assert not (out / "eval.json").exists() and not (out / "policy").exists()


def test_chat_template_run_shows_prompts_as_written(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    import shutil

    from tether.models import sampling as rollout

    model = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    seen = []
    real = rollout.prompt_texts
    monkeypatch.setattr(
        rollout, "prompt_texts", lambda tok, prompts: seen.extend(real(tok, prompts)) or real(tok, prompts)
    )
    out = tmp_path / "run"
    args = _tiny_args(model, prompt_file, out) + [
        "data.chat_template=true",
        "rollout.max_prompt_tokens=40",
        "train.save_model=false",
    ]
    assert main(args) == 0
    assert seen and all(t.startswith("[user] ") and t.endswith("\n[assistant] ") for t in seen)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all("[user]" not in s["prompt"] for s in samples)  # the prompt as written
    # without a template in the model's tokenizer: a clear error, and no run folder left behind
    assert main(_tiny_args(tiny_model_dir, prompt_file, tmp_path / "r2") + ["data.chat_template=true"]) == 1
    assert not (tmp_path / "r2").exists()
