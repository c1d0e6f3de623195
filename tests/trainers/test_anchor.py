"""TextAnchor's term on a tiny model: value and gradient against the float64 definition."""

import copy

import pytest
import torch

from tether.models.policy import PolicyWithValue
from tether.trainers.anchor import AnchorSettings, TextAnchor, text_batch, tokenize_texts

TEXTS = [
    "the rain fell on the quiet town all night",
    "a short one",
    "markets rose as the news came in from abroad",
    "x",  # one token or two: left out when under 2 tokens
    "the council met to discuss the new library and its budget",
    "she wrote the letter by hand",
]


def _models(tiny_lm):
    reference = copy.deepcopy(tiny_lm)
    policy = PolicyWithValue(tiny_lm)
    with torch.no_grad():  # move the policy off the reference
        g = torch.Generator().manual_seed(3)
        for p in policy.lm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return policy, reference


def _definition(policy, reference, batch, *, kind, coef):
    # the float64 definition, every position, by autograd: coef * token mean of
    # sum_v q log(q / p) (forward_kl) or -log p(target) (ptx)
    lm, ref = copy.deepcopy(policy.lm).double(), copy.deepcopy(reference).double()
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    lp = torch.log_softmax(
        lm(batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos).logits, -1
    )
    with torch.no_grad():
        lq = torch.log_softmax(
            ref(batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos).logits, -1
        )
    per = (
        (lq.exp() * (lq - lp)).sum(-1)
        if kind == "forward_kl"
        else -lp.gather(-1, batch.targets[..., None])[..., 0]
    )
    loss = coef * per[batch.mask].mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in lm.named_parameters()}


@pytest.mark.parametrize("kind", ["forward_kl", "ptx"])
def test_the_terms_value_and_gradient_equal_the_float64_definition(tiny_lm, tiny_tokenizer, kind):
    policy, reference = _models(tiny_lm)
    settings = AnchorSettings(coef=0.7, kind=kind, batch_size=2, max_tokens=8, chunk_size=5)
    anchor = TextAnchor(
        policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
    )
    rows = tokenize_texts(tiny_tokenizer, TEXTS, 8)
    assert anchor.n_batches == len(rows) // 2
    assert sorted(anchor.rows) == sorted(rows[: 2 * anchor.n_batches])  # the remainder left out
    for k in range(anchor.n_batches + 1):  # around the texts and back to batch 0
        policy.zero_grad(set_to_none=True)
        out, share = anchor.term()
        out.loss.backward()
        batch = text_batch(anchor.rows[(k % anchor.n_batches) * 2 :][:2], anchor.pad_id, "cpu")
        value, grads = _definition(policy, reference, batch, kind=kind, coef=0.7)
        assert share == 1.0
        # float32 against float64: the logits' rounding (~1e-7 relative) through sums over a
        # vocabulary of ~100 and ~10 positions stays under 1e-5 relative; 1e-4 leaves 10x room
        assert out.loss.item() == pytest.approx(value, rel=1e-4)
        for name, p in policy.lm.named_parameters():
            scale = grads[name].abs().max().item()
            assert torch.allclose(p.grad.double(), grads[name], atol=1e-4 * scale + 1e-9), name
    assert anchor.position == anchor.n_batches + 1
    assert len(anchor.ref_hidden) == anchor.n_batches  # the reference's trunk once per batch


def test_at_the_reference_the_forward_kl_term_is_exactly_zero(tiny_lm, tiny_tokenizer):
    # the policy's and the reference's logits come from the same trunk and head slices: bit for bit
    policy, reference = PolicyWithValue(tiny_lm), copy.deepcopy(tiny_lm)
    settings = AnchorSettings(coef=1.0, kind="forward_kl", batch_size=3, max_tokens=12)
    anchor = TextAnchor(
        policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
    )
    out, _ = anchor.term()
    assert out.stats["anchor/forward_kl"].item() == 0.0 and out.loss.item() == 0.0
    assert out.stats["anchor/nll"].item() > 0


def test_too_few_texts_name_the_batch_size(tiny_lm, tiny_tokenizer):
    policy, reference = PolicyWithValue(tiny_lm), copy.deepcopy(tiny_lm)
    settings = AnchorSettings(coef=1.0, kind="forward_kl", batch_size=8, max_tokens=12)
    with pytest.raises(ValueError, match="anchor.batch_size=8"):
        TextAnchor(
            policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
        )


