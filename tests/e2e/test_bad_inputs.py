"""Every bad input the CLI refuses, as a table: the input, the exit code, and the words the error
must contain (the field or line, the value, the fix). Config errors exit 2 before anything loads;
errors found while running exit 1. Run with ``-s`` to print the table as markdown.

The scorer cases fail at step 2, after the checkpoint of step 1: that checkpoint must still load,
and the rows already written to metrics.jsonl must stay.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import metric_rows
from tether.cli import main
from tether.run.checkpoint import latest_checkpoint

_CALLS = {"n": 0}


def _scorer_failing_late(bad):
    """A scorer that is fine for the first 3 calls (steps 0 and 1 of a 4-prompt run, and the
    held-out evaluation is off), then returns ``bad(texts)``."""

    def score(texts):
        _CALLS["n"] += 1
        return [float(len(t)) for t in texts] if _CALLS["n"] <= 2 else bad(texts)

    return score


wrong_count = _scorer_failing_late(lambda t: [1.0] * (len(t) - 1))
nan_score = _scorer_failing_late(lambda t: [float("nan")] + [1.0] * (len(t) - 1))
inf_score = _scorer_failing_late(lambda t: [float("inf")] * len(t))
huge_score = _scorer_failing_late(lambda t: [1e39] * len(t))  # finite in Python, inf in float32
text_score = _scorer_failing_late(lambda t: ["good"] * len(t))


def _base(tiny_model_dir, prompts, out):
    return [
        "train",
        f"model.name={tiny_model_dir}",
        f"data.prompts={prompts}",
        "data.heldout_fraction=0.2",
        "rollout.batch_size=4",
        "rollout.max_new_tokens=6",
        "optim.minibatch_size=2",
        "train.steps=4",
        "train.checkpoint_every=1",
        "eval.n_prompts=0",
        "eval.every=0",
        "eval.judge=tests.conftest:length_judge",
        "train.progress=false",
        "train.save_model=false",
        f"train.output_dir={out}",
    ]


# (case, overrides, exit code, substrings of the error)
CONFIG_CASES = [
    ("negative kl_coef", ["kl.kl_coef=-0.1"], 2, ["kl.kl_coef=-0.1", ">= 0"]),
    ("KL target <= 0", ["kl.target=0"], 2, ["kl.target=0.0", "> 0"]),
    ("KL budget <= 0", ["kl.controller=budget", "kl.budget=-1"], 2, ["kl.budget"]),
    ("temperature <= 0", ["rollout.temperature=0"], 2, ["rollout.temperature"]),
    ("unknown estimator", ["kl.estimator=k9"], 2, ["kl.estimator='k9'", "k1"]),
    ("unknown trainer", ["train.algo=a2c"], 2, ["train.algo='a2c'", "ppo"]),
    ("unknown controller", ["kl.controller=pid"], 2, ["kl.controller='pid'", "budget"]),
    (
        "batch not divisible by group size",
        ["train.algo=grpo", "rollout.batch_size=6", "rollout.group_size=4"],
        2,
        ["rollout.batch_size=6", "rollout.group_size=4"],
    ),
    ("minibatch not dividing the batch", ["optim.minibatch_size=3"], 2, ["optim.minibatch_size=3", "divide"]),
    (
        "micro-batch not dividing the minibatch",
        ["optim.micro_batch_size=3"],
        2,
        ["optim.micro_batch_size=3", "divide optim.minibatch_size=2"],
    ),
    ("NaN learning rate", ["optim.lr=nan"], 2, ["optim.lr", "finite"]),
    ("misspelled key", ["kl.kl_coeff=0.1"], 2, ["kl.kl_coeff", "kl_coef"]),
    (
        "KL in reward and loss",
        ["kl.kl_in_reward=true", "kl.kl_in_loss=true"],
        2,
        ["counted twice", "kl.allow_double_kl"],
    ),
    ("k3 in the reward (biased)", ["kl.estimator=k3"], 2, ["kl.estimator='k3'", "kl.allow_biased_estimator"]),
    (
        "k1 in the loss (biased)",
        ["train.algo=grpo", "rollout.group_size=2", "kl.loss_estimator=k1"],
        2,
        ["kl.loss_estimator='k1'", "allow_biased_estimator"],
    ),
    ("held-out fraction >= 1", ["data.heldout_fraction=1.5"], 2, ["data.heldout_fraction=1.5"]),
    ("zero response length", ["rollout.max_new_tokens=0"], 2, ["rollout.max_new_tokens=0", ">= 1"]),
    ("negative LoRA rank", ["model.lora_r=-1"], 2, ["model.lora_r=-1"]),
    (
        "controller on the exact KL without it",
        ["kl.controller_signal=exact", "kl.exact=false"],
        2,
        ["kl.controller_signal='exact'", "kl.exact=true"],
    ),
    ("override without a section", ["kl_coef=0.1"], 2, ["kl_coef"]),
    (
        "controller holding a biased KL estimate",
        ["train.algo=grpo", "rollout.group_size=2", "kl.estimator=k2", "kl.controller_signal=estimator"],
        2,
        ["kl.estimator='k2'", "biased", "kl.controller_signal=exact"],
    ),
    (
        "DPO with a KL controller",
        ["train.algo=dpo", "kl.controller=budget"],
        2,
        ["kl.controller='budget'", "dpo.beta"],
    ),
]


@pytest.mark.parametrize("case,overrides,code,words", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_config_errors(case, overrides, code, words, tiny_model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_base(tiny_model_dir, prompt_file, out) + overrides) == code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"\n| {case} | `{' '.join(overrides)}` | {code} | {err} |")
    for w in words:
        assert w in err, (w, err)
    assert not out.exists()  # refused before anything was written


def _prompt_files(tmp_path: Path) -> dict[str, tuple[Path, list[str]]]:
    files = {}
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    files["empty prompt file"] = (empty, ["empty.txt", "no prompts"])
    bad_json = tmp_path / "p.jsonl"
    bad_json.write_text('{"prompt": "fine"}\n{not json}\n')
    files["malformed JSONL"] = (bad_json, ["p.jsonl:2", "not valid JSON"])
    no_key = tmp_path / "q.jsonl"
    no_key.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    files["JSONL line without a prompt"] = (no_key, ["q.jsonl:2", '"prompt"'])
    long = tmp_path / "long.txt"
    long.write_text("\n".join([f"short prompt {i}" for i in range(20)] + ["word " * 400]) + "\n")
    files["prompt longer than the context"] = (long, ["long.txt:21:", "rollout.max_prompt_tokens"])
    files["missing prompt file"] = (tmp_path / "nope.txt", ["data.prompts", "nope.txt"])
    return files


@pytest.mark.parametrize(
    "case",
    [
        "empty prompt file",
        "malformed JSONL",
        "JSONL line without a prompt",
        "prompt longer than the context",
        "missing prompt file",
    ],
)
def test_prompt_file_errors(case, tiny_model_dir, tmp_path, capsys):
    path, words = _prompt_files(tmp_path)[case]
    out = tmp_path / "run"
    assert main(_base(tiny_model_dir, path, out) + ["data.heldout_fraction=0.05"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"\n| {case} | `data.prompts={path.name}` | 1 | {err} |")
    for w in words:
        assert w in err, (w, err)


SCORER_CASES = [
    ("scorer returns the wrong count", "wrong_count", ["step 2", "3 scores for 4 texts"]),
    ("scorer returns NaN", "nan_score", ["step 2", "non-finite", "nan for"]),
    ("scorer returns inf", "inf_score", ["step 2", "non-finite", "inf for"]),
    ("scorer returns 1e39 (inf in float32)", "huge_score", ["step 2", "float32"]),
    (
        "scorer returns text",
        "text_score",
        ["step 2", "the scorer returned a str ('good')", "must be a number"],
    ),
]


@pytest.mark.parametrize("case,fn,words", SCORER_CASES, ids=[c[0] for c in SCORER_CASES])
def test_scorer_errors_keep_the_last_checkpoint(
    case, fn, words, tiny_model_dir, prompt_file, tmp_path, capsys
):
    _CALLS["n"] = 0
    out = tmp_path / "run"
    assert (
        main(_base(tiny_model_dir, prompt_file, out) + [f"reward.scorer=tests.e2e.test_bad_inputs:{fn}"]) == 1
    )
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "step 2" in line)
    print(f"\n| {case} | `reward.scorer=...:{fn}` | 1 | {line.strip()} |")
    for w in words:
        assert w in err, (w, err)
    assert "Traceback" not in err
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step-000001"  # steps 0 and 1 were checkpointed
    rows = metric_rows(out, timings=True)
    assert [r["step"] for r in rows] == [0, 1]  # nothing already written is lost
    # and the run resumes from it (with a good scorer): steps 2 and 3 are appended
    assert main(["train", "--resume", str(out), "reward.scorer=tests.conftest:length_judge"]) == 0
    rows = metric_rows(out, timings=True)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def test_run_directory_errors(tiny_model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(_base(tiny_model_dir, prompt_file, out)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"\n| output folder holds a run | `train.output_dir=run` | 1 | {err} |")
    assert "already holds a run" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"| resume of a folder that is not a run | `--resume nothing` | 1 | {err} |")
    assert "not a tether run directory" in err
    assert main(_base("/nonexistent-model", prompt_file, tmp_path / "m")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"| model folder that does not exist | `model.name=/nonexistent-model` | 1 | {err} |")
    assert "model.name" in err and "/nonexistent-model" in err
    assert not (tmp_path / "m").exists()  # no half-made run blocks the corrected command
    assert main(_base(tiny_model_dir, prompt_file, tmp_path / "s") + ["reward.scorer=nonsense"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"| unknown scorer | `reward.scorer=nonsense` | 1 | {err} |")
    assert "nonsense" in err and "module:function" in err


def _bomb(section: str, field: str) -> str:
    """400 bytes of YAML aliases, 9 levels of 9: 9**9 = 387,420,489 strings once expanded."""
    lines = [f"{section}:", f"  {field}:", "    a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"    {n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
    return "\n".join(lines) + "\n"


MB = "q" * 1_000_000
"""A 1 MB text (the pure-Python YAML reader takes about a second a megabyte)."""

# (case, config file, exit code, substrings of the error)
HOSTILE_CONFIGS = [
    ("alias bomb under data.prompts", _bomb("data", "prompts"), 2, ["data.prompts.b[0] (line 4)", "alias"]),
    (
        "alias bomb under rollout.stop_strings",
        _bomb("rollout", "stop_strings"),
        2,
        ["rollout.stop_strings.b[0]"],
    ),
    ("a key given twice", "kl:\n  kl_coef: 0.1\nkl:\n  kl_coef: 0.5\n", 2, ["line 3 repeats the key 'kl'"]),
    (
        "a 1 MB mapping for a list",
        f"rollout:\n  stop_strings: {{x: {MB}}}\n",
        2,
        ["(cut: a mapping of 1 key)"],
    ),
    ("a 1 MB data.prompts", f"data:\n  prompts: {MB}\n", 2, ["data.prompts='qqq", "(File name too long)"]),
    ("a 1 MB model.name", f"model:\n  name: {MB}\n", 2, ["model.name='qqq", "(cut: a text of 1,000,000"]),
    (
        "a 1 MB data.eval_prompts",
        f"data:\n  prompts: PROMPTS\n  eval_prompts: {MB}\n",
        1,
        ["data.eval_prompts='qqq", "cannot look"],
    ),
]


@pytest.mark.parametrize("case,text,code,words", HOSTILE_CONFIGS, ids=[c[0] for c in HOSTILE_CONFIGS])
def test_hostile_config_files_are_refused_in_a_few_lines(
    case, text, code, words, prompt_file, tmp_path, capsys
):
    """Before: the bombs ran out of memory (a MemoryError at 2.47 GB: the refusal's repr of 387
    million strings) or printed a 312 MB refusal; the repeated key was taken silently (the last
    value); a 1 MB value was printed whole (a 1 MB error line), and a 1 MB path raised an OSError
    that named no field."""
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("PROMPTS", str(prompt_file)))
    out = tmp_path / "run"
    start = time.perf_counter()
    assert main(["train", "--config", str(path), f"train.output_dir={out}"]) == code
    took = time.perf_counter() - start
    err = capsys.readouterr().err.strip()
    print(f"\n| {case} | {len(text):,} bytes | {code} | {took:.1f} s | {err.splitlines()[-1][:160]} |")
    for w in words:
        assert w in err, (w, err[:1000])
    assert len(err) < 1000 and not out.exists()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_is_refused_before_anything_is_written(
    precision, tiny_model_dir, prompt_file, tmp_path, monkeypatch, capsys
):
    from accelerate.state import AcceleratorState

    monkeypatch.setenv(
        "ACCELERATE_MIXED_PRECISION", precision
    )  # what `accelerate launch --mixed_precision` sets
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate keeps one state per process
    try:
        out = tmp_path / "run"
        assert main(_base(tiny_model_dir, prompt_file, out)) == 1
    finally:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
        AcceleratorState._reset_state(reset_partial_state=True)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"\n| accelerate mixed precision | `ACCELERATE_MIXED_PRECISION={precision}` | 1 | {err} |")
    assert f"mixed_precision='{precision}'" in err and "--mixed_precision no" in err
    assert not out.exists()


def test_a_run_that_fails_before_its_first_step_leaves_nothing_behind(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    # the DPO pairs file is read after the model loads and config.yaml is written: the failure
    # removes what the run wrote, and the same command with the file fixed then runs
    out = tmp_path / "run"
    out.mkdir()  # an empty folder given as train.output_dir stays, emptied
    args = _base(tiny_model_dir, prompt_file, out) + [
        "train.algo=dpo",
        f"dpo.pairs={tmp_path / 'pairs.jsonl'}",
        "train.steps=1",
        "dpo.n_pairs=2",
    ]
    assert main(args) == 1
    assert "pairs.jsonl" in capsys.readouterr().err
    assert out.exists() and list(out.iterdir()) == []
    (tmp_path / "pairs.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"the movie {i} was", "chosen": " great fun", "rejected": " dull"}) + "\n"
            for i in range(4)
        )
    )
    assert main(args) == 0
    assert (out / "metrics.jsonl").exists()


def test_non_finite_gradient_stops_before_the_weights_change():
    import torch

    from tether.trainers.update import optimizer_step

    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([w], lr=0.1)
    loss = (w * torch.tensor([float("nan"), 1.0])).sum()  # d loss / d w = [nan, 1]
    with pytest.raises(FloatingPointError, match="non-finite gradient norm nan in the ppo update"):
        optimizer_step(opt, [w], loss, 1.0, "ppo")
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))  # no step was taken
    assert not opt.state  # AdamW never stepped: its moments are untouched


def test_more_trainable_layers_than_blocks_is_refused(tiny_model_dir, prompt_file, tmp_path, capsys):
    # the tiny Llama has 2 blocks: 5 would have sliced from block -3 (the last one alone) before
    out = tmp_path / "run"
    assert main(_base(tiny_model_dir, prompt_file, out) + ["model.trainable_layers=5"]) == 1
    err = capsys.readouterr().err
    assert "model.trainable_layers=5" in err and "has 2 transformer blocks" in err
    assert not out.exists()  # the failed start leaves nothing
