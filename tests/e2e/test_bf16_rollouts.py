"""rollout.dtype=bf16: the training rollouts decode on a bfloat16 copy of the policy, the learner
rescores them, the sampler's distance is logged and its tokens are weighted (rollout.correction).

Runs on any CPU (oneDNN emulates bfloat16 where the CPU lacks it: slower, the same numbers to
test); ``rollout.dtype=auto`` picks it only where the CPU has bfloat16 matrix instructions.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch

from tests.conftest import make_tiny_llama, metric_rows, tiny_run_args
from tether.cli import main
from tether.models import sampling
from tether.models.rollouts import SamplerCopy
from tether.run import setup
from tether.run.checkpoint import latest_checkpoint
from tether.run.config import Config, ConfigError, load_config


def run(model_dir, prompts, out, **overrides) -> list[dict]:
    settings = {"rollout.dtype": "bf16", "train.steps": 3, "rollout.max_new_tokens": 6, **overrides}
    assert main(tiny_run_args(model_dir, prompts, out, settings, command=True)) == 0
    return metric_rows(out)


@pytest.mark.parametrize("algo", ["grpo", "ppo", "rloo"])
def test_each_trainer_learns_from_a_bf16_sampler_and_logs_its_distance(
    tiny_model_dir, prompt_file, tmp_path, algo
):
    rows = run(tiny_model_dir, prompt_file, tmp_path / algo, **{"train.algo": algo})
    first = rows[0]
    # step 0 is exact against the learner: its KL to the reference 0, its first ratio 1
    assert first["objective/kl_exact"] == 0.0
    assert first["policy/ratio_max_dev_first"] == 0.0
    for row in rows:
        kl = row["rollout/sampler_kl_exact"]
        assert 0 <= kl <= row["rollout/sampler_kl_max"] and math.isfinite(kl), row
        assert 0 <= row["rollout/is_clipped_fraction"] <= 1
        assert 0.5 < row["rollout/is_weight_mean"] < 1.5  # the tiny model's bf16 ratios are near 1
    # the sampler's log-probs are the copy's: they differ from the learner's by bf16 rounding
    assert any(r["rollout/logprob_diff_max"] > 1e-6 for r in rows)


def test_the_learner_sampling_logs_no_sampler_distance(tiny_model_dir, prompt_file, tmp_path):
    rows = run(tiny_model_dir, prompt_file, tmp_path / "fp32", **{"rollout.dtype": "fp32"})
    assert not any(k.startswith(("rollout/sampler_kl", "rollout/is_")) for r in rows for k in r)


def test_corrections_change_only_the_update_and_none_is_weight_one(tiny_model_dir, prompt_file, tmp_path):
    got = {
        c: run(
            tiny_model_dir,
            prompt_file,
            tmp_path / c,
            **{"rollout.correction": c, "rollout.correction_cap": 1.001},
        )
        for c in ("tis", "mis", "none")
    }
    # the same first batch (the same sampler and seeds) and the same distance
    assert {r[0]["rollout/sampler_kl_exact"] for r in got.values()} == {
        got["tis"][0]["rollout/sampler_kl_exact"]
    }
    assert got["none"][0]["rollout/is_weight_mean"] == 1.0
    # at a cap of 1.001 the bf16 ratios leave the band: mis drops whole sequences, tis truncates
    assert got["mis"][0]["rollout/is_clipped_fraction"] > 0
    assert got["mis"][0]["rollout/is_weight_mean"] < got["tis"][0]["rollout/is_weight_mean"] <= 1.001
    assert got["tis"][0]["policy/loss"] != got["none"][0]["policy/loss"]


def test_a_resumed_bf16_run_is_the_uninterrupted_one_bit_for_bit(tiny_model_dir, prompt_file, tmp_path):
    whole = run(tiny_model_dir, prompt_file, tmp_path / "whole", **{"train.checkpoint_every": 1})
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "whole", part)
    shutil.rmtree(latest_checkpoint(part))  # as if killed after step 2 was logged, before its checkpoint
    assert main(["train", "--resume", str(part)]) == 0
    resumed = metric_rows(part)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    assert strip(resumed) == strip(whole)  # the copy is rebuilt from the checkpoint's weights


def test_tool_turns_decode_on_the_copy(tiny_model_dir, prompt_file, tmp_path):
    rows = run(
        tiny_model_dir,
        prompt_file,
        tmp_path / "turns",
        **{
            "rollout.env": "tests.conftest:tool_env",
            "rollout.max_turns": 2,
            "rollout.stop_strings": "e",
            "rollout.max_new_tokens": 10,
        },
    )
    assert all("rollout/is_weight_mean" in r for r in rows)
    assert not any("rollout/sampler_kl_exact" in r for r in rows)  # logits not kept across turns


def test_the_copy_rounds_weights_keeps_buffers_and_ties_and_follows_the_trained_tensors(tiny_tokenizer):
    lm = make_tiny_llama(len(tiny_tokenizer), tie_word_embeddings=True)
    for p in lm.parameters():
        p.requires_grad_(False)
    trained = lm.model.layers[-1].mlp.down_proj.weight
    trained.requires_grad_(True)
    copy = SamplerCopy()
    bf = copy.of(lm)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    assert all(b.dtype == torch.float32 for b in bf.buffers() if b.is_floating_point())
    assert bf.lm_head.weight is bf.model.embed_tokens.weight  # tied: one tensor
    assert len(copy.trained) == 1
    with torch.no_grad():
        trained.add_(1.0)
        lm.model.layers[0].mlp.up_proj.weight.add_(1.0)  # frozen: never copied again
    bf = copy.of(lm)
    assert torch.equal(bf.model.layers[-1].mlp.down_proj.weight, trained.detach().to(torch.bfloat16))
    assert not torch.equal(
        bf.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16)
    )


def test_auto_picks_bf16_only_where_the_cpu_has_it(monkeypatch):
    config = Config()
    auto = replace(config, rollout=replace(config.rollout, dtype="auto"))
    monkeypatch.setattr(setup, "bf16_matmul_missing", lambda: None)
    assert setup.sampling_settings(auto, "cpu").dtype == "bf16"
    assert setup.sampling_settings(auto, "cuda").dtype == "fp32"
    assert setup.sampling_settings(config, "cpu").dtype == "fp32"  # the default: the learner samples
    monkeypatch.setattr(setup, "bf16_matmul_missing", lambda: "no AVX-512 BF16")
    assert setup.sampling_settings(auto, "cpu").dtype == "fp32"


def test_the_cpu_check_reads_onednns_cap(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in sampling.bf16_matmul_missing()


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"train.algo": "dpo", "rollout.dtype": "bf16"}, "rollout.dtype"),
        ({"rollout.dtype": "fp16"}, "rollout.dtype"),
        ({"rollout.correction": "vtrace"}, "rollout.correction"),
        ({"rollout.correction_cap": 1}, "rollout.correction_cap"),
        ({"rollout.correction_cap": "inf"}, "rollout.correction_cap"),
    ],
)
def test_bad_settings_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def test_a_lora_adapter_is_applied_in_bf16_and_follows_each_update(
    tiny_tokenizer, tiny_model_dir, prompt_file, tmp_path
):
    from tether.models.lora import add_lora
    from tether.models.policy import PolicyWithValue

    policy = PolicyWithValue(add_lora(make_tiny_llama(len(tiny_tokenizer)), 4, 8.0, ["q_proj", "v_proj"]))
    copy = SamplerCopy()
    bf = copy.of(policy.lm)
    trained = [n for n, p in policy.lm.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)  # the adapter's matrices alone
    assert len(copy.trained) == len(trained)
    b = next(p for n, p in policy.lm.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        b.fill_(0.5)  # an update of the adapter (peft starts B at 0)
    bf = copy.of(policy.lm)
    copied = dict(bf.named_parameters())[next(n for n, p in policy.lm.named_parameters() if p is b)]
    assert copied.dtype == torch.bfloat16 and bool((copied == 0.5).all())
    rows = run(tiny_model_dir, prompt_file, tmp_path / "lora", **{"model.lora_r": 4})
    assert rows[0]["objective/kl_exact"] == 0.0 and all("rollout/sampler_kl_exact" in r for r in rows)


def test_the_run_says_which_model_its_rollouts_decode_on(
    tiny_model_dir, prompt_file, tmp_path, capsys, monkeypatch
):
    run(tiny_model_dir, prompt_file, tmp_path / "bf16", **{"train.steps": 1, "train.progress": "true"})
    out = capsys.readouterr().out
    assert "rollout.dtype=bf16: training rollouts decode on a bfloat16 copy of the policy" in out
    monkeypatch.setattr(sampling, "bf16_matmul_missing", lambda: "no bf16 here")
    monkeypatch.setattr(setup, "bf16_matmul_missing", lambda: "no bf16 here")
    import tether.run.announce as announce

    monkeypatch.setattr(announce, "bf16_matmul_missing", lambda: "no bf16 here")
    run(
        tiny_model_dir,
        prompt_file,
        tmp_path / "auto",
        **{"train.steps": 1, "train.progress": "true", "rollout.dtype": "auto"},
    )
    assert (
        "rollout.dtype=auto: training rollouts decode on the policy itself (fp32) (no bf16 here)"
        in capsys.readouterr().out
    )


def test_a_bf16_learner_is_refused_a_bf16_sampler_and_auto_keeps_it_alone(monkeypatch):
    with pytest.raises(ConfigError, match="already bfloat16"):
        load_config(None, ["rollout.dtype=bf16", "model.dtype=bfloat16"])
    monkeypatch.setattr(setup, "bf16_matmul_missing", lambda: None)
    auto = load_config(None, ["rollout.dtype=auto", "model.dtype=bfloat16"])
    assert setup.sampling_settings(auto, "cpu").dtype == "fp32"  # the copy would be the learner
