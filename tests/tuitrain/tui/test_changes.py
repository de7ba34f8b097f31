"""A change is pending until the worker answers; the screen shows the latest answers too."""

from __future__ import annotations

import pytest

from tuitrain.events import SetBudget, SetMargin, SetPolicy
from tuitrain.tui.changes import Change, ChangeTracker, command_for, shown


def test_a_change_reads_pending_then_applied_or_rejected():
    change = Change(1, "policy", "cpu", "auto", "cpu")
    assert change.describe() == "policy: auto → cpu (pending)"
    change.status, change.step = "applied", 43
    assert change.describe() == "policy: auto → cpu, applied at step 43"
    margin = Change(2, "margin_ratio", 1.5, "0.30", "1.50", status="rejected", reason="too big")
    assert margin.describe() == "margin: 0.30 → 1.50, rejected: too big"
    assert Change(3, "pause").describe() == "pause (pending)"


def test_an_action_reads_as_done_after_the_step_it_followed():
    assert Change(1, "pause", status="applied", step=5).describe() == "paused after step 5"
    assert Change(2, "resume", status="applied", step=5).describe() == "resumed after step 5"
    saved = Change(3, "checkpoint", status="applied", step=9)
    assert saved.describe() == "checkpoint saved after step 9"


def test_the_tracker_resolves_by_id_and_ignores_strangers():
    tracker = ChangeTracker(keep=2)
    for i in range(1, 4):
        tracker.sent(Change(i, "margin_ratio", i / 10, "", ""))
    assert tracker.latest_pending("margin_ratio").id == 3
    assert tracker.applied(2, step=7).step == 7
    assert tracker.rejected(3, "no").reason == "no"
    assert tracker.applied(99, step=1) is None
    assert [c.id for c in tracker.lines()] == [1, 3, 2]  # pending first, then newest answered
    tracker.applied(1, step=8)
    assert [c.id for c in tracker.lines()] == [1, 3]  # only `keep` answered ones stay


def test_values_read_the_same_everywhere_on_screen():
    assert shown("margin_ratio", 0.3) == "0.30"
    assert shown("device_budget", None) == "default"
    assert shown("policy", "cpu") == "cpu"


def test_each_setting_has_its_command():
    assert command_for("policy", "cpu") == SetPolicy(policy="cpu")
    assert command_for("margin_ratio", 0.5) == SetMargin(margin_ratio=0.5)
    assert command_for("device_budget", "4GiB") == SetBudget(device_budget="4GiB")
    with pytest.raises(ValueError, match="seq_len"):
        command_for("seq_len", 3)


def test_a_setting_applied_while_paused_applies_at_a_step_not_begun():
    change = Change(1, "policy", "cpu", "auto", "cpu", status="applied", step=289)
    assert change.describe(paused_after=288) == "policy: auto → cpu, applies at step 289"
    assert change.describe(paused_after=289) == "policy: auto → cpu, applied at step 289"
    assert change.describe() == "policy: auto → cpu, applied at step 289"
    paused = Change(2, "pause", status="applied", step=288)
    assert paused.describe(paused_after=288) == "paused after step 288"


def test_forget_all_leaves_nothing_to_show():
    tracker = ChangeTracker()
    tracker.sent(Change(1, "pause"))
    tracker.sent(Change(2, "resume"))
    tracker.applied(1, step=3)
    tracker.forget_all()
    assert tracker.lines() == []
