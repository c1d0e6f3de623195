"""Where the KL went, end to end on a tiny random model: the kl/* metrics of every step, the
records of kl_tokens.jsonl, ``tether kl`` and the report's section, a resume, and bad input."""

from __future__ import annotations

import json

import pytest

from tests.conftest import metric_rows
from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main


def _records(out):
    return [json.loads(line) for line in (out / "kl_tokens.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_every_step_attributes_its_kl_and_writes_its_record(
    algo, tiny_model_dir, prompt_file, tmp_path, capsys
):
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + [
        f"train.algo={algo}",
        "kl.tokens_every=1",
        "optim.lr=3e-3",
        "reward.scorer=tests.conftest:length_judge",
    ]
    assert main(args) == 0
    rows, records = metric_rows(out), _records(out)
    assert [r["step"] for r in records] == [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["kl/token_max"] == 0.0 and "kl/top1pct_share" not in rows[0]  # step 0: no KL to share
    for row, rec in zip(rows[1:], records[1:]):
        positions = rec["positions"]
        kls = [p["kl"] for p in positions]
        assert 1 <= len(positions) <= 20 and kls == sorted(kls, reverse=True)
        # the largest listed position is the step's largest token KL (the same float32 value)
        assert kls[0] == row["kl/token_max"]
        assert 0 <= row["kl/top1pct_share"] <= 1 and 0 <= row["kl/special_token_share"] <= 1
        assert 0 <= row["kl/top1_agreement"] <= 1 and row["kl/misaligned_share"] == 0.0
        # the by-id table adds up to the batch's summed KL (float64 sums of the same values)
        assert sum(t["kl"] for t in rec["by_token_id"]) <= rec["kl_sum"] * (1 + 1e-12)
        for p in positions:
            assert len(p["policy_top"]) == len(p["reference_top"]) == 5 and p["misaligned"] is False
            assert p["k1"] == pytest.approx(p["logprob"] - p["ref_logprob"], abs=1e-6)
            assert str(p["row"]) in rec["responses"]
        # each shaded response ends at its last policy token (no padding after it)
        assert all(tokens[-1][1] is not None for tokens in rec["responses"].values())
        assert "rise" in rec  # the previous step's ids were kept
    capsys.readouterr()
    assert main(["kl", str(out), "--step", "2"]) == 0
    said = capsys.readouterr().out
    assert "step 2: KL" in said and "KL by token id" in said and "policy top-3 | reference top-3" in said
    listed = len(_records(out)[2]["rise"]["by_token_id"])
    assert f"the {listed} ids below carry" in said  # every id the share is over is shown
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "Where the KL went" in page and "nats' style='background: rgba(220,40,40," in page


def test_a_resumed_run_writes_the_records_of_the_uninterrupted_one(tiny_model_dir, prompt_file, tmp_path):
    # the attribution's previous reading and ids are checkpointed: the records after a resume (jumps
    # and rises) are the uninterrupted run's, and the resumed run's file has each step once
    base = ["kl.tokens_every=2", "optim.lr=3e-3", "kl.tokens_jump=0", "train.checkpoint_every=1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_tiny_args(tiny_model_dir, prompt_file, full) + base + ["train.steps=4"]) == 0
    assert main(_tiny_args(tiny_model_dir, prompt_file, cut) + base + ["train.steps=2"]) == 0
    assert main(["train", "--resume", str(cut), "train.steps=4"]) == 0
    assert _records(cut) == _records(full)
    assert [r["step"] for r in _records(full)] == sorted({r["step"] for r in _records(full)})


def test_tether_kl_refuses_what_it_cannot_read(tiny_model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    # records at steps 0 and 2 (every 2) and 1 (a rise from step 0's 0 is always a jump)
    args = ["kl.tokens_every=2", "kl.tokens_jump=1e9"]
    assert main(_tiny_args(tiny_model_dir, prompt_file, out) + args) == 0
    capsys.readouterr()
    assert main(["kl", str(out), "--step", "5"]) == 1
    assert "has no record of step 5; its steps: 0, 1, 2" in capsys.readouterr().err
    (out / "kl_tokens.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    assert main(["kl", str(out)]) == 1
    assert "kl_tokens.jsonl:2" in capsys.readouterr().err
    # a hand-edited record of the wrong shapes shows what it can, n/a elsewhere: no traceback
    bad = [
        {"step": 1, "kl": 0.1, "previous_kl": 0.05, "positions": {"a": 1}},
        {
            "step": 2,
            "kl": float("nan"),
            "previous_kl": 0.0,
            "positions": [{"row": [1, 2], "policy_top": {"a": 1}}],
        },
        {"step": 3, "kl": 10**400, "by_token_id": [{"id": None, "count": None}], "rise": {"by_token_id": 5}},
        {"step": 4, "kl": 5.0, "previous_kl": 0.1, "positions": [{"policy_top": [["a"]], "kl": "x"}]},
    ]
    (out / "kl_tokens.jsonl").write_text("\n".join(json.dumps(r) for r in bad) + "\n")
    for step in (1, 2, 3, 4):
        assert main(["kl", str(out), "--step", str(step)]) == 0
    assert main(["kl", str(out)]) == 0
    assert "step 4: KL 5.0000" in capsys.readouterr().out  # the largest finite rise, not the NaN one
    assert main(["report", str(out)]) == 0
    # a link in the run folder is refused, as tether report refuses it
    (out / "kl_tokens.jsonl").unlink()
    (tmp_path / "elsewhere.jsonl").write_text('{"step": 0}\n')
    (out / "kl_tokens.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert main(["kl", str(out)]) == 1
    assert "symbolic link" in capsys.readouterr().err
    (out / "kl_tokens.jsonl").unlink()
    assert main(["kl", str(out)]) == 1
    assert "kl.tokens_every" in capsys.readouterr().err
    # attribution off: no kl/* attribution metric, no file
    off = tmp_path / "off"
    assert (
        main(_tiny_args(tiny_model_dir, prompt_file, off) + ["kl.attribution=false", "kl.tokens_every=1"])
        == 0
    )
    assert not (off / "kl_tokens.jsonl").exists()
    assert not any(k.startswith("kl/token_") for r in metric_rows(off) for k in r)
    capsys.readouterr()
    assert main(["kl", str(off)]) == 1
    assert "ran with kl.attribution=false" in capsys.readouterr().err
    assert main(["kl", str(tmp_path)]) == 1  # a folder no run wrote
    assert "is not a tether run folder" in capsys.readouterr().err