def test_past_its_memory_cap_the_reference_runs_again_with_the_same_numbers(
    tiny_lm, tiny_tokenizer, monkeypatch
):
    # REF_HIDDEN_BYTES = 0: nothing kept, each batch's reference trunk runs each time; the terms
    # equal those of an anchor that keeps them
    import tether.trainers.anchor as anchor_module

    policy, reference = _models(tiny_lm)
    settings = AnchorSettings(coef=1.0, kind="forward_kl", batch_size=2, max_tokens=8)
    kept = TextAnchor(
        policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
    )
    expected = [kept.term()[0].loss.item() for _ in range(3)]
    monkeypatch.setattr(anchor_module, "REF_HIDDEN_BYTES", 0)
    capped = TextAnchor(
        policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
    )
    assert [capped.term()[0].loss.item() for _ in range(3)] == expected
    assert capped.ref_hidden == {} and len(kept.ref_hidden) == 2


def test_max_tokens_past_the_models_positions_is_cut_there(tiny_lm, tiny_tokenizer, caplog):
    # the tiny Llama has 128 positions: a 400-token text is cut at 128, not fed past the model's
    # context (GPT-2 raised an IndexError there)
    policy, reference = PolicyWithValue(tiny_lm), copy.deepcopy(tiny_lm)
    long_text = " ".join(["word"] * 400)
    settings = AnchorSettings(coef=1.0, kind="forward_kl", batch_size=1, max_tokens=100000)
    anchor = TextAnchor(
        policy=policy, reference=reference, texts=[long_text], tokenizer=tiny_tokenizer, settings=settings
    )
    assert anchor.max_tokens == 128 and max(len(r) for r in anchor.rows) == 128
    assert "anchor.max_tokens=100000 is more than the model's 128 positions" in caplog.text
    out, _ = anchor.term()
    assert torch.isfinite(out.loss)


def test_texts_of_like_length_share_a_batch_in_a_fixed_shuffled_order(tiny_lm, tiny_tokenizer):
    policy, reference = _models(tiny_lm)
    texts = [" ".join(["word"] * n) for n in (9, 2, 7, 3, 8, 1, 6, 4, 5, 10)]
    settings = AnchorSettings(coef=1.0, kind="forward_kl", batch_size=2, max_tokens=16)
    a = TextAnchor(
        policy=policy, reference=reference, texts=texts, tokenizer=tiny_tokenizer, settings=settings
    )
    b = TextAnchor(
        policy=policy, reference=reference, texts=texts, tokenizer=tiny_tokenizer, settings=settings
    )
    assert a.rows == b.rows  # the same batches, in the same order, every run
    lengths = [[len(r) for r in a.rows[k * 2 : k * 2 + 2]] for k in range(a.n_batches)]
    # sorted by length and cut in twos: the batches' lengths do not overlap
    spans = sorted((min(x), max(x)) for x in lengths)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))
    assert lengths != sorted(lengths)  # shuffled: not the shortest batch first and up
    # the head ran on the text's positions only: the term's count of positions is the batch's
    batch = a.batch(0)
    assert a.reference_logprobs(0, batch).shape[:2] == (1, int(batch.mask.sum()))


