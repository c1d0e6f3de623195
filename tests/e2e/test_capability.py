"""Issue #31 item 3: eval/capability_nll, the policy's NLL of human text no run trains on beside
the reference's (the alignment tax), periodic and final, with its health rule."""

from __future__ import annotations

import copy
import json

import torch

from tests.conftest import metric_rows, tiny_run_args
from tether.cli import main
from tether.core.health import HealthThresholds, capability_loss
from tether.judges.fluency import continuation_nll
from tether.run.evaluation import CapabilityProbe

SENTENCES = [
    "The council voted to delay the budget until the spring session.",
    "Schools in the district will open an hour later this year.",
    "A new bridge would cut the commute for thousands of drivers.",
    "Critics say the plan does too little for renters in the city.",
]


def test_batched_nll_matches_one_row_at_a_time(tiny_lm, tiny_tokenizer):
    prefixes = [s.split()[0] for s in SENTENCES]
    rests = [" " + s.split(maxsplit=1)[1] for s in SENTENCES]
    pad = tiny_tokenizer.pad_token_id
    batched = continuation_nll(
        tiny_lm, tiny_tokenizer, prefixes=prefixes, continuations=rests, batch_size=4, pad_id=pad
    )
    alone = [
        continuation_nll(tiny_lm, tiny_tokenizer, prefixes=[p], continuations=[r], batch_size=1, pad_id=pad)[
            0
        ]
        for p, r in zip(prefixes, rests)
    ]
    # each value is a float64 mean of float32 log-softmax values near log(300) = 5.7 nats; left
    # padding only changes float32 summation order in attention (relative 1e-6 of 5.7)
    for a, b in zip(batched, alone):
        assert abs(a - b) < 1e-4, (a, b)


def test_the_probe_is_zero_against_itself_and_sees_a_moved_policy(tiny_lm, tiny_tokenizer):
    probe = CapabilityProbe(SENTENCES, tiny_tokenizer, tiny_lm, batch_size=2)
    same = probe.measure(tiny_lm)
    assert same["capability_nll_change"] == 0.0 and same["capability_nll_change_se"] == 0.0
    assert same["capability_nll"] == same["ref_capability_nll"] > 0
    moved = copy.deepcopy(tiny_lm)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m = probe.measure(moved)
    assert m["ref_capability_nll"] == same["ref_capability_nll"]  # the reference scored once
    assert m["capability_nll_change"] != 0.0 and m["capability_nll_change_se"] > 0


def test_capability_loss_rule_by_hand():
    t = HealthThresholds()  # capability_margin 0.05 nats/token, quality_min_z 2

    def row(pol, ref, se):
        return {
            "step": 4,
            "eval/capability_nll": pol,
            "eval/ref_capability_nll": ref,
            "eval/capability_nll_change_se": se,
        }

    # +0.10 above the reference, SE 0.02: 0.10 > max(0.05, 2 x 0.02 = 0.04): fires
    alarm = capability_loss([row(3.10, 3.00, 0.02)], t)
    assert alarm is not None and alarm.rule == "capability_loss" and "+0.100" in alarm.message
    # the same rise with SE 0.06: 0.10 < 2 x 0.06 = 0.12, within noise
    assert capability_loss([row(3.10, 3.00, 0.06)], t) is None
    # +0.04, SE 0.001: below the 0.05 margin
    assert capability_loss([row(3.04, 3.00, 0.001)], t) is None
    # better than the reference never fires
    assert capability_loss([row(2.90, 3.00, 0.001)], t) is None


def _capability_run(model_dir, prompts, out, overrides: dict) -> list[str]:
    """A tiny run evaluated after every second step, capability probe on 4 sentences."""
    settings = {
        "data.heldout_fraction": None,
        "optim.epochs": None,
        "eval.every": 2,
        "eval.n_prompts": 2,
        "eval.periodic_prompts": 2,
        "eval.capability_texts": 4,
        "eval.fluency_model": "none",
        "eval.judge": None,
        **overrides,
    }
    return tiny_run_args(model_dir, prompts, out, settings, command=True)


def test_a_run_logs_capability_periodically_and_finally(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch, capsys
):
    import tether.run.evaluation

    monkeypatch.setattr(tether.run.evaluation, "capability_texts", lambda n: SENTENCES[:n])
    out = tmp_path / "run"
    args = _capability_run(
        tiny_model_dir,
        prompt_file,
        out,
        {
            "optim.lr": "1e-2",
            "train.steps": 3,
            "train.checkpoint_every": 0,
        },  # lr: moves the tiny policy enough to see
    )
    assert main(args) == 0
    rows = metric_rows(out, timings=True)
    periodic = [r for r in rows if "eval/capability_nll" in r]
    assert [r["step"] for r in periodic] == [0, 2]
    assert len({r["eval/ref_capability_nll"] for r in periodic}) == 1  # the reference does not move
    ev = json.loads((out / "eval.json").read_text())
    assert ev["capability_texts"] == 4 and ev["capability_nll_change"] != 0
    assert abs(ev["capability_nll"] - ev["ref_capability_nll"] - ev["capability_nll_change"]) < 1e-12
    said = capsys.readouterr().out
    assert "tether: capability (NLL of 4 human sentences" in said and "s per evaluation" in said


def test_a_resumed_run_does_not_score_the_reference_again(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    import shutil

    import tether.run.evaluation

    monkeypatch.setattr(tether.run.evaluation, "capability_texts", lambda n: SENTENCES[:n])

    def args(out, steps):
        overrides = {"train.steps": steps, "train.checkpoint_every": 1, "train.keep_checkpoints": 10}
        return _capability_run(tiny_model_dir, prompt_file, out, overrides)

    # evaluations after steps 0, 2, 4 and 5: resumed after step 3, the evaluation after step 4
    # would score the reference again and step 5's row count one reference forward more
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(args(full, 6)) == 0
    assert main(args(part, 6)) == 0
    # back to the checkpoint of step 2, as a kill after it would leave the folder
    ckpts = part / "checkpoints"
    for d in ckpts.glob("step-*"):
        if d.name != "step-000003":
            shutil.rmtree(d)
    (ckpts / "LATEST").write_text("step-000003")
    assert main(["train", "--resume", str(part)]) == 0
    # every row, kl/reference_forwards included: the reference's capability NLLs are read back
    assert metric_rows(part) == metric_rows(full)
    assert (part / "eval_reference_capability.json").exists()


def test_the_anchors_builtin_texts_never_hold_a_probe_sentence():
    # the anchor trains on the capability file's sentences from rank PROBE_MAX on; none of them
    # may be a probe sentence, hold one, or be held in one (after lower-casing and joining white
    # space): the file repeats 5 snippets inside longer ones, which are left out
    from tether.data.capability import PROBE_MAX, _ranked, anchor_texts, capability_texts, normalized

    probe = [normalized(t) for t in capability_texts(PROBE_MAX)]
    anchor = anchor_texts()
    assert len(anchor) == len(_ranked()) - PROBE_MAX - 5
    for text in anchor:
        n = normalized(text)
        assert not any(p in n or n in p for p in probe), text
