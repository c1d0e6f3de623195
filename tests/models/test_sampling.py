"""Sampling guards found by trying to break tether: generation config, EOS, chat templates, end ids."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CHAT


def test_model_generation_config_does_not_change_sampling(tiny_tokenizer, tiny_lm):
    from tether.models.sampling import generate

    tiny_lm.generation_config.suppress_tokens = list(range(10, len(tiny_tokenizer)))
    tiny_lm.generation_config.top_k = 5
    torch.manual_seed(0)
    ro = generate(tiny_lm, tiny_tokenizer, ["the movie was"] * 8, 8, 1.0)
    assert (ro.response_ids >= 10).any()  # plain softmax sampling, not the folder's settings


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


def test_compile_repays_hand_worked():
    from tether.models.sampling import COMPILE_COST_S, compile_repays, compile_saving

    assert COMPILE_COST_S == 40.0
    assert [compile_saving(r) for r in (1, 2, 8, 9, 64)] == [0.20, 0.09, 0.09, 0.02, 0.02]
    assert not compile_repays(2.0, 200, rows=8)  # 200 steps x 2 s x 0.09 = 36 s saved < 40 s
    assert compile_repays(2.0, 250, rows=8)  # 250 x 2 x 0.09 = 45 s > 40 s
    assert not compile_repays(2.0, 250, rows=32)  # 250 x 2 x 0.02 = 10 s
    assert compile_repays(2.0, 101, rows=1)  # 101 x 2 x 0.20 = 40.4 s > 40 s
    assert not compile_repays(1e6, 0, rows=1)  # no step left: nothing to repay


def test_compiled_decoding_samples_what_eager_decoding_samples(tiny_tokenizer, tiny_lm):
    """rollout.compile: the same tokens as eager decoding, the sampler's log-probs equal up to
    float32 rounding, the trained weights read at every call, and one graph for every prompt length."""
    import torch._dynamo.utils as dynamo_utils

    from tether.models.sampling import can_compile, compiled_mismatch, generate

    if why := can_compile("cpu"):
        pytest.skip(why)
    prompts = ["the movie was", "a film with great acting and a boring script", "the", "music"]
    seeds = range(100, 104)

    def both():
        eager = generate(tiny_lm, tiny_tokenizer, prompts, 6, 1.0, max_prompt_tokens=48, seeds=seeds)
        fast = generate(
            tiny_lm, tiny_tokenizer, prompts, 6, 1.0, max_prompt_tokens=48, seeds=seeds, compiled=True
        )
        if why := compiled_mismatch(eager, fast):  # seen under forced AVX2 kernels at some lengths
            pytest.xfail(f"the compiled decode differs here ({why}); the trainer refuses it (test_cli)")
        assert torch.equal(fast.response_ids, eager.response_ids)
        assert torch.equal(fast.response_mask, eager.response_mask)
        # log-probs of O(1) logits summed over <= 64 terms per product, reassociated by the
        # compiler: a few hundred float32 ulps (1.2e-7 each) at most, far under 1e-4 nats
        assert (fast.sampler_logprobs - eager.sampler_logprobs)[eager.response_mask].abs().max() < 1e-4
        return eager

    start = dynamo_utils.counters["stats"]["unique_graphs"]
    before = both()
    assert dynamo_utils.counters["stats"]["unique_graphs"] > start  # compiled, not silently eager
    with torch.no_grad():  # an optimizer step in place: the compiled graph must read the new weights
        for p in tiny_lm.parameters():
            p.add_(0.5 * torch.randn_like(p))
    after = both()
    assert not torch.equal(before.response_ids, after.response_ids)  # the weights did change the samples
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    prompts = [p + " and more words" for p in prompts]  # longer prompts, same cache length
    fast = generate(
        tiny_lm, tiny_tokenizer, prompts, 6, 1.0, max_prompt_tokens=48, seeds=seeds, compiled=True
    )
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    eager = generate(tiny_lm, tiny_tokenizer, prompts, 6, 1.0, max_prompt_tokens=48, seeds=seeds)
    assert torch.equal(fast.response_ids, eager.response_ids)


def test_compiled_decoding_is_refused_off_avx512(monkeypatch):
    """Under forced AVX2 kernels inductor's compiled decode gave NaN logits and SIGSEGV: a CPU
    whose inductor ISA is not AVX-512 gets a reason (rollout.compile=true stops, auto stays eager)."""
    import shutil

    import tether.models.sampling as sampling

    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler: refused for that reason first")
    for isa, refused in (("avx2", True), ("", True), ("avx512 avx512_vnni amx_tile", False)):
        monkeypatch.setattr(sampling, "compile_vector_isa", lambda isa=isa: isa)
        why = sampling.can_compile("cpu")
        assert (why is not None) == refused and (not refused or "AVX-512 CPUs only" in why)
