"""kl.divergence end to end: another divergence held in the loss, on the rows it was computed for,
and refused by name where its gradient or its units would be wrong."""

import math

import pytest

from tests.conftest import metric_rows
from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main
from tether.run.config import ConfigError, load_config

LEASH = ["kl.controller=fixed", "kl.kl_coef=0.5"]


@pytest.mark.parametrize("algo", ["grpo", "rloo", "ppo"])
@pytest.mark.parametrize("divergence", ["forward_kl", "js", "alpha"])
def test_a_divergence_leash_trains_and_reads_its_own_rows(
    algo, divergence, tiny_model_dir, prompt_file, tmp_path
):
    # optim.lr=1e-30: the policy never moves (each Adam step rounds away against weights ~1e-2),
    # so at every minibatch the divergence of its logits from the reference's is 0 up to float32
    # rounding (the two forwards batch rows differently: logits O(10) agree to ~1e-6, a divergence
    # of equal distributions is then ~1e-10). A reference logit row paired with another sample's
    # policy row would give O(1) on this random model.
    placement = ["kl.kl_in_reward=false", "kl.kl_in_loss=true"] if algo != "grpo" else []
    still = tmp_path / "still"
    args = _tiny_args(tiny_model_dir, prompt_file, still) + [
        f"train.algo={algo}",
        f"kl.divergence={divergence}",
    ]
    assert main(args + LEASH + placement + ["optim.lr=1e-30"]) == 0
    rows = metric_rows(still)
    assert all(abs(r["policy/kl_loss"]) < 1e-6 for r in rows), [r["policy/kl_loss"] for r in rows]
    # trained: the term is the divergence of a policy that left the reference (each step's first
    # minibatch is at 0; the epochs after it are not)
    moved = tmp_path / "moved"
    args = _tiny_args(tiny_model_dir, prompt_file, moved) + [
        f"train.algo={algo}",
        f"kl.divergence={divergence}",
    ]
    assert (
        main(args + LEASH + placement + ["optim.lr=3e-2", "reward.scorer=tests.conftest:length_judge"]) == 0
    )
    rows = metric_rows(moved)
    assert rows[-1]["policy/kl_loss"] > 1e-4
    assert f"`kl.divergence={divergence}`" in (moved / "policy" / "README.md").read_text()  # the card says so
    assert all(math.isfinite(r["objective/kl_exact"]) for r in rows)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["train.algo=ppo"], "kl.kl_in_reward=false kl.kl_in_loss=true"),  # PPO: in the reward
        (["train.algo=grpo", "kl.controller=budget"], "kl.controller=fixed"),
        (["train.algo=grpo", "kl.controller=adaptive"], "kl.controller=fixed"),
        (["train.algo=dpo"], "dpo.beta"),
    ],
)
def test_a_divergence_where_it_would_be_wrong_is_refused_by_name(overrides, match):
    extra = LEASH if "kl.controller" not in " ".join(overrides) else ["kl.kl_coef=0.5"]
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, [*overrides, "kl.divergence=forward_kl", *extra]).for_run()
    assert "kl.divergence" in str(e.value)
    with pytest.raises(ConfigError, match="kl.divergence"):
        load_config(None, ["kl.divergence=tv"]).for_run()
    for alpha in ("1e-300", "0.9999999", "0"):  # float32 would underflow it: the logged value NaN
        with pytest.raises(ConfigError, match="kl.alpha"):
            load_config(None, [f"kl.alpha={alpha}"]).for_run()


def test_under_the_update_guards_lookahead_the_kept_forward_keeps_its_logits(
    tiny_model_dir, prompt_file, tmp_path
):
    # kl.guard at a fixed beta with 2 epochs of one whole-batch minibatch: the guard's measure keeps
    # the next epoch's forward, which the divergence's loss term then reads (logits and all)
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + [
        "train.algo=grpo",
        "kl.divergence=forward_kl",
        "kl.guard=true",
        "optim.epochs=2",
        "optim.minibatch_size=4",
        "reward.scorer=tests.conftest:length_judge",
        "optim.lr=3e-2",
    ]
    assert main(args + LEASH) == 0
    rows = metric_rows(out)
    assert rows[-1]["policy/kl_loss"] > 1e-4 and "guard/fraction" in rows[-1]


def test_reference_logits_over_the_bound_are_refused_before_the_first_step(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch, capsys
):
    import tether.trainers.base as base

    monkeypatch.setattr(base, "REF_LOGITS_BYTES", 1 << 10)  # 1 KiB: 4 rows x 6 positions x V do not fit
    out = tmp_path / "run"
    args = _tiny_args(tiny_model_dir, prompt_file, out) + ["train.algo=grpo", "kl.divergence=js"]
    assert main(args + LEASH) == 1
    err = capsys.readouterr().err
    assert "kl.divergence=js keeps the reference's logits" in err and "rollout.max_new_tokens" in err
    assert not (out / "metrics.jsonl").exists()  # refused before any step
