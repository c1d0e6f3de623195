"""The frozen lower blocks' replay (tether.models.frozen): bit for bit, and only where it is exact."""

import copy

import torch

from tests.conftest import make_tiny_llama
from tether.models.frozen import FrozenBlocks, frozen_lower_blocks
from tether.models.head import position_ids_from_mask, tail_hidden
from tether.models.policy import PolicyWithValue


def _four_blocks(vocab: int = 50, seed: int = 0):
    lm = make_tiny_llama(vocab, seed=seed, num_hidden_layers=4, tie_word_embeddings=False)
    for p in lm.parameters():
        p.requires_grad_(False)
    for p in list(lm.model.layers[2].parameters()) + list(lm.model.layers[3].parameters()):
        p.requires_grad_(True)
    return lm


def _batch(seed: int = 1, B: int = 3, L: int = 7, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded row
    return ids, mask, position_ids_from_mask(mask)


def _counting(module):  # calls of a block's submodule: a replayed block never runs it
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_counts_the_frozen_lower_blocks():
    lm = _four_blocks()
    assert frozen_lower_blocks(lm) == 2
    lm.model.embed_tokens.weight.requires_grad_(True)  # a trainable embedding changes every block's input
    assert frozen_lower_blocks(lm) == 0
    lm.model.embed_tokens.weight.requires_grad_(False)
    lm.model.layers[0].mlp.up_proj.weight.requires_grad_(True)  # the first block trains: none frozen below it
    assert frozen_lower_blocks(lm) == 0
    for p in lm.parameters():  # all frozen: nothing trains in the trunk to replay into
        p.requires_grad_(False)
    assert frozen_lower_blocks(lm) == 0
    trainable_norm = _four_blocks()
    trainable_norm.model.norm.weight.requires_grad_(True)  # runs after the blocks: still 2
    assert frozen_lower_blocks(trainable_norm) == 2
    # Gemma 3n's and 4's blocks share keys and values across blocks: a replay would leave them unset
    trainable_norm.config.num_kv_shared_layers = 2
    assert frozen_lower_blocks(trainable_norm) == 0


def test_a_replay_equals_running_the_blocks_bit_for_bit_and_skips_them():
    lm = _four_blocks()
    frozen = FrozenBlocks(lm, 2)
    ids, mask, pos = _batch()
    plain = tail_hidden(lm, ids, mask, pos, n_keep=4)
    first, third = _counting(lm.model.layers[0].mlp), _counting(lm.model.layers[2].mlp)
    with frozen.session():
        recorded = tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen)
        with torch.enable_grad():  # the update's forward: grad through the trainable blocks
            replayed = tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen)
        assert replayed.requires_grad
        replayed.sum().backward()
    assert torch.equal(recorded, plain) and torch.equal(replayed.detach(), plain)
    assert len(first) == 1 and len(third) == 2  # the first block ran once, the third twice
    assert frozen.replayed == 1
    assert lm.model.layers[2].mlp.up_proj.weight.grad is not None
    assert "forward" not in vars(lm.model.layers[0])  # the blocks are themselves again


def test_a_trainable_block_updated_between_forwards_is_run_again():
    # the recording holds the frozen blocks' output only: the trainable blocks run on it each time,
    # so a changed trainable weight shows in the replayed forward as in a full one
    lm = _four_blocks()
    frozen = FrozenBlocks(lm, 2)
    ids, mask, pos = _batch()
    with frozen.session():
        tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen)
        with torch.no_grad():
            lm.model.layers[3].mlp.down_proj.weight.mul_(1.5)
        replayed = tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen)
    assert frozen.replayed == 1
    assert torch.equal(replayed, tail_hidden(lm, ids, mask, pos, n_keep=4))


