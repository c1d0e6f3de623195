"""The update guard by hand (tether.trainers.guard): a one-weight "policy" whose KL is x^2, so
every halving's KL is worked out in the comments."""

from __future__ import annotations

import pytest
import torch

from tether.trainers.guard import Ahead, GuardSettings, guard_update, guarded_epochs, merge_stats
from tether.trainers.update import UpdateStats


def test_a_step_within_the_ceiling_is_kept_whole():
    # x: 0 -> 1, KL(x) = x^2 = 1 <= limit 1 * 1.05: kept, no halving measured after the first
    x = torch.tensor([1.0], dtype=torch.float64)
    out = guard_update(
        [x],
        [torch.tensor([0.0], dtype=torch.float64)],
        measure=lambda: (float(x[0] ** 2), 0.0),
        kl_before=0.0,
        settings=GuardSettings(limit=1.0),
    )
    assert out[:4] == (1.0, 1.0, 1.0, 0) and x.tolist() == [1.0]


def test_a_step_past_the_ceiling_is_halved_until_it_fits():
    # x: 0 -> 2, KL 4 > 1.05; alpha 1/2: x = 1, KL 1 <= 1.05: kept, one halving
    x = torch.tensor([2.0], dtype=torch.float64)
    out = guard_update(
        [x],
        [torch.tensor([0.0], dtype=torch.float64)],
        measure=lambda: (float(x[0] ** 2), 0.0),
        kl_before=0.0,
        settings=GuardSettings(limit=1.0),
    )
    assert out[:4] == (4.0, 1.0, 0.5, 1) and x.tolist() == [1.0]
    # x: 0 -> 8, KL 64: 4 (16), 2 (4), 1 (1): alpha 1/8 after three halvings
    x = torch.tensor([8.0], dtype=torch.float64)
    out = guard_update(
        [x],
        [torch.tensor([0.0], dtype=torch.float64)],
        measure=lambda: (float(x[0] ** 2), 0.0),
        kl_before=0.0,
        settings=GuardSettings(limit=1.0),
    )
    assert out[:4] == (64.0, 1.0, 0.125, 3) and x.tolist() == [1.0]


def test_no_halving_fits_and_the_weights_are_restored_exactly():
    # from x = 0.5 (KL 0.25) to 1e6; 2 halvings allowed: 5e5, 2.5e5, both past: restored to 0.5,
    # bit for bit, and the kept KL is the one it started from; written() ran after each write
    x, writes = torch.tensor([1e6], dtype=torch.float64), []
    out = guard_update(
        [x],
        [torch.tensor([0.5], dtype=torch.float64)],
        measure=lambda: (float(x[0] ** 2), 0.0),
        kl_before=0.25,
        settings=GuardSettings(limit=1.0, max_halvings=2),
        written=lambda: writes.append(float(x[0])),
    )
    assert out[:4] == (1e12, 0.25, 0.0, 2) and x.tolist() == [0.5]
    assert writes == [500000.25, 250000.375, 0.5]


def test_an_update_that_brings_an_over_budget_policy_closer_is_kept():
    # from KL 9 (x = 3, over the 1.05 ceiling already) to x = 2.5 (6.25): no worse than the start,
    # so kept whole; to x = 4 (16): halved to 3.5 (12.25), 3.25 (10.56) ... never <= 9, restored
    x = torch.tensor([2.5], dtype=torch.float64)
    s = GuardSettings(limit=1.0, max_halvings=4)
    assert (
        guard_update(
            [x],
            [torch.tensor([3.0], dtype=torch.float64)],
            measure=lambda: (float(x[0] ** 2), 0.0),
            kl_before=9.0,
            settings=s,
        )[2]
        == 1.0
    )
    x = torch.tensor([4.0], dtype=torch.float64)
    out = guard_update(
        [x],
        [torch.tensor([3.0], dtype=torch.float64)],
        measure=lambda: (float(x[0] ** 2), 0.0),
        kl_before=9.0,
        settings=s,
    )
    assert out.fraction == 0.0 and x.tolist() == [3.0]


