"""Session pins and revocation fallbacks as pure domain rules: no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from control.domain import (
    Alias,
    DomainError,
    FallbackOutcome,
    FallbackPolicy,
    IllegalTransition,
    Release,
    RepinReason,
    SessionPin,
    check_policy,
    check_session,
    effective_release,
    fall_back,
    session_pin_id,
    why_repin,
)

R1, R2, R3, R4 = ("sha256:" + c * 64 for c in "1234")
BASE_R = "sha256:" + "b" * 64
BASE = "sha256:" + "e" * 64
TOK = "sha256:" + "f" * 64
SOON = datetime(2030, 1, 1, tzinfo=UTC)


def _release(digest: str, tenant: str | None = "acme") -> Release:
    return Release(digest=digest, tenant=tenant, adapter_digest=None if tenant is None else R4,
                   base_digest=BASE, tokenizer_digest=TOK, chat_template_digest=None,
                   inference_defaults={}, evaluation_report_digest=None, actor="op")


def _alias(*stables: str) -> Alias:
    a = Alias.create("chat", owner="acme", release=None, actor="op")
    for digest in stables:
        a.point(_release(digest), True, "op")
    return a


# -- session pins ------------------------------------------------------------------------------

def test_a_pin_holds_until_it_ends_expires_or_its_release_stops_being_servable() -> None:
    t = SOON.timestamp()
    assert why_repin(ended=False, expires_at=t, now=t - 1, servable=True) is None
    assert why_repin(ended=False, expires_at=t, now=t, servable=True) == RepinReason.EXPIRED
    assert why_repin(ended=False, expires_at=t, now=t - 1,
                     servable=False) == RepinReason.NOT_SERVABLE
    # A revoked release is what the record says, even when the pin ran out as well.
    assert why_repin(ended=False, expires_at=t, now=t + 9,
                     servable=False) == RepinReason.NOT_SERVABLE
    assert why_repin(ended=True, expires_at=t, now=t - 1, servable=True) == RepinReason.RESTARTED


def test_session_pin_records_pin_repin_and_end() -> None:
    pin = SessionPin.create("acme", "chat", "s-1", R1, SOON, "gw")
    assert pin.id == session_pin_id("acme", "chat", "s-1")
    assert (pin.release, pin.expires_at, pin.ended) == (R1, SOON, False)
    assert pin.why_repin(SOON.timestamp() - 5, servable=True) is None
    later = SOON + timedelta(hours=1)
    pin.repin(R2, later, RepinReason.EXPIRED, "gw")
    pin.end("gw")
    assert pin.ended and pin.why_repin(0, servable=True) == RepinReason.RESTARTED
    with pytest.raises(IllegalTransition):
        pin.end("gw")
    pin.repin(R3, later, RepinReason.RESTARTED, "gw")  # the same id starts again
    assert (pin.release, pin.ended, pin.version) == (R3, False, 4)
    kinds = [type(e).__name__ for e in pin.collect_events()]
    assert kinds == ["SessionPinned", "SessionRepinned", "SessionEnded", "SessionRepinned"]


def test_pin_ids_are_per_tenant_alias_and_session() -> None:
    ids = {session_pin_id(t, a, s) for t in ("acme", "globex") for a in ("chat", "code")
           for s in ("1", "2")}
    assert len(ids) == 8


def test_session_ids_and_expiries_are_checked() -> None:
    assert check_session("chat-42:turn/3") == "chat-42:turn/3"
    for bad in ("", "has space", "x" * 129, "naïve", "tab\t"):
        with pytest.raises(DomainError, match="session id"):
            check_session(bad)
    with pytest.raises(DomainError, match="time zone"):
        SessionPin.create("acme", "chat", "s", R1, datetime(2030, 1, 1), "gw")
    with pytest.raises(DomainError):
        SessionPin.create("acme/x", "chat", "s", R1, SOON, "gw")


def test_the_projection_release_counts_once_it_has_applied_the_pins_latest_event() -> None:
    # The projection applied version 2 and then an alias-wide re-pin to R2: R2 counts.
    assert effective_release(R1, 2, R2, 2) == R2
    # The aggregate has moved on (version 3) since: its own release counts.
    assert effective_release(R3, 3, R2, 2) == R3
    assert effective_release(R1, 1, None, None) == R1


def test_alias_repins_and_drains_sessions_as_one_event() -> None:
    a = _alias(R1, R2)
    a.repin_sessions(R2, _release(R1), True, "rollback", "controller")
    a.drain_sessions(R2, "rollback", "controller")
    events = a.collect_events()
    moved, drained = events[-2], events[-1]
    assert isinstance(moved, Alias.AliasSessionsRepinned)
    assert (moved.from_release, moved.to_release, moved.reason) == (R2, R1, "rollback")
    assert isinstance(drained, Alias.AliasSessionsDrained) and drained.release == R2
    with pytest.raises(IllegalTransition, match="not servable"):
        a.repin_sessions(R2, _release(R1), False, "rollback", "controller")
    with pytest.raises(IllegalTransition, match="hold"):
        a.repin_sessions(R1, _release(R1), True, "rollback", "controller")
    with pytest.raises(DomainError, match="belong"):
        a.repin_sessions(R2, _release(R3, tenant="globex"), True, "rollback", "controller")
    with pytest.raises(DomainError, match="reason"):
        a.drain_sessions(R2, " ", "controller")


# -- fallback ----------------------------------------------------------------------------------

def _outcome(policy: FallbackPolicy, *, stable: str | None, canary: str | None = None,
             history: tuple[str, ...] = (), revoked: frozenset[str] = frozenset({R3}),
             dead: frozenset[str] = frozenset()) -> FallbackOutcome | None:
    return fall_back(policy, stable=stable, canary=canary, history=history,
                     revoked=lambda d: d in revoked, servable=lambda d: d not in dead,
                     base_release=lambda: BASE_R)


def test_fallback_policies() -> None:
    assert check_policy("stable") == FallbackPolicy.STABLE
    with pytest.raises(DomainError, match="stable, base, none"):
        check_policy("previous")
    # stable: the most recent servable release of the history.
    assert _outcome(FallbackPolicy.STABLE, stable=R3, history=(R1, R2),
                    dead=frozenset({R2})) == FallbackOutcome(R3, R1, False)
    assert _outcome(FallbackPolicy.STABLE, stable=R3, history=(R2,), dead=frozenset({R2})
                    ) == FallbackOutcome(R3, None, False)
    # A history entry of the revoked adapter itself never comes back.
    assert _outcome(FallbackPolicy.STABLE, stable=R3, history=(R1, R4),
                    revoked=frozenset({R3, R4})) == FallbackOutcome(R3, R1, False)
    assert _outcome(FallbackPolicy.BASE, stable=R3, history=(R1,)) == FallbackOutcome(
        R3, BASE_R, False)
    assert _outcome(FallbackPolicy.NONE, stable=R3, history=(R1,)) == FallbackOutcome(
        R3, None, False)


def test_a_revoked_canary_is_cleared_and_an_empty_stable_clears_the_canary() -> None:
    # Only the canary used the adapter: cleared, whatever the policy; the stable stays.
    for policy in FallbackPolicy:
        assert _outcome(policy, stable=R1, canary=R3) == FallbackOutcome(R3, R1, True)
    # The stable went and nothing replaces it: the canary must not inherit every session.
    assert _outcome(FallbackPolicy.NONE, stable=R3, canary=R2) == FallbackOutcome(R3, None, True)
    # A replacement exists: a healthy canary keeps its split.
    assert _outcome(FallbackPolicy.BASE, stable=R3, canary=R2) == FallbackOutcome(
        R3, BASE_R, False)
    assert _outcome(FallbackPolicy.NONE, stable=R1, canary=R2) is None  # untouched


def test_alias_records_its_policy_and_each_fallback() -> None:
    a = _alias(R1, R2, R3)  # history R1, R2
    assert a.fallback == FallbackPolicy.NONE  # the default: refuse
    a.set_fallback("stable", "op")
    with pytest.raises(IllegalTransition, match="already"):
        a.set_fallback("stable", "op")
    with pytest.raises(DomainError):
        a.set_fallback("nearest", "op")
    a.fall_back(R4, FallbackOutcome(R3, R1, False), "sec")
    assert (a.stable, a.history) == (R1, [])  # R2 (not servable, skipped) dropped with it
    assert a.last_fallback == {"adapter_digest": R4, "revoked_release": R3, "policy": "stable",
                               "to_release": R1, "canary_cleared": False}
    with pytest.raises(IllegalTransition):
        a.fall_back(R4, FallbackOutcome(R3, None, False), "sec")  # R3 is no longer routed


def test_none_leaves_the_alias_serving_nothing() -> None:
    a = _alias(R1, R3)
    a.set_canary(_release(R2), 20, True, "op")
    a.fall_back(R4, FallbackOutcome(R3, None, True), "sec")
    assert (a.stable, a.canary, a.canary_percent, a.history) == (None, None, 0, [R1])
    fell = a.collect_events()[-1]
    assert isinstance(fell, Alias.AliasFellBack) and fell.policy == "none"
