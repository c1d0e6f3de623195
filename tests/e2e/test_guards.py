"""Guards found by trying to break tether: each test reproduces a way it once went wrong."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_cli_args as _tiny_args
from tether.cli import main
from tether.core.leash import KLLeash
from tether.core.masked import masked_mean
from tether.run.config import ConfigError, dump_config, load_config


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


def test_model_generation_config_does_not_change_sampling(tiny_tokenizer, tiny_lm):
    from tether.models.sampling import generate

    tiny_lm.generation_config.suppress_tokens = list(range(10, len(tiny_tokenizer)))
    tiny_lm.generation_config.top_k = 5
    torch.manual_seed(0)
    ro = generate(tiny_lm, tiny_tokenizer, ["the movie was"] * 8, 8, 1.0)
    assert (ro.response_ids >= 10).any()  # plain softmax sampling, not the folder's settings


def test_reference_forwards_are_counted(tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "c"
    assert main(_tiny_args(tiny_model_dir, prompt_file, out)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counts = [r["kl/reference_forwards"] for r in rows]
    assert counts[0] > 0 and counts == sorted(counts) and counts[-1] > counts[0]


def test_eos_fraction_counts_responses_that_ended(tiny_tokenizer, tiny_lm):
    from tether.models.sampling import generate

    eos = tiny_tokenizer.eos_token_id
    bias = torch.zeros(len(tiny_tokenizer))
    bias[eos] = 6.0
    tiny_lm.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    torch.manual_seed(1)
    ro = generate(tiny_lm, tiny_tokenizer, ["the movie was"] * 8, 6, 1.0)
    want = torch.tensor([bool((ids[m] == eos).any()) for ids, m in zip(ro.response_ids, ro.response_mask)])
    assert torch.equal(ro.ended, want) and ro.ended.any()


def test_scorer_that_raises_names_the_step(tiny_model_dir, prompt_file, tmp_path, capsys):
    args = _tiny_args(tiny_model_dir, prompt_file, tmp_path / "s") + [
        "reward.scorer=tests.conftest:broken_scorer",
        "eval.n_prompts=0",
        "eval.every=0",  # else the reference's periodic evaluation meets the scorer first
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "step 0" in err and "scorer failed" in err and "Traceback" not in err


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "3\n"])
def test_yaml_that_is_not_a_mapping(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p, ["kl.kl_coef=0.1"])


def test_text_fields_are_taken_verbatim():
    c = load_config(None, ["model.name=007", "data.prompts=a: b.txt", "train.output_dir=null"])
    assert c.model.name == "007" and c.data.prompts == "a: b.txt" and c.train.output_dir is None


def test_saved_config_reloads_with_another_trainer(tmp_path):
    path = tmp_path / "c.yaml"
    dump_config(load_config(None, []), path)  # a PPO run's config.yaml
    c = load_config(path, ["train.algo=grpo"])
    assert c.rollout.group_size == 4 and c.kl.kl_in_loss and not c.kl.kl_in_reward


def test_kl_in_the_loss_keeps_masked_nan_out_of_gradients():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, float("nan")]])
    mask = torch.tensor([[True, False]])
    for est in ("k2", "k3+", "k3_is"):
        lp.grad = None
        KLLeash(False, True, est).loss(lp, ref, 0.1, mask, old_logprobs=lp.detach()).backward()
        assert torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0, est


def test_broadcast_mask_is_refused():
    with pytest.raises(ValueError, match="shape"):
        masked_mean(torch.ones(2, 3), torch.ones(3))


def test_non_finite_config_values_are_refused():
    for o in ("kl.kl_coef=inf", "optim.lr=nan", "rollout.temperature=.inf"):
        with pytest.raises(ConfigError, match="finite"):
            load_config(None, [o])


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


CHAT = (
    "{{ bos_token }}{% for m in messages %}[user] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_chat_template_prompts_carry_exactly_one_bos(tiny_tokenizer):
    import copy

    from tokenizers.processors import TemplateProcessing

    from tether.models.sampling import prompt_texts, tokenize_prompts, use_chat_template

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"bos_token": "<bos>"})
    with pytest.raises(
        ValueError, match="data.chat_template=true: the tokenizer of model.name has no chat template"
    ):
        use_chat_template(tok)
    tok.chat_template = CHAT
    use_chat_template(tok)
    assert prompt_texts(tok, ["the movie was"]) == ["<bos>[user] the movie was\n[assistant] "]

    def bos_count():
        ids, mask = tokenize_prompts(tok, ["the movie was", "a film"], 64)
        return [int((row[m] == tok.bos_token_id).sum()) for row, m in zip(ids, mask.bool())], ids, mask

    counts, _, _ = bos_count()  # the tokenizer adds no BOS: the template's stays
    assert counts == [1, 1]
    # a tokenizer that prepends BOS itself (Llama 3 style): the template's copy is dropped
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)]
    )
    counts, ids, mask = bos_count()
    assert counts == [1, 1] and all(int(row[m][0]) == tok.bos_token_id for row, m in zip(ids, mask.bool()))


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


def test_any_end_id_ends_a_response():
    """End ids {0, 7}: tokens [5, 6, 7, 3, 0] count up to and including the 7, the first end
    token; an EOS-only mask counts all five, up to and including the 0, and sampling would go on
    past the end of the turn (trl PR #7039)."""
    from tether.core.logprobs import response_mask_from_tokens

    tokens = torch.tensor([[5, 6, 7, 3, 0], [5, 6, 3, 0, 7], [1, 2, 3, 4, 5]])
    assert response_mask_from_tokens(tokens, [0, 7]).int().tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],  # no end token: cut at the length cap, all counted
    ]
    assert response_mask_from_tokens(tokens[:1], 0).int().tolist() == [[1, 1, 1, 1, 1]]


def test_generation_stops_at_an_end_of_turn_id_of_the_generation_config(tiny_tokenizer, tiny_lm):
    """The model's generation_config lists an end-of-turn id beside the tokenizer's EOS: sampling
    stops there and the mask ends there. The id is the token each row drew first with these seeds,
    so with it every response is that one token, and it counts as ended."""
    from tether.models.sampling import end_token_ids, generate, sample_seeds

    prompts = ["the movie was", "a terrible boring film", "i loved"]
    seeds = sample_seeds(0, 0, range(3))
    plain = generate(tiny_lm, tiny_tokenizer, prompts, 6, 1.0, seeds=seeds)
    first = plain.response_ids[:, 0].tolist()
    assert plain.response_mask.sum(-1).tolist() != [1, 1, 1]  # the test needs longer responses
    eos = tiny_tokenizer.eos_token_id
    tiny_lm.generation_config.eos_token_id = [eos, *first]
    assert end_token_ids(tiny_tokenizer, tiny_lm) == list(dict.fromkeys([eos, *first]))
    turn = generate(tiny_lm, tiny_tokenizer, prompts, 6, 1.0, seeds=seeds)
    assert turn.response_mask.sum(-1).tolist() == [1, 1, 1]
    assert turn.ended.tolist() == [True, True, True] and turn.responses == ["", "", ""]