def test_guarded_epochs_stop_at_the_first_epoch_the_guard_cut():
    # three epochs, each adds 1 to x (KL x^2, limit 4: ceiling 4.2); epoch 1: 1 (kept), epoch 2:
    # 2 (4, kept), epoch 3: 3 (9) halved to 2.5 (6.25), 2.25 (5.06), 2.125 (4.52), 2.0625 (4.25),
    # 2.03125 (4.126 <= 4.2): alpha 1/32; no fourth epoch is drawn
    x, drawn = torch.tensor([0.0], dtype=torch.float64), []

    def epochs():
        for e in range(4):
            drawn.append(e)
            yield [torch.tensor([e], dtype=torch.float64)]

    def one_epoch(minibatches):
        x.add_(1.0)
        return UpdateStats({"policy/loss": float(x[0])}, grad_norm=1.0, first_ratio_dev=0.0, steps=1)

    stats, out = guarded_epochs(
        epochs(),
        update=one_epoch,
        tensors=[x],
        measure=lambda: (float(x[0] ** 2), 0.0),
        kl_before=0.0,
        settings=GuardSettings(limit=4.0),
    )
    # the share kept: epochs 1 and 2 whole, epoch 3's 1/32, of 3 epochs run
    assert drawn == [0, 1, 2] and out.fraction == (2 + 1 / 32) / 3 and out.backtracks == 5
    assert x.tolist() == [2.03125] and out.kl_kept == pytest.approx(2.03125**2)
    assert stats.steps == 3 and stats.stats["policy/loss"] == pytest.approx((1 + 2 + 3) / 3)


def test_the_standard_errors_count_against_the_ceiling():
    # KL x^2 with a standard error 0.1 x; the bound is KL + z sqrt(2) SE (the next batch's mean
    # differs from this one's by both batches' noise). Ceiling 1.05, z = 2. x: 0 -> 1:
    # 1 + 2 * 1.4142 * 0.1 = 1.283 > 1.05; alpha 1/2: x = 0.5, 0.25 + 2 * 1.4142 * 0.05 = 0.391 <=
    # 1.05: kept, its SE 0.05 reported. With z = 0 the same step is kept whole (1 <= 1.05).
    # Ceiling 1.25 (tol 0.25): 1 + 2 * 0.1 = 1.2 would pass a bound on the expectation alone; the
    # prediction bound 1.283 does not, so the step is halved: the sqrt(2) made the difference.
    cases = (
        (2.0, 0.05, (1.0, 0.25, 0.5, 1, 0.05)),
        (0.0, 0.05, (1.0, 1.0, 1.0, 0, 0.1)),
        (2.0, 0.25, (1.0, 0.25, 0.5, 1, 0.05)),
    )
    for z, tol, want in cases:
        x = torch.tensor([1.0], dtype=torch.float64)
        out = guard_update(
            [x],
            [torch.tensor([0.0], dtype=torch.float64)],
            measure=lambda x=x: (float(x[0] ** 2), 0.1 * float(x[0])),
            kl_before=0.0,
            settings=GuardSettings(limit=1.0, tol=tol, z=z),
        )
        assert tuple(out) == pytest.approx(want, rel=1e-15)
    assert GuardSettings(limit=1.0).bound(1.0, 0.1) == pytest.approx(1 + 2 * 2**0.5 * 0.1, rel=1e-15)


def test_the_lookahead_measures_each_epoch_but_the_last_and_is_dropped_on_a_cut():
    # the epochs of test_guarded_epochs_stop_at_the_first_epoch_the_guard_cut (x += 1 per epoch, KL
    # x^2, ceiling 4.2), 4 epochs, with a lookahead: epochs 1 and 2 are measured by it (x = 1, 2:
    # kept); epoch 3's lookahead reads 9 and is dropped before the halvings, which the plain measure
    # takes (5 of them, as without the lookahead). Same weights, same account; the plain measure
    # ran only for the halvings.
    def run(with_ahead: bool):
        x, calls = torch.tensor([0.0], dtype=torch.float64), []

        def one_epoch(minibatches):
            x.add_(1.0)
            return UpdateStats({}, grad_norm=1.0, first_ratio_dev=0.0, steps=1)

        def plain():
            calls.append("plain")
            return float(x[0] ** 2), 0.0

        def ahead_measure():
            calls.append("kept")
            return float(x[0] ** 2), 0.0

        def discard():
            if calls and calls[-1] == "kept":
                calls[-1] = "dropped"

        ahead = Ahead(measure=ahead_measure, discard=discard, epochs=4) if with_ahead else None
        _, out = guarded_epochs(
            iter([[0], [1], [2], [3]]),
            update=lambda mbs: (calls.append("update"), one_epoch(mbs))[1],
            tensors=[x],
            measure=plain,
            kl_before=0.0,
            settings=GuardSettings(limit=4.0),
            ahead=ahead,
        )
        return x.tolist(), tuple(out), calls

    x0, out0, calls0 = run(False)
    x1, out1, calls1 = run(True)
    assert (x1, out1) == (x0, out0) and x1 == [2.03125]
    assert calls0 == ["update", "plain"] * 3 + ["plain"] * 5
    assert calls1 == ["update", "kept"] * 2 + ["update", "dropped"] + ["plain"] * 5
    # the last epoch (no epoch follows) is measured plainly: 2 epochs, both kept
    x = torch.tensor([0.0], dtype=torch.float64)
    seen = []
    guarded_epochs(
        iter([[0], [1]]),
        update=lambda mbs: (x.add_(1.0), UpdateStats({}, 1.0, 0.0, steps=1))[1],
        tensors=[x],
        measure=lambda: (seen.append("plain"), (0.0, 0.0))[1],
        kl_before=0.0,
        settings=GuardSettings(limit=4.0),
        ahead=Ahead(measure=lambda: (seen.append("kept"), (0.0, 0.0))[1], discard=lambda: None, epochs=2),
    )
    assert seen == ["kept", "plain"]


