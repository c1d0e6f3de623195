"""LoRA through peft: the policy trains adapters, the reference is the same base (no second copy).

Two cases, each checked through tether's own code path (``build_run``, ``old_and_ref_logprobs``, the
PPO step): a fresh adapter (``B = 0``), where the reference is the base with adapters disabled,
and a starting adapter, where the reference is base + a frozen copy of that adapter. In both
step-0 KL is exactly 0; with a starting adapter the bare base would be the wrong reference.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import make_tiny_llama, metric_rows
from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main
from tether.models.loading import load_causal_lm
from tether.models.lora import (
    POLICY_ADAPTER,
    REFERENCE_ADAPTER,
    AdapterReference,
    adapter_of,
    add_lora,
)
from tether.models.policy import PolicyWithValue
from tether.models.reference import check_reference, fingerprint, make_reference
from tether.models.sampling import Rollout
from tether.models.scoring import rollout_logprobs
from tether.run.config import ConfigError, load_config
from tether.run.setup import build_run
from tether.trainers.common import old_and_ref_logprobs
from tether.trainers.ppo import PPOTrainer


def _lora_config(model_dir, prompts, out, *extra):
    args = _tiny_args(model_dir, prompts, out)[1:] + [
        "eval.n_prompts=0",
        "eval.every=0",
        "train.save_model=false",
        "reward.scorer=tests.conftest:length_judge",
        *extra,
    ]
    return load_config(None, args)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory, tiny_model_dir):
    """A saved LoRA adapter on the tiny Llama with non-zero B (as if trained): policy != base."""
    out = tmp_path_factory.mktemp("adapter")
    peft_model = add_lora(load_causal_lm(tiny_model_dir), 4, 8.0, ["q_proj", "v_proj", "up_proj"])
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out


# ---- (a) fresh adapter: step-0 KL is exactly 0 ----------------------------------------------
@pytest.mark.numerics
def test_fresh_adapter_step_zero_kl_is_exactly_zero(tiny_model_dir, prompt_file, tmp_path):
    run = build_run(_lora_config(tiny_model_dir, prompt_file, tmp_path / "r", "model.lora_r=4"))
    assert isinstance(run.reference, AdapterReference) and run.reference.adapter is None
    # no second copy: the reference's tensors are the policy's own base tensors
    base = {p.data_ptr() for p in run.policy.lm.parameters()}
    assert all(p.data_ptr() in base for p in run.reference.parameters())
    assert all(not p.detach().any() for n, p in run.policy.named_parameters() if "lora_B" in n)  # B = 0
    trainer = PPOTrainer(run)
    row = trainer.step(0)
    exp = trainer.last_experience
    assert exp.rollout.response_mask.sum() > 0
    assert torch.equal(exp.old_logprobs, exp.ref_logprobs)  # bit for bit
    assert row["objective/kl"] == 0.0 and row["objective/kl_exact"] == 0.0
    assert row["policy/ratio_max_dev_first"] == 0.0
    assert row["kl/reference_forwards"] == 2  # two minibatches scored; the policy's forwards not counted


def test_lora_cli_run_saves_an_adapter_and_a_run_can_start_from_it(tiny_model_dir, prompt_file, tmp_path):
    first = tmp_path / "first"
    assert main(_tiny_args(tiny_model_dir, prompt_file, first) + ["model.lora_r=4"]) == 0
    rows = metric_rows(first)
    assert rows[0]["objective/kl"] == 0.0 and rows[0]["objective/kl_exact"] == 0.0
    assert rows[-1]["objective/kl_exact"] > 0  # the adapter did train
    saved = first / "policy"
    assert (saved / "adapter_config.json").exists() and (saved / "value_head.safetensors").exists()
    assert not (saved / REFERENCE_ADAPTER).exists() and not (saved / "model.safetensors").exists()
    # the trained adapter as the starting policy: the reference is base + that adapter, so KL 0 again
    second = tmp_path / "second"
    assert (
        main(_tiny_args(tiny_model_dir, prompt_file, second) + [f"model.adapter={saved}", "train.steps=1"])
        == 0
    )
    row = metric_rows(second)[0]
    assert (
        row["objective/kl"] == 0.0
        and row["objective/kl_exact"] == 0.0
        and row["policy/ratio_max_dev_first"] == 0.0
    )


# ---- (b) starting adapter: the reference is base + adapter, not the bare base ---------------
@pytest.mark.numerics
def test_starting_adapter_is_the_reference_not_the_bare_base(tmp_path):
    # A 2-token vocabulary and a zeroed LM head: the base gives logits [0, 0] everywhere.
    base_dir = tmp_path / "base"
    lm = make_tiny_llama(2, tie_word_embeddings=False)
    with torch.no_grad():
        lm.lm_head.weight.zero_()
    lm.save_pretrained(base_dir)
    prompt = torch.tensor([[1, 0, 1]])  # (1, P)
    response = torch.tensor([[0, 1, 0]])  # (1, R): the first response token is token 0
    ro = Rollout(
        ["p"],
        prompt,
        prompt_mask=torch.ones_like(prompt),
        response_ids=response,
        response_mask=torch.ones_like(response, dtype=torch.bool),
        responses=["r"],
    )
    with torch.no_grad():
        h = lm.model(input_ids=prompt).last_hidden_state[0, -1]  # (d,) predicts the first response token

    # A rank-1 LoRA on lm_head, scaling alpha / r = 1: delta_W h = B (A h) = [1, 0] with
    # A = h^T / |h|^2 and B = [[1], [0]], so the trained policy's first-token logits are [1, 0].
    adapter_dir = tmp_path / "adapter"
    trained = add_lora(load_causal_lm(base_dir), 1, 1.0, ["lm_head"])
    with torch.no_grad():
        trained.base_model.model.lm_head.lora_A[POLICY_ADAPTER].weight.copy_(h[None] / h.dot(h))
        trained.base_model.model.lm_head.lora_B[POLICY_ADAPTER].weight.copy_(torch.tensor([[1.0], [0.0]]))
    trained.save_pretrained(adapter_dir, save_embedding_layers=False)

    # Start a run from base + adapter, with tether's model building and scoring.
    peft_model = add_lora(load_causal_lm(base_dir), 0, 16.0, ["q_proj"], adapter=str(adapter_dir))
    policy, reference = PolicyWithValue(peft_model), make_reference(peft_model)
    check_reference(policy, reference)
    assert reference.adapter == REFERENCE_ADAPTER
    forwards = old_and_ref_logprobs(
        policy, reference, ro, 1.0, [torch.arange(1)], with_values=True, exact_kl=True
    )
    assert torch.equal(forwards.old_logprobs, forwards.ref_logprobs)  # step-0 KL exactly 0
    assert torch.equal(forwards.exact_kl, torch.zeros_like(forwards.exact_kl))

    # The wrong reference, the bare base (logits [0, 0]):
    #   log pi(0)     = log(e / (1 + e)) = 1 - log(1 + e) = -0.313262
    #   log p_base(0) = log(1 / 2)                          = -0.693147
    #   k1 = log pi(0) - log p_base(0)                      =  0.379885 nats
    bare = rollout_logprobs(load_causal_lm(base_dir), ro, 1.0).logprobs
    assert float(bare[0, 0]) == pytest.approx(math.log(0.5), abs=1e-7)
    assert float(forwards.old_logprobs[0, 0]) == pytest.approx(1 - math.log(1 + math.e), abs=1e-5)
    k1_wrong = float(forwards.old_logprobs[0, 0] - bare[0, 0])
    assert k1_wrong == pytest.approx(0.379885, abs=1e-5)


def test_starting_adapter_run_step_zero_kl_is_zero(tiny_model_dir, prompt_file, tmp_path, trained_adapter):
    run = build_run(
        _lora_config(tiny_model_dir, prompt_file, tmp_path / "r", f"model.adapter={trained_adapter}")
    )
    trainer = PPOTrainer(run)
    trainer.step(0)
    exp = trainer.last_experience
    mask = exp.rollout.response_mask
    assert torch.equal(exp.old_logprobs, exp.ref_logprobs)
    # with the adapters disabled (the bare base) the same tokens score differently
    with torch.no_grad():
        bare = rollout_logprobs(AdapterReference(run.policy.peft, None), exp.rollout, 1.0).logprobs
    assert float((exp.old_logprobs - bare)[mask].abs().max()) > 1e-3


# ---- (c) after an optimizer step: base and reference adapter bit-identical ------------------
@pytest.mark.numerics
def test_only_the_policy_adapter_moves(tiny_model_dir, prompt_file, tmp_path, trained_adapter):
    run = build_run(
        _lora_config(tiny_model_dir, prompt_file, tmp_path / "r", f"model.adapter={trained_adapter}")
    )
    before = _snapshot(run.policy.peft)
    head_before = _snapshot(run.policy.value_head)
    flags = {n: p.requires_grad for n, p in run.policy.named_parameters()}
    trainer = PPOTrainer(run)
    # the optimizer holds the policy adapter and the value head, nothing else
    names = {id(p): n for n, p in run.policy.named_parameters()}
    assert {adapter_of(names[id(p)]) for p in trainer.params} == {POLICY_ADAPTER, None}
    assert {names[id(p)] for p in trainer.params if adapter_of(names[id(p)]) is None} == {
        "value_head.weight",
        "value_head.bias",
    }
    trainer.step(0)
    exp = trainer.last_experience
    after = run.policy.peft.state_dict()
    frozen = [k for k in before if adapter_of(k) in (None, REFERENCE_ADAPTER)]
    moving = [k for k in before if adapter_of(k) == POLICY_ADAPTER]
    assert any(REFERENCE_ADAPTER in k for k in frozen) and len(frozen) > len(moving) > 0
    assert all(torch.equal(before[k], after[k]) for k in frozen)  # base + reference adapter
    assert any(not torch.equal(before[k], after[k]) for k in moving)  # the policy adapter trained
    assert any(not torch.equal(head_before[k], v) for k, v in run.policy.value_head.state_dict().items())
    assert fingerprint(run.reference) == run.reference_fingerprint
    assert {n: p.requires_grad for n, p in run.policy.named_parameters()} == flags  # switching restored them
    check_reference(run.policy, run.reference)
    # re-scored in the row groups step 4 scored (same rows, same shapes, same kernels), the
    # reference's log-probs are bit-identical: it did not move (in other groups, a matrix product
    # of another row count may round differently on some CPUs)
    ref_again = torch.empty_like(exp.ref_logprobs)
    with torch.no_grad():
        for idx in exp.minibatches:
            ref_again[idx] = rollout_logprobs(run.reference, exp.rollout.select(idx), 1.0).logprobs
        pol_again = rollout_logprobs(run.policy, exp.rollout, 1.0).logprobs
    assert torch.equal(ref_again, exp.ref_logprobs)  # the reference did not move
    assert not torch.equal(pol_again, exp.old_logprobs)  # the policy did


def test_fingerprint_covers_base_and_reference_adapter_only(tiny_model_dir, trained_adapter):
    peft_model = add_lora(load_causal_lm(tiny_model_dir), 0, 16.0, ["q_proj"], adapter=str(trained_adapter))
    reference = make_reference(peft_model)
    fp = fingerprint(reference)
    params = dict(peft_model.named_parameters())
    for name, expect_change in (
        (next(k for k in params if adapter_of(k) == POLICY_ADAPTER), False),
        (next(k for k in params if adapter_of(k) == REFERENCE_ADAPTER), True),
        (next(k for k in params if adapter_of(k) is None), True),
    ):
        with torch.no_grad():
            params[name].view(-1)[0] += 1e-3
        assert (fingerprint(reference) != fp) == expect_change, name
        with torch.no_grad():
            params[name].view(-1)[0] -= 1e-3
        fp = fingerprint(reference)


def test_trainable_base_is_refused_as_a_moving_reference(tiny_model_dir):
    peft_model = add_lora(load_causal_lm(tiny_model_dir), 4, 8.0, ["q_proj"])
    policy, reference = PolicyWithValue(peft_model), make_reference(peft_model)
    check_reference(policy, reference)
    next(p for n, p in peft_model.named_parameters() if adapter_of(n) is None).requires_grad_(True)
    with pytest.raises(ValueError, match="trainable"):
        check_reference(policy, reference)


# ---- (d) checkpoint and resume ------------------------------------------------------------
def test_lora_resume_matches_uninterrupted(tiny_model_dir, prompt_file, tmp_path, trained_adapter):
    def args(out, steps):
        return _tiny_args(tiny_model_dir, prompt_file, out) + [
            f"model.adapter={trained_adapter}",
            f"train.steps={steps}",
            "train.checkpoint_every=2",
            "eval.n_prompts=0",
            "eval.every=0",
            "train.save_model=false",
        ]

    full, split = tmp_path / "full", tmp_path / "split"
    assert main(args(full, 3)) == 0
    assert main(args(split, 2)) == 0  # checkpoint after step 1, then stop
    ckpt = split / "checkpoints" / "step-000001"
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "policy.safetensors"))
    assert saved and all(adapter_of(k) == POLICY_ADAPTER for k in saved)  # the adapter only, no base
    assert main(["train", "--resume", str(split), "train.steps=3"]) == 0
    a, b = metric_rows(full), metric_rows(split)
    assert [r["step"] for r in b] == [0, 1, 2]
    assert a == b  # every metric of every step, bit for bit (CPU, fixed seed)


# ---- config --------------------------------------------------------------------------------
def test_lora_config_fields():
    c = load_config(
        None, ["model.lora_r=8", "model.lora_alpha=32", "model.lora_target_modules=q_proj,v_proj"]
    )
    assert c.model.lora and c.model.lora_r == 8 and c.model.lora_target_modules == ["q_proj", "v_proj"]
    assert load_config(None, ["model.lora_target_modules=[q_proj]"]).model.lora_target_modules == ["q_proj"]
    assert load_config(None, ["model.adapter=some/folder"]).model.lora
    assert not load_config().model.lora


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["model.lora_r=-1"], "model.lora_r"),
        (["model.lora_alpha=0"], "model.lora_alpha"),
        (["model.lora_target_modules=[]"], "model.lora_target_modules"),
        (["model.adapter=some/folder", "model.lora_r=4"], "model.lora_r"),
        (["model.lora_r=4", "model.trainable_layers=1"], "model.trainable_layers"),
    ],
)
def test_bad_lora_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert field in str(e.value)


def test_adapter_folder_must_exist(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="model.adapter"):
        add_lora(load_causal_lm(tiny_model_dir), 0, 16.0, ["q_proj"], adapter=str(tmp_path))


@pytest.mark.numerics
def test_reference_generates_as_the_starting_policy(tiny_model_dir, tiny_tokenizer, trained_adapter):
    from tether.models.sampling import generate

    peft_model = add_lora(load_causal_lm(tiny_model_dir), 0, 16.0, ["q_proj"], adapter=str(trained_adapter))
    policy, reference = PolicyWithValue(peft_model), make_reference(peft_model)
    prompts = ["the movie was", "a film that"] * 4

    def sample(model):
        torch.manual_seed(0)
        return generate(model, tiny_tokenizer, prompts, 8, 1.0).response_ids

    # DPO samples its pairs from the reference: base + starting adapter, the policy at step 0
    assert torch.equal(sample(reference), sample(policy.lm))
    assert not torch.equal(sample(AdapterReference(peft_model, None)), sample(policy.lm))


def test_dpo_with_lora_runs(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "dpo"
    assert (
        main(
            _tiny_args(tiny_model_dir, prompt_file, out)
            + [
                "train.algo=dpo",
                "model.lora_r=4",
                "dpo.n_pairs=4",
                "dpo.candidates=2",
                "train.steps=1",
                "dpo.kl_eval_prompts=2",
                "eval.n_prompts=0",
                "eval.every=0",
                "reward.scorer=tests.conftest:length_judge",
            ]
        )
        == 0
    )
    row = metric_rows(out)[0]
    assert "dpo/loss" in row and row["objective/kl_exact"] > 0  # the adapter moved in its first update


# ---- (e) LoRA dropout: never used, and never claimed (issue 50) ------------------------------
def _peft_with_dropout(tokenizer, dropout: float):
    from peft import LoraConfig, get_peft_model

    lm = make_tiny_llama(
        len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"])
    return get_peft_model(lm, config)


def test_a_peft_model_with_lora_dropout_is_refused_by_name(tiny_tokenizer, prompt_file, tmp_path):
    """A PeftModel built with lora_dropout=0.1 trained with dropout 0 (tether turns every dropout
    off) while the adapter_config.json it saved said 0.1. It is refused before anything is written;
    built with 0, it trains exactly (step-0 KL 0, first ratio 1) and its saved config says 0."""
    from tether import train

    config = _lora_config(None, prompt_file, tmp_path / "run", "train.save_model=true", "train.steps=1")
    with pytest.raises(
        ValueError, match=r"lora_dropout > 0 \(\{'default': 0\.1\}\).*LoraConfig\(lora_dropout=0\.0\)"
    ):
        train(config, model=_peft_with_dropout(tiny_tokenizer, 0.1), tokenizer=tiny_tokenizer)
    assert not (tmp_path / "run").exists()
    out = train(config, model=_peft_with_dropout(tiny_tokenizer, 0.0), tokenizer=tiny_tokenizer)
    row = metric_rows(out)[0]
    assert row["objective/kl_exact"] == 0.0 and row["policy/ratio_max_dev_first"] == 0.0
    assert json.loads((out / "policy" / "adapter_config.json").read_text())["lora_dropout"] == 0.0


def test_a_peft_model_with_modules_to_save_is_refused_by_name(tiny_tokenizer, prompt_file, tmp_path):
    """TRL's LoraConfig(modules_to_save=["lm_head"]): peft's trainable full copy of lm_head beside
    the adapter was refused as 'the reference model has trainable parameters', naming neither
    the option nor the fix. Now named, before anything is written."""
    from peft import LoraConfig, get_peft_model

    from tether import train

    lm = make_tiny_llama(len(tiny_tokenizer), eos_token_id=tiny_tokenizer.eos_token_id)
    peft = get_peft_model(
        lm, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], lora_dropout=0.0)
    )
    config = _lora_config(None, prompt_file, tmp_path / "run", "train.steps=1")
    with pytest.raises(
        ValueError, match=r"modules_to_save \(\{'default': \['lm_head'\]\}\).*Drop modules_to_save"
    ):
        train(config, model=peft, tokenizer=tiny_tokenizer)
    assert not (tmp_path / "run").exists()


def test_an_adapter_trained_with_dropout_trains_on_without_it_and_says_so(
    tiny_model_dir, tiny_tokenizer, prompt_file, tmp_path, caplog
):
    """model.adapter=FOLDER whose adapter_config.json says lora_dropout=0.1: trained on with dropout
    0, said at the start, and the saved policy's adapter_config.json says 0.0, what was used."""
    from peft import LoraConfig, get_peft_model

    folder = tmp_path / "adapter"
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    get_peft_model(load_causal_lm(tiny_model_dir), config).save_pretrained(folder)
    out = tmp_path / "run"
    FAST = ["train.steps=1", "eval.n_prompts=0", "eval.every=0"]
    with caplog.at_level("WARNING", logger="tether.models.lora"):
        assert main(_tiny_args(tiny_model_dir, prompt_file, out) + [f"model.adapter={folder}", *FAST]) == 0
    assert f"model.adapter={folder} was trained with lora_dropout=0.1" in caplog.text
    row = metric_rows(out)[0]
    assert row["objective/kl_exact"] == 0.0 and row["policy/ratio_max_dev_first"] == 0.0
    assert json.loads((out / "policy" / "adapter_config.json").read_text())["lora_dropout"] == 0.0