def test_it_replays_only_equal_inputs_unchanged_frozen_weights_inside_a_session():
    lm = _four_blocks()
    frozen = FrozenBlocks(lm, 2)
    ids, mask, pos = _batch()
    first = _counting(lm.model.layers[0].mlp)
    tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen)  # outside a session: nothing kept
    assert frozen.recordings == []
    with frozen.session():
        tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen)
        other = ids.clone()
        other[1, -1] = (other[1, -1] % 49) + 1  # one token differs: run, and recorded too
        assert torch.equal(
            tail_hidden(lm, other, mask, pos, n_keep=4, replay=frozen),
            tail_hidden(lm, other, mask, pos, n_keep=4),
        )
        shorter = tail_hidden(lm, ids[:2], mask[:2], pos[:2], n_keep=4, replay=frozen)  # other rows
        assert torch.equal(shorter, tail_hidden(lm, ids[:2], mask[:2], pos[:2], n_keep=4))
        runs = len(first)
        with torch.no_grad():  # a frozen weight changed in place (a checkpoint loaded): drop all
            lm.model.layers[1].mlp.up_proj.weight.mul_(2.0)
        assert torch.equal(
            tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen),
            tail_hidden(lm, ids, mask, pos, n_keep=4),
        )
        assert len(first) == runs + 2  # it ran (no stale replay), beside the plain forward
    assert frozen.recordings == []  # dropped at the session's end
    assert frozen.replayed == 0


def test_a_policy_scores_the_same_with_and_without_the_replay():
    # PolicyWithValue with replay_frozen: the same logits and values bit for bit, inside a
    # session and out; a shared-prefix policy gives up its prefix sharing for scoring (not generation)
    lm = _four_blocks()
    plain = PolicyWithValue(copy.deepcopy(lm), share_prefix=True)
    replaying = PolicyWithValue(lm, share_prefix=True, replay_frozen=True)
    replaying.value_head.load_state_dict(plain.value_head.state_dict())
    assert replaying.frozen is not None and plain.frozen is None
    assert replaying.share_prefix and not replaying.scoring_share_prefix and plain.scoring_share_prefix
    ids, mask, pos = _batch(L=24)
    whole = PolicyWithValue(copy.deepcopy(lm))  # whole sequences, no replay
    whole.value_head.load_state_dict(plain.value_head.state_dict())
    expected = whole(ids, mask, pos, n_keep=5)
    with replaying.replaying():
        for _ in range(3):
            logits, values = replaying(ids, mask, pos, n_keep=5)
            assert torch.equal(logits, expected[0]) and torch.equal(values, expected[1])
    assert replaying.frozen.replayed == 2
    assert PolicyWithValue(_four_blocks(), replay_frozen=False).frozen is None


def test_a_kept_recording_outlives_its_session_until_a_frozen_weight_changes():
    # the text anchor's batches are fixed and come back every few steps: a `keep` key holds their
    # recording past the session (and out of one), checked against the inputs each time
    lm = _four_blocks()
    frozen = FrozenBlocks(lm, 2)
    ids, mask, pos = _batch()
    first = _counting(lm.model.layers[0].mlp)
    plain = tail_hidden(lm, ids, mask, pos, n_keep=4)
    with frozen.session():
        tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen, replay_key=("anchor", 0))
    assert ("anchor", 0) in frozen.kept and frozen.recordings == []
    runs = len(first)
    again = tail_hidden(lm, ids, mask, pos, n_keep=4, replay=frozen, replay_key=("anchor", 0))  # no session
    assert torch.equal(again, plain) and len(first) == runs and frozen.replayed == 1
    other = ids.flip(0)  # other inputs under the same key: run and recorded anew, not replayed
    assert torch.equal(
        tail_hidden(lm, other, mask.flip(0), pos.flip(0), n_keep=4, replay=frozen, replay_key=("anchor", 0)),
        tail_hidden(lm, other, mask.flip(0), pos.flip(0), n_keep=4),
    )
    assert frozen.replayed == 1
    with torch.no_grad():
        lm.model.layers[0].mlp.up_proj.weight.mul_(0.5)  # a frozen weight changed: nothing kept holds
    runs = len(first)
    changed = tail_hidden(
        lm, other, mask.flip(0), pos.flip(0), n_keep=4, replay=frozen, replay_key=("anchor", 0)
    )
    assert len(first) == runs + 1 and frozen.replayed == 1
    assert torch.equal(changed, tail_hidden(lm, other, mask.flip(0), pos.flip(0), n_keep=4))