def test_under_a_budget_the_weight_reads_the_batch_it_weighs(tiny_lm, tiny_tokenizer):
    # anchor.budget: each term's weight is the budget controller's after it read that batch's
    # forward KL over the budget; the loss and its gradient are that weight times the definition's
    # unweighted term (coef 1), so the weight acts on the very update whose KL it read
    from tether.core.controllers import BudgetKLController

    policy, reference = _models(tiny_lm)
    # the policy's forward KL on these texts is ~1e-2 nats per token: a budget under it raises the
    # weight, one over it lowers it; 3 terms under each
    for budget in (1e-3, 1.0):
        settings = AnchorSettings(
            coef=0.2,
            kind="forward_kl",
            batch_size=2,
            max_tokens=8,
            budget=budget,
            budget_eta=0.5,
            budget_kp=2.0,
        )
        anchor = TextAnchor(
            policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
        )
        twin = BudgetKLController(kl_coef=0.2, budget=1.0, eta=0.5, kp=2.0)
        weights = []
        for k in range(3):
            policy.zero_grad(set_to_none=True)
            out, _ = anchor.term()
            out.loss.backward()
            batch = text_batch(anchor.rows[(k % anchor.n_batches) * 2 :][:2], anchor.pad_id, "cpu")
            value, grads = _definition(policy, reference, batch, kind="forward_kl", coef=1.0)
            weight = twin.update(out.stats["anchor/forward_kl"].item() / budget, n_steps=1)
            assert out.stats["anchor/coef"] == weight == anchor.coef
            weights.append(weight)
            # the tolerances of the fixed weight's test above, times the weight
            assert out.loss.item() == pytest.approx(weight * value, rel=1e-4, abs=1e-12)
            for name, p in policy.lm.named_parameters():
                scale = weight * grads[name].abs().max().item()
                assert torch.allclose(p.grad.double(), weight * grads[name], atol=1e-4 * scale + 1e-12), name
        if budget < 1e-2:
            assert weights[0] > 0.2 and weights == sorted(weights)  # over budget: the weight rises
        else:
            assert weights == [0.0, 0.0, 0.0]  # far under: max(0, 0.2 - 0.5 - 2.0 ...) = 0
        assert anchor.state_dict()["controller"]["kl_coef"] == weights[-1]


def test_under_a_budget_every_process_takes_the_weight_of_the_whole_batch(
    tiny_lm, tiny_tokenizer, monkeypatch
):
    # several processes: the controller reads the token mean of the forward KL over every process
    # (this process's value times its share, summed by D.all_reduce_sum), never its own rows'
    # alone. Here the "other process" adds 0.03 nats per token, at a share of 1/2 here
    from tether.trainers import anchor as anchor_module

    policy, reference = _models(tiny_lm)
    settings = AnchorSettings(
        coef=0.0, kind="forward_kl", batch_size=2, max_tokens=8, budget=0.01, budget_eta=1.0, budget_kp=0.0
    )
    anchor = TextAnchor(
        policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
    )
    sent = []
    monkeypatch.setattr(anchor_module.D, "token_shares", lambda masks: [torch.tensor(0.5)])
    monkeypatch.setattr(
        anchor_module.D, "all_reduce_sum", lambda x: sent.append(x.item()) or x.double() + 0.5 * 0.03
    )
    out, share = anchor.term()
    mine = out.stats["anchor/forward_kl"].item()
    assert sent == [pytest.approx(0.5 * mine, rel=1e-15)]  # float32 value x share, in float64
    whole = 0.5 * mine + 0.5 * 0.03
    # kp 0: the weight is the dual, max(0, 0 + 1.0 * (whole / 0.01 - 1))
    assert out.stats["anchor/coef"] == max(0.0, sent[0] / 0.01 + 0.5 * 0.03 / 0.01 - 1.0)
    assert out.stats["anchor/coef"] == pytest.approx(whole / 0.01 - 1.0, rel=1e-12)
    assert out.stats["anchor/coef"] > 0.4  # mine alone (~1e-2 x 1/2) would give ~0


def test_under_a_budget_a_forward_kl_that_is_not_finite_is_refused_by_name(
    tiny_lm, tiny_tokenizer, monkeypatch
):
    # a NaN forward KL (overflowed logits) would make every process's weight NaN: refused,
    # naming the anchor's statistic, before any backward
    from tether.trainers import anchor as anchor_module

    policy, reference = _models(tiny_lm)
    settings = AnchorSettings(coef=0.0, kind="forward_kl", batch_size=2, max_tokens=8, budget=0.01)
    anchor = TextAnchor(
        policy=policy, reference=reference, texts=TEXTS, tokenizer=tiny_tokenizer, settings=settings
    )
    monkeypatch.setattr(anchor_module.D, "all_reduce_sum", lambda x: x.double() * float("nan"))
    with pytest.raises(FloatingPointError, match="anchor/forward_kl is nan"):
        anchor.term()
    assert anchor.controller.kl_coef == 0.0 and anchor.controller.dual == 0.0  # not moved
