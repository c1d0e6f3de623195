"""tether interpolate: the saved policy moved back toward its reference, evaluated as the run was."""

import json

import pytest

from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main
from tether.run.interpolate import parse_alphas


@pytest.mark.real_plots
def test_the_ends_are_the_reference_and_the_saved_policy(tiny_model_dir, prompt_file, tmp_path, capsys):
    # alpha 0 is the reference's weights: its held-out samples are the reference's (same seeds), so
    # every change is exactly 0; alpha 1 is the saved policy: eval.json's numbers, exactly
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + ["train.save_model=true", "optim.lr=3e-2"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["interpolate", str(out), "--alpha", "1,0,0.5"]) == 0
    printed = capsys.readouterr().out
    assert "alpha | proxy gain" in printed and "interpolate.png" in printed
    rows = json.loads((out / "interpolate.json").read_text())["rows"]
    assert [r["alpha"] for r in rows] == [0.0, 0.5, 1.0]
    final = json.loads((out / "eval.json").read_text())
    assert rows[0]["gain"] == 0.0 and rows[0]["kl"] == 0.0 and rows[0]["fluency_nll_change"] == 0.0
    assert rows[0]["gold_gain"] == 0.0
    assert rows[2]["gain"] == final["gain"] and rows[2]["gold_gain"] == final["gold_gain"]
    assert rows[2]["kl"] == final["policy"]["kl"] and rows[2]["kl"] > 0
    assert (out / "interpolate.png").stat().st_size > 0
    # a link planted at interpolate.png is refused by name, its target left alone
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"kept")
    (out / "interpolate.png").unlink()
    (out / "interpolate.png").symlink_to(outside)
    capsys.readouterr()
    assert main(["interpolate", str(out), "--alpha", "0"]) == 1
    assert "interpolate.png -> " in capsys.readouterr().err and outside.read_bytes() == b"kept"
    (out / "interpolate.png").unlink()
    assert main(["interpolate", str(out), "--alpha", "0"]) == 0  # the run folder's lock was released


def test_bad_alphas_and_folders_are_refused(tiny_model_dir, prompt_file, tmp_path, capsys):
    for text, match in (("x", "not a number"), ("1.5", "outside"), ("-0.1", "outside"), ("nan", "outside")):
        with pytest.raises(ValueError, match=match):
            parse_alphas(text)
    assert parse_alphas("1, 0,0.5,0") == [0.0, 0.5, 1.0]
    assert parse_alphas("-0,1") == [0.0, 1.0] and str(parse_alphas("-0")[0]) == "0.0"
    with pytest.raises(ValueError, match="no value"):
        parse_alphas(" , ")
    assert main(["interpolate", str(tmp_path / "nothing")]) == 1
    assert "not a tether run folder" in capsys.readouterr().err
    out = tmp_path / "run"  # a run that saved no policy
    assert main(_tiny_args(tiny_model_dir, prompt_file, out) + ["train.save_model=false"]) == 0
    capsys.readouterr()
    assert main(["interpolate", str(out)]) == 1
    assert "train.save_model=false" in capsys.readouterr().err


def test_a_lora_run_scales_its_adapter_and_its_ends_are_reference_and_policy(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    # LoRA: A as trained, B times alpha, the base never written: alpha 0 is the reference (every
    # change exactly 0), alpha 1 the saved adapter (eval.json's numbers, exactly)
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + [
        "train.save_model=true",
        "optim.lr=3e-2",
        "model.lora_r=4",
    ]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["interpolate", str(out), "--alpha", "0,0.5,1"]) == 0
    rows = json.loads((out / "interpolate.json").read_text())["rows"]
    final = json.loads((out / "eval.json").read_text())
    assert rows[0]["gain"] == 0.0 and rows[0]["kl"] == 0.0
    assert rows[2]["gain"] == final["gain"] and rows[2]["kl"] == final["policy"]["kl"] > 0
    assert 0 < rows[1]["kl"] < rows[2]["kl"]  # between the ends


def test_a_lora_run_from_an_adapter_is_refused_by_name(tiny_model_dir, prompt_file, tmp_path, capsys):
    first = tmp_path / "first"
    assert (
        main(_tiny_args(tiny_model_dir, prompt_file, first) + ["train.save_model=true", "model.lora_r=4"])
        == 0
    )
    second = tmp_path / "second"
    args = _tiny_args(tiny_model_dir, prompt_file, second) + [
        "train.save_model=true",
        f"model.adapter={first / 'policy'}",
    ]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["interpolate", str(second), "--alpha", "0.5"]) == 1
    assert "model.adapter" in capsys.readouterr().err


def test_a_run_whose_anchor_texts_are_gone_is_still_interpolated(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    # the text anchor trains only: interpolate never reads its texts, so a deleted file is no matter
    texts = tmp_path / "anchor.txt"
    texts.write_text("".join(f"plain text number {i} about the weather\n" for i in range(8)))
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + [
        "train.save_model=true",
        f"anchor.texts={texts}",
        "anchor.coef=1",
        "anchor.batch_size=4",
    ]
    assert main(args) == 0
    texts.unlink()
    capsys.readouterr()
    assert main(["interpolate", str(out), "--alpha", "0,1"]) == 0
    rows = json.loads((out / "interpolate.json").read_text())["rows"]
    assert rows[1]["gain"] == json.loads((out / "eval.json").read_text())["gain"]