def test_updated_kl_and_its_standard_error_by_hand():
    from tether.trainers.steps import updated_kl

    # three sequences, exact KL per position (masked positions hold junk that must not count):
    # s = [0.1 + 0.3, 0.6, 0.2 + 0.2 + 0.2] = [0.4, 0.6, 0.6], n = [2, 1, 3]
    kl = torch.tensor([[0.1, 0.3, 99.0], [0.6, 99.0, 99.0], [0.2, 0.2, 0.2]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    # per sequence: m = 1.6 / 3; deviations 0.4 - m = -0.1333, 0.0667, 0.0667; their squares sum to
    # 0.017778 + 0.004444 + 0.004444 = 0.026667; SE = sqrt(0.026667 / (3 * 2)) = 0.066667
    kl_seq, se_seq = updated_kl(exact_kl=kl, mask=mask, target_unit="nats_per_sequence")
    assert kl_seq == pytest.approx(1.6 / 3, rel=1e-6) and se_seq == pytest.approx(0.2 / 3, rel=1e-6)
    # per token: m = 1.6 / 6 = 0.26667; residuals s - m n = 0.4 - 0.5333 = -0.1333, 0.6 - 0.2667 =
    # 0.3333, 0.6 - 0.8 = -0.2; squares 0.017778 + 0.111111 + 0.04 = 0.168889;
    # SE = sqrt(3 / 2 * 0.168889) / 6 = sqrt(0.253333) / 6 = 0.083887
    kl_tok, se_tok = updated_kl(exact_kl=kl, mask=mask, target_unit="nats_per_token")
    assert kl_tok == pytest.approx(1.6 / 6, rel=1e-6) and se_tok == pytest.approx(0.253333**0.5 / 6, rel=1e-5)
    # groups of 3 (the rows of one prompt are not independent): one group, no spread to read, SE 0;
    # four rows in groups of 2: s = [0.4, 0.6, 0.6, 0.4] -> groups [1.0, 1.0], n = [2, 2] per
    # sequence: m = 0.5, residuals 0, SE 0, where rows alone give std 0.1155 / 2 = 0.0577
    assert updated_kl(exact_kl=kl, mask=mask, target_unit="nats_per_sequence", group_size=3)[1] == 0.0
    kl4, mask4 = torch.cat([kl, kl[:1]]), torch.cat([mask, mask[:1]])
    assert updated_kl(exact_kl=kl4, mask=mask4, target_unit="nats_per_sequence", group_size=2)[1] == 0.0
    assert updated_kl(exact_kl=kl4, mask=mask4, target_unit="nats_per_sequence")[1] == pytest.approx(
        (0.04 / 3) ** 0.5 / 2, rel=1e-6
    )
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        updated_kl(exact_kl=kl4, mask=mask4, target_unit="nats_per_sequence", group_size=3)
    # one sequence: no spread to read, SE 0; no valid token: KL 0, SE 0 (never NaN)
    assert updated_kl(exact_kl=kl[:1], mask=mask[:1], target_unit="nats_per_sequence")[1] == 0.0
    assert updated_kl(exact_kl=kl, mask=torch.zeros_like(mask), target_unit="nats_per_token") == (0.0, 0.0)


def test_a_kept_epoch_then_a_restored_one_is_half_kept_not_a_restore():
    # z = 0. epoch 1: x 0 -> 1, KL 1 <= 1.05: kept whole;
    # epoch 2: x 1 -> 5 (KL 25), halvings 3 (9), 2 (4), both past 1.05 and past the start's 1: with 2
    # halvings allowed, restored to x = 1. The update kept one of its two epochs: fraction 1/2, the
    # kept KL 1 with epoch 1's SE 0.25 (a restore measures nothing new)
    x = torch.tensor([0.0], dtype=torch.float64)
    steps = iter([1.0, 4.0])

    def one_epoch(minibatches):
        x.add_(next(steps))
        return UpdateStats({}, grad_norm=1.0, first_ratio_dev=0.0, steps=1)

    _, out = guarded_epochs(
        iter([[0], [1]]),
        update=one_epoch,
        tensors=[x],
        measure=lambda: (float(x[0] ** 2), 0.25),
        kl_before=0.0,
        settings=GuardSettings(limit=1.0, max_halvings=2, z=0.0),
    )
    assert x.tolist() == [1.0]
    assert (out.kl_updated, out.kl_kept, out.fraction, out.backtracks, out.se_kept) == (
        25.0,
        1.0,
        0.5,
        2,
        0.25,
    )


def test_a_broken_update_is_never_kept():
    # the measure of a policy whose logits broke is NaN (core/kl.py reads a NaN logit as NaN, not
    # 0): NaN passes no comparison, so the guard halves: x 4 (NaN), 2 (NaN), 1 (KL 1 <= 1.05): kept
    x = torch.tensor([4.0], dtype=torch.float64)
    out = guard_update(
        [x],
        [torch.tensor([0.0], dtype=torch.float64)],
        measure=lambda: (float(x[0] ** 2) if x[0] < 2 else float("nan"), 0.0),
        kl_before=0.0,
        settings=GuardSettings(limit=1.0),
    )
    assert x.tolist() == [1.0] and out.fraction == 0.25 and out.kl_kept == 1.0
    assert out.kl_updated != out.kl_updated  # NaN: the trainer gives the controller nothing to learn


def test_merge_stats_weighs_by_steps():
    a = UpdateStats({"l": 1.0}, grad_norm=2.0, first_ratio_dev=0.0, steps=1)
    b = UpdateStats({"l": 4.0}, grad_norm=5.0, first_ratio_dev=0.3, steps=3, skipped=1)
    m = merge_stats([a, b])  # (1 + 3 * 4) / 4 = 3.25; (2 + 15) / 4 = 4.25
    assert m.stats == {"l": 3.25} and m.grad_norm == 4.25 and m.first_ratio_dev == 0.0
    assert (m.steps, m.skipped) == (4, 1)


def test_the_guard_holds_what_a_guarded_controller_holds():
    # a controller the guard is made for (guarded) is held to its own held KL, which for the
    # budget controller is kl.budget; a fixed or adaptive one with kl.guard=true to kl.budget
    from types import SimpleNamespace

    from tether.core.controllers import AdaptiveKLController, BudgetKLController
    from tether.trainers.base import guard_settings

    kl = SimpleNamespace(guard=True, budget=2.5, guard_tol=0.05, guard_halvings=10, guard_z=2.0)
    cfg = SimpleNamespace(kl=kl)
    own = type("HoldsTarget", (AdaptiveKLController,), {"guarded": True})(0.1, target=0.005)
    assert guard_settings(cfg, own).limit == 0.005
    assert guard_settings(cfg, AdaptiveKLController(0.1, target=6.0)).limit == 2.5
    assert guard_settings(cfg, BudgetKLController(0.0, budget=2.5)).limit == 2.5
    assert guard_settings(SimpleNamespace(kl=SimpleNamespace(guard=False)), own) is None


def test_snapshots_copy_into_kept_tensors_and_the_guard_keeps_the_same_weights():
    from tether.trainers.guard import Snapshots

    store = Snapshots()
    w = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    a = store.take("before", w)
    w[0].add_(10.0)
    b = store.take("before", w)
    assert all(x is y for x, y in zip(a, b)) and b[0].tolist() == [11.0, 12.0]  # the same tensors, new values
    assert store.take("after", w)[0] is not b[0]  # another slot, another copy
    c = store.take("before", [torch.zeros(3)])  # shapes changed (another model): allocated anew
    assert c[0].shape == (3,) and c[0] is not b[0]
    # the halving example of test_a_step_past_the_ceiling_is_halved_until_it_fits, through a store
    x = torch.tensor([8.0], dtype=torch.float64)
    out = guard_update(
        [x],
        store.take("before", [torch.tensor([0.0], dtype=torch.float64)]),
        measure=lambda: (float(x[0] ** 2), 0.0),
        kl_before=0.0,
        settings=GuardSettings(limit=1.0),
        store=store,
    )
    assert out[:4] == (64.0, 1.0, 0.125, 3) and x.tolist() == [1.0]
