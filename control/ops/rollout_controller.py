"""The rollout controller: drives every unfinished rollout from its recorded events, on time.

A follower of the event store, like the projection follower (``projections.follower``): it reads
the notification log for rollout events to learn which rollouts exist and which have finished,
and for each unfinished one asks the aggregate what is due (``Rollout.next_action``):

- **enter a step**: preload and health-probe the target on every Triton host (:class:`TritonProbe`:
  real requests through Triton, with a ticket this controller signs for the alias owner and the
  target release, each answer's adapter digest read from the slot that computed it); only when
  the probe passed does it record the step with the alias move (``RolloutDesk.enter_step``: one
  transaction). A failed probe is recorded; a decisive one (a load failure, an identity
  mismatch) or the policy's last attempt rolls back;
- **judge a window**: read the target's and the baseline's figures over the window from the
  request ledger and tenant feedback (``Ledger.release_window``), the target's latencies beside
  the baseline's p95 and its failed loads, and record them with the decision
  (``RolloutDesk.record_window``), which rolls back in the same transaction when the decision
  says so. Windows missed while no controller ran are judged one after another (catch-up), and
  a window judged later than the policy allows records an alert first (``RolloutAlerted``);
- **watch for hard failures as they happen**: about once a second, the target's identity
  mismatches and failed loads since the open window began; one over the policy rolls back at
  once, paused or not, without waiting for the window's end. The same look runs right before a
  step is entered, so the time between a window's end and the next step is covered too;
- **outside changes** (``RolloutDesk.why_stop``): roll back, or pause with an alert when the
  baseline was revoked; for a while after a rollback, end sessions a gateway pinned to the
  target just as it happened (``RolloutDesk.sweep_sessions``).

One rollout's failure (a race lost to an operator or another controller, a database hiccup)
is logged and never stops the tick: the other rollouts are handled all the same.

Liveness: every tick updates :data:`LIVENESS`, which :func:`liveness_metrics` reads as gauges
(the last tick's age, rollouts failing, canaries unjudged for longer than their policy allows)
for an exporter in the same process; across processes the unjudged alert is the record.

It holds no state of its own that matters: killed at any point (SIGKILL), a restarted controller
reads the same events and finds the same action due. A step is entered only if it is the next
one (the aggregate refuses any other) and only by the save that wins the aggregate's next
version, so neither a restart nor two controllers at once (a ``serve`` thread and a separate
process) repeat or skip a step. What a crash can repeat is work whose result was not recorded
yet: a probe, or the reading of a window's figures.

``loraplane serve`` and ``loraplane control-plane`` run it as a thread; ``python -m
control.ops.rollout_controller --triton HOST:PORT`` (or ``loraplane rollout controller``) runs it
alone until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

from eventsourcing.utils import get_topic

from control.app import key_ring
from control.app.rollouts import RolloutDesk
from control.contracts.config import SHARED_POOL, Settings
from control.contracts.db import make_engine
from control.contracts.event_log import page_after
from control.contracts.ledger import LOAD_FAILED, MEMORY_REFUSALS, Ledger, Outcome, p95
from control.contracts.placement import parse_host_urls
from control.contracts.signals import TerminationSignals
from control.contracts.synthetic import PROBE_TENANT, is_synthetic
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import TicketSigner
from control.domain import Conflict, DomainError, ProbeReport, Release, Rollout
from control.domain.rollout import Enter, Judge, WindowFigures
from control.domain.rollout_judge import hard_failures
from control.ops.clients import TritonRefused, infer_with
from projections.follower import open_registry
from projections.routing import RoutingView

log = logging.getLogger("loraplane.rollouts")

ACTOR = "rollout-controller"
PROBE_PROMPT = "health probe"
PROBE_TICKET_TTL_S = 60  # a probe ticket lives as long as the probe, not a tenant's minutes
_PAGE = 500
# Failed loads that say the host had no room (the adapter cache's reasons behind the ledger's
# memory refusals), or that the adapter was revoked: not the target's own failure.
_NOT_THE_TARGETS = frozenset({r.removeprefix("adapter_") for r in MEMORY_REFUSALS}
                             | {"revoked"})
CATCH_UP_WINDOWS = 50  # windows judged per rollout per tick at most, after an outage
SWEEP_S = 30.0  # after a rollback, how long sessions pinned to the target are looked for
# Events that change which rollouts are unfinished; the others are read from the aggregate.
_STARTED = get_topic(Rollout.RolloutStarted)
_FINISHED = (get_topic(Rollout.RolloutRolledBack), get_topic(Rollout.RolloutCompleted))


class HealthProbe(Protocol):
    """Preloads and probes a release on the hosts (:class:`TritonProbe`; tests fake it)."""

    def probe(self, owner: str | None, release: Release, requests: int) -> ProbeReport: ...


class TritonProbe:
    """Preloads ``release`` on every host and probes it with real requests through Triton.

    The first request makes the adapter resident (the host loads it from the store, re-hashing
    its bytes, exactly as for a tenant's request); each of ``requests`` per host must answer
    ``ok`` from a slot holding the target's adapter. The ticket is signed with a key that is
    recorded and not retired (hosts trust no other), for the synthetic probe tenant, naming the
    target release: the host checks it like any tenant's ticket, and rollout windows leave its
    requests out (but for identity mismatches, which count whoever sent them). Load failures
    and identity mismatches are read back from the ledger the hosts wrote while the probe ran.
    """

    def __init__(self, settings: Settings, hosts: Sequence[str], routing: RoutingView,
                 ledger: Ledger, *, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.hosts = parse_host_urls(hosts)  # each with its pool (POOL=host:port)
        self.routing = routing
        self.ledger = ledger
        self.timeout_s = timeout_s

    def _signer(self) -> TicketSigner | None:
        # a key the root vouches for: hosts refuse tickets of any other
        recorded = self.routing.vouched_signing_keys(self.settings.keys_dir)
        retired = self.routing.retired_key_ids()
        signer = key_ring.pick_signer(self.settings.keys_dir,
                                      lambda kid: kid in recorded and kid not in retired)
        if signer is not None:
            publish_seal(self.routing.engine, signer)  # hosts open its tickets' arms with it
        return signer

    def probe(self, owner: str | None, release: Release, requests: int) -> ProbeReport:
        signer = self._signer()
        if signer is None or owner is None:
            return ProbeReport(hosts=[h.url for h in self.hosts], requests=0, ok=0, errors=[
                "no recorded, unretired signing key held here" if signer is None
                else "the alias has no owner to probe as"])
        # The release runs where its owner's policy puts it (issue 25): the probe's ticket binds
        # the owner's pool and regions, and only that pool's hosts are probed, so a dedicated
        # adapter is never loaded on a shared host, not even by the control plane.
        placement = self.routing.placement(owner)
        pool = placement.pool or SHARED_POOL
        hosts = [h.url for h in self.hosts if h.pool == pool]
        if not hosts:
            return ProbeReport(hosts=[], requests=0, ok=0, errors=[
                f"no Triton host of pool {pool} is listed to probe (LORAPLANE_TRITON_URLS)"])
        # The probe's requests are the control plane's own (control.contracts.synthetic): its
        # ticket names the synthetic tenant, so no window counts them as the alias owner's.
        token, _claims = signer.issue(
            tenant=PROBE_TENANT, model=self.settings.model_name, base=release.base_digest,
            adapter=release.adapter_digest, tokenizer=release.tokenizer_digest,
            release=release.digest, disclose=True,  # the control plane checks the digest
            ttl_s=min(PROBE_TICKET_TTL_S, self.settings.ticket_ttl_s),
            pool=pool, regions=placement.regions)
        import tritonclient.http as http  # the client library: only a probe needs it

        started = time.time()
        expected = release.adapter_digest or ""
        sent = ok = 0
        errors: list[str] = []
        latencies: list[float] = []
        for host in hosts:
            client = http.InferenceServerClient(host, connection_timeout=self.timeout_s,
                                                network_timeout=self.timeout_s)
            try:
                for _ in range(requests):
                    sent += 1
                    t0 = time.monotonic()
                    try:
                        answer = infer_with(client, "http", PROBE_PROMPT, token, max_tokens=4)
                    except TritonRefused as e:
                        errors.append(f"{host}: refused ({e.status})")
                        continue
                    except Exception as e:  # unreachable, reset, timed out: not the target's
                        errors.append(f"{host}: unreachable ({type(e).__name__})")
                        continue
                    latencies.append(time.monotonic() - t0)
                    if answer.adapter_digest == expected:
                        ok += 1
                    else:
                        errors.append(f"{host}: answered from another adapter")
            finally:
                client.close()
        failed_loads = 0
        mismatches = 0
        if release.adapter_digest is not None:
            failed_loads = sum(1 for load in self.ledger.loads(release.adapter_digest)
                               if load.outcome == LOAD_FAILED and load.started_at >= started)
        mismatches = len(self.ledger.query(release=release.digest, since=started,
                                           outcome=Outcome.IDENTITY_MISMATCH.value))
        return ProbeReport(hosts=hosts, requests=sent, ok=ok, load_failures=failed_loads,
                           identity_mismatches=mismatches, p95_latency_s=p95(latencies),
                           errors=errors[:10])


@dataclass
class Liveness:
    """What the controllers of this process last did (one per process: :data:`LIVENESS`)."""

    last_tick_at: float | None = None
    ticks: int = 0
    failures: int = 0  # rollouts whose handling raised, all ticks together
    unjudged: int = 0  # canaries unjudged for longer than their policy allows, last tick
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ticked(self, now: float, failures: int, unjudged: int) -> None:
        with self._lock:
            self.last_tick_at = now
            self.ticks += 1
            self.failures += failures
            self.unjudged = unjudged


LIVENESS = Liveness()


def liveness_metrics(now: float | None = None) -> dict[str, float]:
    """Gauges for an exporter in this process (Prometheus names): seconds since a rollout
    controller last ticked here (-1: none ever did), rollouts whose handling failed, and
    canaries unjudged for longer than their policy allows at the last tick."""
    now = time.time() if now is None else now
    with LIVENESS._lock:
        last = LIVENESS.last_tick_at
        return {
            "loraplane_rollout_controller_tick_age_seconds":
                -1.0 if last is None else max(0.0, now - last),
            "loraplane_rollout_controller_ticks_total": float(LIVENESS.ticks),
            "loraplane_rollout_controller_failures_total": float(LIVENESS.failures),
            "loraplane_rollout_unjudged_canaries": float(LIVENESS.unjudged),
        }


@dataclass
class RolloutController:
    """Drives rollouts (see the module notes). ``tick`` does what is due once; ``run`` ticks
    until stopped."""

    desk: RolloutDesk
    ledger: Ledger
    probe: HealthProbe
    actor: str = ACTOR
    clock: Callable[[], float] = time.time
    retry_s: float = 1.0  # after a failed probe, before the next attempt
    check_s: float = 1.0  # how often an unfinished rollout is checked for outside changes
    _position: int = 0
    _unfinished: set[UUID] = field(default_factory=set)
    _not_before: dict[UUID, float] = field(default_factory=dict)
    _checked_at: dict[UUID, float] = field(default_factory=dict)
    _sweep_until: dict[UUID, float] = field(default_factory=dict)
    _late: dict[UUID, bool] = field(default_factory=dict)  # unjudged too long, when last read
    _looked: bool = False  # the log was read once: rollbacks found from now on are new

    @classmethod
    def for_hosts(cls, settings: Settings, hosts: Sequence[str], *,
                  actor: str = ACTOR) -> RolloutController:
        """A controller for the deployment of ``settings`` probing the Triton hosts ``hosts``
        (``host:port`` of their HTTP endpoints)."""
        engine = make_engine(settings.db_url)
        ledger = Ledger(engine)
        return cls(RolloutDesk(open_registry(settings)), ledger,
                   TritonProbe(settings, hosts, RoutingView(engine), ledger), actor=actor)

    # -- following the log --------------------------------------------------------------------

    def discover(self) -> None:
        """Learn of rollouts started and finished since the last look."""
        recorder: Any = self.desk.registry.recorder
        # Read up to the log's end as it stands now, and remember that end: the next look starts
        # there, not at the last rollout event, so a quiet controller does not scan the whole
        # log every tick. (Positions are assigned in commit order: nothing appears below it.)
        top = int(recorder.max_notification_id() or 0)
        while True:
            page = page_after(recorder, self._position, _PAGE, stop=top,
                              topics=(_STARTED, *_FINISHED))
            if not page:
                self._position = max(self._position, top)
                self._looked = True
                return
            for n in page:
                rid = UUID(str(n.originator_id))  # the stored form may be the hex string
                if n.topic == _STARTED:
                    self._unfinished.add(rid)
                else:
                    self._unfinished.discard(rid)
                    self._not_before.pop(rid, None)
                    self._checked_at.pop(rid, None)
                    self._late.pop(rid, None)
                    if self._looked and n.topic == _FINISHED[0]:
                        self._sweep_until[rid] = self.clock() + SWEEP_S
            self._position = page[-1].id

    @property
    def unfinished(self) -> frozenset[UUID]:
        return frozenset(self._unfinished)

    # -- acting -------------------------------------------------------------------------------

    def tick(self) -> int:
        """Do what is due for every unfinished rollout; return how many moves were recorded.

        Each rollout is handled on its own: whatever one raises (a move lost to an operator or
        another controller, an error reading its figures) is logged, and the others are still
        handled; the next tick starts again from the recorded events."""
        self.discover()
        moves = failures = 0
        for rid in sorted(self._unfinished):
            try:
                moves += self._act(rid)
            except (Conflict, DomainError) as e:
                # Another controller or an operator moved it first (Conflict, or the move is no
                # longer legal on the fresh record): look again next tick.
                log.warning("rollout %s moved concurrently (%s); re-reading it", rid, e)
            except Exception:
                failures += 1
                log.exception("rollout %s: handling failed; retrying next tick", rid)
        for rid in sorted(self._sweep_until):
            try:
                self._sweep(rid)
            except Exception:
                failures += 1
                log.exception("rollout %s: ending the target's sessions failed", rid)
        unjudged = sum(1 for rid in self._unfinished if self._late.get(rid))
        LIVENESS.ticked(self.clock(), failures, unjudged)
        return moves

    def _sweep(self, rid: UUID) -> None:
        now = self.clock()
        if now >= self._sweep_until[rid]:
            del self._sweep_until[rid]
            return
        if now - self._checked_at.get(rid, float("-inf")) < self.check_s:
            return
        self._checked_at[rid] = now
        ended = self.desk.sweep_sessions(rid, actor=self.actor)
        if ended:
            log.warning("rollout %s: ended %d session(s) pinned to its rolled-back target",
                        rid, ended)

    def _act(self, rid: UUID) -> int:
        now = self.clock()
        if now < self._not_before.get(rid, 0.0):
            return 0
        rollout = self.desk.get(rid)
        if rollout.finished:
            self._unfinished.discard(rid)
            return 0
        if now - self._checked_at.get(rid, float("-inf")) >= self.check_s:
            self._checked_at[rid] = now
            stop = self.desk.why_stop(rollout)
            if stop is not None:
                log.warning("%s %s #%d: %s", "rolling back" if stop.roll_back else "pausing",
                            rollout.alias, rollout.number, stop.reason)
                self.desk.stop(rid, stop, actor=self.actor)
                return 1
            hard = self._hard_failures(rollout, now)
            if hard:
                return self._roll_back_hard(rollout, hard)
        moves = 0
        self._late[rid] = rollout.unjudged_for(now) is not None
        if self._late[rid] and self.desk.alert_unjudged(rid, actor=self.actor):
            log.warning("%s #%d: a window went unjudged for too long", rollout.alias,
                        rollout.number)
            moves += 1
            rollout = self.desk.get(rid)
        for _ in range(CATCH_UP_WINDOWS):
            action = rollout.next_action(self.clock())
            if isinstance(action, Judge):
                moves += self._judge(rollout, action)
                rollout = self.desk.get(rid)
                continue
            if isinstance(action, Enter):
                moves += self._enter(rollout, action)
            break
        return moves

    def _hard_failures(self, rollout: Rollout, now: float) -> list[str]:
        """Why the hard-failure rules roll ``rollout`` back now, counting the step's judged
        windows and the open window up to ``now`` (empty: they do not)."""
        if rollout.window_start is None:
            return []
        since = rollout.window_start
        seen = self.ledger.release_window(rollout.target, rollout.target_adapter, since, now)
        return hard_failures(
            rollout.policy, rollout.evidence.identity_mismatches + seen.identity_mismatches,
            rollout.evidence.load_failures + self._failed_loads(rollout, since, now))

    def _roll_back_hard(self, rollout: Rollout, reasons: list[str]) -> int:
        log.warning("rolling back %s #%d at once: %s", rollout.alias, rollout.number,
                    "; ".join(reasons))
        self.desk.roll_back(rollout.id, [f"seen as it happened: {r}" for r in reasons],
                            actor=self.actor, hard=True)
        return 1

    def _running(self, release: str, since: float, until: float) -> int:
        """The release's requests admitted in ``[since, until)`` and not finished yet (tenants'
        only, as the window's figures count them)."""
        return sum(1 for r in self.ledger.query(release=release, since=since, until=until,
                                                outcome=Outcome.RUNNING.value)
                   if not is_synthetic(r.tenant))

    def _failed_loads(self, rollout: Rollout, since: float, until: float) -> int:
        """Failed loads of the target's adapter started in ``[since, until)``, capacity
        refusals and revocations aside (see ``_NOT_THE_TARGETS``)."""
        if rollout.target_adapter is None:
            return 0
        return sum(1 for load in self.ledger.loads(rollout.target_adapter)
                   if load.outcome == LOAD_FAILED and since <= load.started_at < until
                   and load.reason not in _NOT_THE_TARGETS)

    def _enter(self, rollout: Rollout, action: Enter) -> int:
        release = self.desk.registry.release_manifest(rollout.target)
        report = self.probe.probe(rollout.owner, release, rollout.policy.probe_requests)
        # The probe took a while: act only if the same step is still what is due (an operator
        # may have paused or aborted meanwhile; another controller may have entered it).
        fresh = self.desk.get(rollout.id)
        if fresh.next_action(self.clock()) != action:
            return 0
        # Look for hard failures up to this instant: the time since the last window (settle,
        # tick, probe) is judged before the canary's share grows.
        hard = self._hard_failures(fresh, self.clock())
        if hard:
            return self._roll_back_hard(fresh, hard)
        try:
            if report.passed:
                after = self.desk.enter_step(rollout.id, action.index, report, actor=self.actor)
                if after.step != action.index:  # stopped for an outside change instead
                    log.warning("%s #%d: step %d not entered, %s: %s", rollout.alias,
                                rollout.number, action.index + 1, after.status,
                                "; ".join(after.reasons) or after.alerts[-1]["message"])
                else:
                    log.info("%s #%d: step %d (%d%%) entered", rollout.alias, rollout.number,
                             action.index + 1, action.percent)
            else:
                after = self.desk.record_probe_failure(rollout.id, action.index, report,
                                                       actor=self.actor)
                log.warning("%s #%d: probe before step %d failed: %s%s", rollout.alias,
                            rollout.number, action.index + 1, "; ".join(report.reasons()),
                            " (rolled back)" if after.finished else "")
                self._not_before[rollout.id] = self.clock() + self.retry_s
        except DomainError as e:  # the alias or the target changed under the probe
            log.warning("%s #%d: step %d not entered: %s", rollout.alias, rollout.number,
                        action.index + 1, e)
            return 0
        return 1

    def _judge(self, rollout: Rollout, action: Judge) -> int:
        start, end = action.start, action.end
        target = self.ledger.release_window(rollout.target, rollout.target_adapter, start, end)
        baseline = self.ledger.release_window(rollout.baseline, rollout.baseline_adapter,
                                              start, end)
        slow = timed = 0
        if baseline.p95_latency_s is not None:
            bound = rollout.policy.max_p95_ratio * baseline.p95_latency_s
            took = [r.finished_at - r.admitted_at for r in self.ledger.query(
                release=rollout.target, since=start, until=end, outcome=Outcome.OK.value)
                if r.finished_at is not None and not is_synthetic(r.tenant)]
            slow, timed = sum(1 for t in took if t > bound), len(took)
        window = WindowFigures(
            target, baseline, slow=slow, timed=timed,
            load_failures=self._failed_loads(rollout, start, end),
            target_running=self._running(rollout.target, start, end),
            baseline_running=self._running(rollout.baseline, start, end))
        busy = self.ledger.unattributed_busy(start, end)
        verdict = self.desk.record_window(rollout.id, start, end, window, busy,
                                          actor=self.actor)
        log.info("%s #%d: window of step %d: %s (%s)", rollout.alias, rollout.number,
                 rollout.step + 1, verdict.decision, "; ".join(verdict.reasons))
        return 1

    def run(self, stop: threading.Event, interval: float = 0.2) -> None:
        """Tick every ``interval`` seconds until ``stop`` is set. Errors are logged, not fatal:
        the next tick starts again from the recorded events."""
        while not stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("rollout controller tick failed; retrying")
                stop.wait(min(5.0, interval * 10))
            stop.wait(interval)


def run_until_signalled(settings: Settings, hosts: Sequence[str]) -> int:
    """Run a controller for ``settings`` probing ``hosts`` until SIGTERM or SIGINT."""
    controller = RolloutController.for_hosts(settings, hosts)
    stop = threading.Event()
    with TerminationSignals() as term:
        # The loop runs in a thread; this one waits for the signal (see control.contracts.signals).
        worker = threading.Thread(target=controller.run, args=(stop,), name="rollouts")
        worker.start()
        log.info("rollout controller running; probing %s", ", ".join(hosts))
        log.info("signal %d: stopping", term.wait())
        stop.set()
        worker.join()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m control.ops.rollout_controller --triton HOST:PORT [...]``."""
    parser = argparse.ArgumentParser(prog="python -m control.ops.rollout_controller",
                                     description="Drive rollouts until SIGTERM.")
    parser.add_argument("--triton", action="append", required=True,
                        help="a Triton host's HTTP endpoint (host:port); repeatable")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings.from_env()
    settings.ensure_dirs()
    return run_until_signalled(settings, args.triton)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
