"""Model-level guards on a tiny random Llama: dropout, frozen reference, padding, temperature."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch

from tests.conftest import make_tiny_llama
from tether.core.logprobs import response_mask_from_tokens
from tether.models.head import position_ids_from_mask
from tether.models.loading import disable_dropout
from tether.models.policy import PolicyWithValue
from tether.models.reference import check_reference, fingerprint, freeze, make_reference
from tether.models.sampling import Rollout, generate, tokenize_prompts
from tether.models.scoring import rollout_logprobs

PROMPTS = ["the movie was", "a terrible boring film with", "good"]


def _rollout(tok, lm, prompts=PROMPTS, n=6, temperature=1.0, seed=0) -> Rollout:
    torch.manual_seed(seed)
    return generate(lm, tok, prompts, max_new_tokens=n, temperature=temperature)


def test_dropout_in_config_scores_twice_identically(tiny_tokenizer):
    lm = make_tiny_llama(len(tiny_tokenizer), attention_dropout=0.5, eos_token_id=0, pad_token_id=0)
    ro = _rollout(tiny_tokenizer, lm)
    lm.train()  # even in train mode, dropout must be off once tether prepared the model
    with torch.no_grad():
        a = rollout_logprobs(lm, ro, 1.0).logprobs
        b = rollout_logprobs(lm, ro, 1.0).logprobs
    assert not torch.equal(a, b), "the test model must really drop out before disable_dropout"
    disable_dropout(lm)
    with torch.no_grad():
        a = rollout_logprobs(lm, ro, 1.0).logprobs
        b = rollout_logprobs(lm, ro, 1.0).logprobs
    assert torch.equal(a, b)
    assert lm.config.attention_dropout == 0.0


def test_reference_is_frozen_across_an_optimizer_step(tiny_tokenizer, tiny_lm):
    policy = PolicyWithValue(tiny_lm)
    reference = make_reference(tiny_lm)
    check_reference(policy, reference)
    ro = _rollout(tiny_tokenizer, tiny_lm)
    with torch.no_grad():
        ref_before = rollout_logprobs(reference, ro, 1.0).logprobs.clone()
        pol_before = rollout_logprobs(policy, ro, 1.0).logprobs.clone()
    fp_before = fingerprint(reference)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    out = rollout_logprobs(policy, ro, 1.0, with_values=True)
    (out.logprobs.sum() + out.values.sum()).backward()
    opt.step()
    with torch.no_grad():
        ref_after = rollout_logprobs(reference, ro, 1.0).logprobs
        pol_after = rollout_logprobs(policy, ro, 1.0).logprobs
    assert torch.equal(ref_before, ref_after)  # bit-identical
    assert not torch.equal(pol_before, pol_after)  # while the policy did move
    assert fingerprint(reference) == fp_before
    assert all(not p.requires_grad for p in reference.parameters())


def test_policy_as_reference_is_refused(tiny_lm):
    policy = PolicyWithValue(tiny_lm)
    with pytest.raises(ValueError, match="policy object itself"):
        check_reference(policy, policy.lm)
    with pytest.raises(ValueError, match="policy object itself"):
        check_reference(policy, policy)


def test_reference_sharing_storage_is_refused(tiny_lm):
    policy = PolicyWithValue(tiny_lm)
    ref = freeze(copy.deepcopy(tiny_lm))
    ref.model.layers[0].mlp.up_proj.weight.data = tiny_lm.model.layers[0].mlp.up_proj.weight.data
    with pytest.raises(ValueError, match="share storage"):
        check_reference(policy, ref)
    good = make_reference(tiny_lm)
    trainable = {p.data_ptr() for p in policy.parameters() if p.requires_grad}
    assert not any(p.data_ptr() in trainable for p in good.parameters())


def test_unfrozen_reference_is_refused(tiny_lm):
    with pytest.raises(ValueError, match="trainable"):
        check_reference(PolicyWithValue(tiny_lm), copy.deepcopy(tiny_lm))


@pytest.mark.numerics
def test_completion_scores_the_same_padded_or_alone(tiny_tokenizer, tiny_lm):
    ro = _rollout(tiny_tokenizer, tiny_lm, n=8)
    assert ro.prompt_mask.sum(-1).unique().numel() > 1, "prompts must need different padding"
    with torch.no_grad():
        batch = rollout_logprobs(tiny_lm, ro, 0.7).logprobs
        for i, p in enumerate(PROMPTS):
            ids, mask = tokenize_prompts(tiny_tokenizer, [p], 64)
            alone = Rollout(
                [p],
                ids,
                prompt_mask=mask,
                response_ids=ro.response_ids[i : i + 1],
                response_mask=ro.response_mask[i : i + 1],
                responses=[""],
            )
            single = rollout_logprobs(tiny_lm, alone, 0.7).logprobs
            m = ro.response_mask[i]
            torch.testing.assert_close(single[0][m], batch[i][m], rtol=0, atol=1e-5)


def test_position_ids_start_at_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.numerics
def test_scoring_uses_the_sampling_temperature(tiny_tokenizer, tiny_lm):
    ro = _rollout(tiny_tokenizer, tiny_lm, temperature=0.7)
    reference = make_reference(tiny_lm)
    with torch.no_grad():
        logits = tiny_lm(
            input_ids=ro.input_ids,
            attention_mask=ro.attention_mask,
            position_ids=position_ids_from_mask(ro.attention_mask),
        ).logits
        R = ro.response_ids.shape[1]
        want = torch.log_softmax(logits[:, -R:] / 0.7, -1).gather(-1, ro.response_ids[..., None])[..., 0]
        untempered = torch.log_softmax(logits[:, -R:], -1).gather(-1, ro.response_ids[..., None])[..., 0]
        for model in (tiny_lm, PolicyWithValue(tiny_lm), reference):
            got = rollout_logprobs(model, ro, 0.7).logprobs
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert not torch.allclose(got, untempered, atol=1e-3)


def test_generate_masks_after_first_eos(tiny_tokenizer, tiny_lm):
    eos = tiny_tokenizer.eos_token_id
    bias = torch.zeros(len(tiny_tokenizer))
    bias[eos] = 4.0  # make EOS likely so that rows end early
    tiny_lm.lm_head.register_forward_hook(lambda module, inputs, out: out + bias)
    ro = _rollout(tiny_tokenizer, tiny_lm, prompts=PROMPTS * 4, n=10, seed=3)
    ended = ro.response_mask.sum(-1) < ro.response_ids.shape[1]
    assert ended.any(), "the test needs rows that stopped at EOS"
    expected = response_mask_from_tokens(ro.response_ids, eos)
    assert torch.equal(ro.response_mask, expected)
    # after the first EOS every slot holds the pad token
    assert torch.all(ro.response_ids[~ro.response_mask] == tiny_tokenizer.pad_token_id)


def test_fingerprint_sees_a_changed_weight(tiny_lm):
    ref = make_reference(tiny_lm)
    fp = fingerprint(ref)
    with torch.no_grad():
        next(ref.parameters()).view(-1)[0] += 1e-3
    assert fingerprint(ref) != fp


# ---- the LM head in slices: no-grad scoring never holds (B, R, V) logits ---------------------
def test_head_row_slices_by_hand():
    from tether.models.head import head_row_slices

    # R = 3, 7 positions per slice: max(1, 7 // 3) = 2 rows -> rows [0:2], [2:4], [4:5]
    assert head_row_slices(5, 3, 7) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    # fewer positions than one row: one row per slice
    assert head_row_slices(3, 3, 2) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert head_row_slices(4, 3, 10**6) == [slice(0, 4)]
    assert head_row_slices(0, 3, 8) == []
    with pytest.raises(ValueError, match="model.head_chunk_size"):
        head_row_slices(4, 3, 0)


@pytest.mark.numerics
@pytest.mark.parametrize("chunk", [1, 7, 10**6])
def test_sliced_scoring_equals_the_full_forward_bit_for_bit(tiny_tokenizer, tiny_lm, monkeypatch, chunk):
    import tether.models.scoring as tr
    from tether.core.kl import exact_kl_from_logits
    from tether.core.logprobs import entropy_from_logits, logprobs_from_logits
    from tether.models.scoring import policy_and_reference_logprobs, response_forward

    reference = make_reference(tiny_lm)
    policy = PolicyWithValue(tiny_lm, head_chunk=chunk)
    prompts = PROMPTS + ["i loved this", "worst movie", "an excellent"]
    ro = _rollout(tiny_tokenizer, tiny_lm, prompts)
    B, R = ro.response_ids.shape

    # step 0 (policy == reference): the KL is exactly 0 on the sliced path
    pol, ref, exact = policy_and_reference_logprobs(policy, reference, ro, 1.0, exact_kl=True)
    assert torch.equal(pol.logprobs, ref.logprobs) and torch.equal(exact, torch.zeros(B, R))

    with torch.no_grad():  # move the policy so that every quantity is non-trivial
        for p in policy.lm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seen = []
    real = tr.head_logits
    monkeypatch.setattr(tr, "head_logits", lambda lm, h: seen.append(h.shape[0]) or real(lm, h))
    pol, ref, exact = policy_and_reference_logprobs(
        policy, reference, ro, 0.7, with_values=True, exact_kl=True
    )
    # the slow path: full (B, R, V) logits of both models, then the same functions
    with torch.no_grad():
        logits, values = response_forward(policy, ro, with_values=True)
        ref_logits, _ = response_forward(reference, ro, head_chunk=chunk)
    assert torch.equal(pol.logprobs, logprobs_from_logits(logits, ro.response_ids, 0.7))
    assert torch.equal(pol.entropy, entropy_from_logits(logits, 0.7))
    assert torch.equal(pol.values, values)
    assert torch.equal(ref.logprobs, logprobs_from_logits(ref_logits, ro.response_ids, 0.7))
    assert torch.equal(exact, exact_kl_from_logits(logits, ref_logits, 0.7))
    assert float(exact.min()) >= 0 and float(exact.max()) > 1e-4
    rows = max(1, chunk // R)  # the head never saw more rows than one slice holds
    assert max(seen) == min(rows, B) and sum(seen) == 2 * B  # each row once per model


@pytest.mark.numerics
def test_shared_prompt_prefix_scores_like_the_full_forward(tiny_tokenizer, tiny_lm, monkeypatch):
    """Prefix sharing: each distinct prompt through the trunk once, numbers as the full forward's."""
    import tether.models.head as tm
    from tether.models.scoring import policy_and_reference_logprobs, rollout_logprobs

    monkeypatch.setattr(tm, "SHARED_PREFIX_MIN_POSITIONS", 1)  # the test's prompts are short
    # groups of 3 rows per prompt; "good" is one token, so its prefix (the prompt without its
    # last token) is all padding
    prompts = [p for p in PROMPTS for _ in range(3)]
    ro = _rollout(tiny_tokenizer, tiny_lm, prompts)
    plain, shared = PolicyWithValue(tiny_lm), PolicyWithValue(tiny_lm, share_prefix=True)
    reference = make_reference(tiny_lm)
    trunk = tiny_lm.model
    batch_rows = []
    hook = trunk.register_forward_pre_hook(
        lambda m, a, kw: batch_rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    with torch.no_grad():
        full = rollout_logprobs(plain, ro, 0.8).logprobs
        assert batch_rows == [9]
        batch_rows.clear()
        lp = rollout_logprobs(shared, ro, 0.8).logprobs
    hook.remove()
    assert batch_rows == [3, 9]  # 3 distinct prefixes once, then the 9 rows' responses
    torch.testing.assert_close(lp, full, rtol=0, atol=1e-5)
    # a row takes the same path whatever the rows beside it, so its numbers agree to rounding: a
    # matrix product of 3 rows instead of 9 may block its sums differently on some CPUs (MKL's
    # conditional-numerical-reproducibility modes do). Each log-prob's last sums run over the
    # hidden size d = 32 (the head) and, folded into logsumexp, a few terms of the log-prob's
    # scale: Higham's (n - 1) eps sum|terms| with n ~ 2 d and sum|terms| ~ max|log-prob|
    idx = torch.tensor([4, 0, 8])
    with torch.no_grad():
        alone = rollout_logprobs(shared, ro.select(idx), 0.8).logprobs
    tol = 2 * tiny_lm.config.hidden_size * torch.finfo(torch.float32).eps * float(lp.abs().max())
    torch.testing.assert_close(alone, lp[idx], rtol=0, atol=tol)
    # the reference is scored on the same path: step-0 KL exactly 0
    pol, ref, exact = policy_and_reference_logprobs(shared, reference, ro, 0.8, exact_kl=True)
    assert torch.equal(pol.logprobs, ref.logprobs) and torch.equal(exact, torch.zeros_like(exact))
    torch.testing.assert_close(pol.logprobs, full, rtol=0, atol=1e-5)
    # gradients reach the weights through the shared keys and values as through the full forward
    grads = []
    for policy in (plain, shared):
        tiny_lm.zero_grad(set_to_none=True)
        (rollout_logprobs(policy, ro, 0.8).logprobs * ro.response_mask).sum().backward()
        grads.append([p.grad.clone() for p in tiny_lm.parameters()])
    for g_plain, g_shared in zip(*grads):
        torch.testing.assert_close(g_shared, g_plain, rtol=1e-4, atol=1e-6)


def test_reference_forwards_count_a_shared_prefix_scoring_once(tiny_tokenizer, tiny_lm, monkeypatch):
    import tether.models.head as tm
    from tether.models.reference import count_reference_forwards
    from tether.models.scoring import rollout_logprobs

    monkeypatch.setattr(tm, "SHARED_PREFIX_MIN_POSITIONS", 1)
    reference = make_reference(tiny_lm)
    counter = [0]
    count_reference_forwards(reference, counter)
    ro = _rollout(tiny_tokenizer, tiny_lm, [p for p in PROMPTS for _ in range(2)])
    with torch.no_grad():
        rollout_logprobs(reference, ro, 1.0, share_prefix=True)
        rollout_logprobs(reference, ro, 1.0)
    assert counter[0] == 2


@pytest.mark.numerics
def test_generation_from_a_shared_prompt_cache_draws_the_same_samples(tiny_tokenizer, tiny_lm, monkeypatch):
    import tether.models.head as tm
    from tether.models.sampling import generate

    monkeypatch.setattr(tm, "SHARED_PREFIX_MIN_POSITIONS", 1)
    prompts = [p for p in PROMPTS for _ in range(3)]  # "good" (one token) has an all-padding prefix
    rows = []
    trunk = tiny_lm.model
    hook = trunk.register_forward_pre_hook(
        lambda m, a, kw: rows.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    plain = generate(tiny_lm, tiny_tokenizer, prompts, 6, 1.0, seeds=range(9))
    P = plain.prompt_ids.shape[1]
    assert rows[0] == (9, P)  # the whole prompt of every row at once
    rows.clear()
    shared = generate(tiny_lm, tiny_tokenizer, prompts, 6, 1.0, seeds=range(9), share_prefix=True)
    hook.remove()
    assert rows[:2] == [(3, P - 1), (9, 1)]  # 3 distinct prompts once, then each row's last prompt token
    assert torch.equal(shared.response_ids, plain.response_ids)
    assert torch.equal(shared.response_mask, plain.response_mask)


def test_short_prompt_prefixes_are_not_shared(tiny_tokenizer, tiny_lm, monkeypatch):
    import tether.models.head as tm
    from tether.models.sampling import generate
    from tether.models.scoring import rollout_logprobs

    prompts = [p for p in PROMPTS for _ in range(2)]
    ro = _rollout(tiny_tokenizer, tiny_lm, prompts)
    P = ro.prompt_ids.shape[1]
    calls = []
    hook = tiny_lm.model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True
    )
    shared = PolicyWithValue(tiny_lm, share_prefix=True)
    for min_positions, trunk_calls in [(P, 1), (P - 1, 2)]:  # the prefix is P - 1 positions
        monkeypatch.setattr(tm, "SHARED_PREFIX_MIN_POSITIONS", min_positions)
        calls.clear()
        with torch.no_grad():
            rollout_logprobs(shared, ro, 1.0)
        assert len(calls) == trunk_calls
        calls.clear()
        generate(tiny_lm, tiny_tokenizer, prompts, 2, 1.0, seeds=range(6), share_prefix=True)
        assert calls[0][1] == (P if trunk_calls == 1 else P - 1)  # whole prompts, or the shared prefix first
    hook.remove()


@pytest.mark.numerics
def test_a_hybrid_model_whose_cache_cannot_be_gathered_runs_the_plain_path(tiny_tokenizer, monkeypatch):
    """LFM2 (convolution + attention layers): its cache has no batch_select_indices; no crash, plain
    numbers."""
    import transformers

    import tether.models.head as tm
    from tether.models.sampling import generate
    from tether.models.scoring import rollout_logprobs

    monkeypatch.setattr(tm, "SHARED_PREFIX_MIN_POSITIONS", 1)
    torch.manual_seed(0)
    lm = transformers.Lfm2ForCausalLM(
        transformers.Lfm2Config(
            vocab_size=len(tiny_tokenizer),
            hidden_size=32,
            intermediate_size=64,
            block_ff_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention"],
            eos_token_id=0,
            pad_token_id=0,
            bos_token_id=None,
        )
    ).eval()
    assert not tm.can_share_prefix(lm) and tm.can_share_prefix(make_tiny_llama(len(tiny_tokenizer)))
    prompts = [p for p in PROMPTS for _ in range(2)]
    plain = generate(lm, tiny_tokenizer, prompts, 4, 1.0, seeds=range(6))
    shared = generate(lm, tiny_tokenizer, prompts, 4, 1.0, seeds=range(6), share_prefix=True)
    assert torch.equal(plain.response_ids, shared.response_ids)
    with torch.no_grad():
        a = rollout_logprobs(PolicyWithValue(lm), plain, 1.0).logprobs
        b = rollout_logprobs(PolicyWithValue(lm, share_prefix=True), plain, 1.0).logprobs
    assert torch.equal(a, b)


def test_gguf_metadata_is_parsed_once_and_each_caller_gets_its_own_copy(tmp_path, monkeypatch):
    """Caching an embedded model reads its GGUF metadata for the config and the tokenizer; within
    ``_one_gguf_reader`` the parse runs once, and a caller that edits its dict does not change
    what the next caller gets."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    from tether.models.loading import _one_gguf_reader

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_token_list(["<s>", "</s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    calls = []
    real = hf_gguf.load_gguf_checkpoint

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counted)
    with _one_gguf_reader():
        first = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)
        first["config"]["num_hidden_layers"] = 99  # a caller edits its copy
        second = hf_gguf.load_gguf_checkpoint(str(path))
    assert len(calls) == 1
    assert second["config"]["num_hidden_layers"] == 1
    assert second["tokenizer"]["tokens"] == ["<s>", "</s>", "a", "b"]
    assert hf_gguf.load_gguf_checkpoint is counted  # restored on exit

    # the reader reads the file into memory, not through np.memmap (its per-index overhead was a
    # third of caching Gemma): the same fields and tensor bytes as a memory-mapped reader
    mapped = gguf.GGUFReader(str(path))
    with _one_gguf_reader():
        read = gguf.GGUFReader(str(path))
    assert isinstance(mapped.data, np.memmap) and not isinstance(read.data, np.memmap)
    assert sys.modules[gguf.GGUFReader.__module__].np is np  # restored; numpy itself never changed
    with _one_gguf_reader(), pytest.raises(FileNotFoundError):
        gguf.GGUFReader(str(tmp_path / "missing.gguf"))
    assert sys.modules[gguf.GGUFReader.__module__].np is np  # restored after a failed read too
    assert np.array_equal(np.asarray(mapped.data), read.data)
    assert list(mapped.fields) == list(read.fields)
    assert [t.name for t in read.tensors] == ["token_embd.weight"]
    assert np.array_equal(mapped.tensors[0].data, read.tensors[0].data)


def test_the_scoring_passes_divergences_equal_the_full_logits(tiny_lm, tiny_tokenizer):
    # policy_and_reference_logprobs' slices (head_chunk 5 positions: several slices) against
    # divergences_from_logits on the whole (B, R, V) logits of a full forward
    import copy

    from tether.core.divergences import divergences_from_logits
    from tether.models.policy import PolicyWithValue
    from tether.models.sampling import Rollout
    from tether.models.scoring import policy_and_reference_logprobs, response_forward

    reference = copy.deepcopy(tiny_lm)
    policy = PolicyWithValue(tiny_lm, head_chunk=5)
    with torch.no_grad():
        for p in policy.lm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    vocab = len(tiny_tokenizer)
    rollout = Rollout(
        prompts=["", "", ""],
        prompt_ids=torch.randint(1, vocab, (3, 4), generator=g),
        prompt_mask=torch.ones(3, 4, dtype=torch.long),
        response_ids=torch.randint(1, vocab, (3, 6), generator=g),
        response_mask=torch.ones(3, 6, dtype=torch.bool),
        responses=["", "", ""],
    )
    _, ref, exact = policy_and_reference_logprobs(
        policy, reference, rollout, 0.8, exact_kl=True, kl_chunk_size=4, divergences_alpha=0.3
    )
    with torch.no_grad():
        z, _ = response_forward(policy, rollout)
        z_ref, _ = response_forward(reference, rollout, head_chunk=5)
    whole = divergences_from_logits(z, z_ref, 0.8, 0.3)
    for got, want in zip(ref.divergences, whole):
        assert torch.equal(got, want)  # the same slices, the same numbers
    _, ref, _ = policy_and_reference_logprobs(policy, reference, rollout, 0.8, exact_kl=True)
    assert ref.divergences is None  # not asked
