"""The in-flight table of a `BrokerClient`: every request and utility call it has out, and what it knows
of their engines, behind one lock (see the client's rules in `broker.client.client`).

State, all of it owned here (nothing else reads or writes it, except the fields of a `Mailbox` that its
handle reads):
- mailboxes by wire id: a request's own id, or after a resume one continuation id per running sequence
  (`Mailbox.routes`), so one mailbox may sit under several ids;
- utility calls by call id, each with the engine it went to and the queue its answer goes into;
- the last `EngineOutputs.seq` seen from each engine (a duplicate is dropped, a gap fails that engine's
  requests with output_lost, and its utility calls), and the incarnation each engine had when work was placed on it
  (a new incarnation restarts its numbering);
- ABORTs that could not be sent yet, by engine (sent by the maintenance thread once Redis answers);
- engines declared gone before their registration says so (presence lost: engine_exited; engine_failed
  outputs), each with the incarnation and reason of its first verdict;
- whether the output subscription is up.

Rules:
- Every method takes the lock for one step and holds it for bookkeeping only: never during Redis I/O,
  never while waiting (so the callbacks it runs under the lock, `placed`/`released` and a
  `resume_blocker`, do no I/O either). What must be sent afterwards (ADDs, ABORTs) is returned to the
  caller, which sends it outside the lock; ABORTs for requests it ends itself are queued as deferred ones.
- A mailbox is registered only while the subscription is up; losing the subscription fails (or parks for
  sending again) every request in flight in the same step, so no output can be missed unnoticed.
- A request ends once: its last output or error goes into its mailbox, its wire ids are unrouted and its
  engine's load count (`released`) drops, in one step; ending it again does nothing. Errors made here are
  `RequestOutput.failure` outputs (an `ErrorCode` and a message); a request failed while its
  engine lives is ABORTed there (deferred), one whose engine is gone is not.
- Outputs reach a mailbox only from the engine it is placed on and under a wire id it still routes: late
  outputs of a gone engine, of a request moved to continuations, or of one lost with Redis are dropped.
- A handoff output (`RequestOutput.handoff`: the prefill engine is done with the request) marks its mailbox
  `handoff_pending` and wakes the maintenance thread, whose next check moves it (`collect_orphans` returns it as
  a `resume` with reason `HANDOFF`, whatever its engine's state); `move_to_continuations(handoff=True)` moves it
  once and counts it in `Mailbox.handoffs`, which never count against `max_migrations`.
- The first verdict on an engine wins: declaring it gone again keeps the first reason. A verdict is
  dropped once the registry agrees (the engine deregistered, expired or restarted), but the liveness
  check that drops it still reads the reasons as they were before (`collect_orphans`): an engine that
  failed and deregistered at once resumes its requests as engine_failed, not heartbeat_expired.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from broker.client.mailbox import Mailbox
from broker.client.request_resume import continuation_adds
from protocol.messages import (
    AddRequest,
    EngineOutputs,
    ErrorCode,
    FinishReason,
    RequestOutput,
    UtilityResult,
    make_error,
)

logger = logging.getLogger(__name__)

Verdict = tuple[str | None, str]  # (incarnation, reason) of an engine declared gone
REDIS_LOST = "redis_lost"
"""Why a started request moves when the output subscription dropped (a Redis restart or failover)."""
HANDOFF = "handoff"
"""Why a request moves when its prefill engine handed it over (prefill/decode disaggregation)."""


@dataclasses.dataclass
class Orphans:
    """Requests whose engine is gone or restarted, sorted by what happens to them next."""

    replace: list[Mailbox] = dataclasses.field(default_factory=list)  # no output yet: its ADD goes elsewhere
    resend: list[Mailbox] = dataclasses.field(default_factory=list)  # lost with Redis: sent again, fresh id
    resume: list[tuple[Mailbox, str]] = dataclasses.field(default_factory=list)  # started: (mailbox, why)


class Continuation(NamedTuple):
    """A request moved to continuations: the engine and wire ids it left, and the ADDs to send."""

    old_engine: str
    old_ids: list[str]
    adds: dict[str, tuple[int, AddRequest]]


class InFlightTable:
    """One client's requests, utility calls and engine verdicts; see the module rules.

    `placed(engine_id)` / `released(engine_id)` count a request on its engine for load balancing
    (`EngineSelector.on_submit` / `on_finish`); they are called under the table's lock.
    """

    def __init__(self, client_id: str, placed: Callable[[str], None], released: Callable[[str], None]) -> None:
        self._client_id = client_id
        self._placed = placed
        self._released = released
        self._lock = threading.Lock()
        self._mailboxes: dict[str, Mailbox] = {}
        self._calls: dict[str, tuple[str, queue.SimpleQueue]] = {}
        self._last_seq: dict[str, int] = {}
        self._incarnations: dict[str, str] = {}
        self._pending_aborts: dict[str, set[str]] = {}
        self._gone: dict[str, Verdict] = {}
        self._subscribed = False
        self._subscribed_event = threading.Event()
        self._lost_subscription = False
        self._resubscribed_at: float | None = None  # monotonic time the subscription came back after a loss
        self._liveness_due = threading.Event()  # an engine was declared gone between liveness checks

    # ----------------------------------------------------------------- the output subscription

    @property
    def subscribed(self) -> bool:
        return self._subscribed

    def wait_subscribed(self, timeout: float) -> bool:
        return self._subscribed_event.wait(timeout)

    def since_resubscribed(self) -> float:
        """Seconds since the subscription came back after being lost (inf if it never was lost)."""
        at = self._resubscribed_at
        return float("inf") if at is None else time.monotonic() - at

    def set_subscribed(self, up: bool) -> None:
        with self._lock:
            self._set_subscribed_locked(up)

    def lose_subscription(self, resubmit_limit: int,
                          resume_blocker: Callable[[Mailbox], str | None] | None = None) -> tuple[int, int]:
        """The subscription dropped: a request that produced no output (and may still be re-placed) is kept to
        be sent again once Redis is back, and so is a started one that `resume_blocker` lets move (it resumes
        from its delivered tokens, `collect_orphans`); every other request and every call fails with
        broker_disconnected. Returns (failed, kept)."""
        with self._lock:
            self._set_subscribed_locked(False)
            self._lost_subscription = True
            failed = kept = 0
            for mb in self._requests_locked():
                resend = not mb.got_output and mb.resubmits < resubmit_limit
                if resend or (mb.got_output and resume_blocker is not None and resume_blocker(mb) is None):
                    mb.lost_with_redis = True
                    mb.orphaned_at = time.monotonic() if mb.orphaned_at is None else mb.orphaned_at
                    kept += 1
                else:
                    failed += 1
                    self._fail_locked(mb, ErrorCode.BROKER_DISCONNECTED,
                                      "lost the connection to Redis; output may be incomplete")
            self._fail_calls_locked(None, "lost the connection to Redis")
            self._last_seq.clear()
        return failed, kept

    def _set_subscribed_locked(self, up: bool) -> None:
        self._subscribed = up
        if up:
            if self._lost_subscription:
                self._lost_subscription = False
                self._resubscribed_at = time.monotonic()
            if any(mb.lost_with_redis for mb in self._mailboxes.values()):
                self._liveness_due.set()  # send them again now, not at the next periodic check
            self._subscribed_event.set()
        else:
            self._subscribed_event.clear()

    # ----------------------------------------------------------------- requests

    def register(self, mb: Mailbox) -> bool:
        """Route `mb` under its request id and count it on its engine; False if not subscribed (wait and
        retry). Raises ValueError if that id is already in flight."""
        with self._lock:
            if mb.request_id in self._mailboxes:
                raise ValueError(f"request id {mb.request_id!r} is already in flight")
            if not self._subscribed:
                return False
            self._mailboxes[mb.request_id] = mb
            self._placed(mb.engine_id)
            return True

    def drop(self, mb: Mailbox) -> None:
        """Forget a request whose ADD never reached its stream (no output, no ABORT)."""
        with self._lock:
            self._finish_locked(mb)

    def fail(self, mb: Mailbox, code: ErrorCode, detail: str, abort: bool = True) -> None:
        """End `mb` with an error output; `abort`: ABORT it on its engine (deferred), which still runs it."""
        with self._lock:
            self._fail_locked(mb, code, detail, abort)

    def expire(self, mb: Mailbox) -> None:
        """End `mb` with deadline_exceeded (and an ABORT to its engine)."""
        with self._lock:
            self._expire_locked(mb)

    def abort(self, mb: Mailbox) -> tuple[str, list[str]] | None:
        """End `mb` with an "abort" output; returns (engine, wire ids) to ABORT, or None if it had ended."""
        with self._lock:
            if mb.done:
                return None
            self._end_aborted_locked(mb)
            return mb.engine_id, list(mb.routes)

    def abort_ids(self, request_ids: Iterable[str]) -> None:
        """End the requests routed under `request_ids` with an "abort" output (the caller sends the ABORT)."""
        with self._lock:
            for rid in request_ids:
                mb = self._mailboxes.get(rid)
                if mb is not None:
                    self._end_aborted_locked(mb)

    def abandon_sequence(self, mb: Mailbox, index: int) -> tuple[str, str, int | None]:
        """Sequence `index` of `mb` was stopped by the caller (never resumed); returns (engine, wire id,
        index within that wire request) to ABORT."""
        with self._lock:
            mb.abandoned.add(index)
            wire_id, wire_index = mb.wire_id(index)
            return mb.engine_id, wire_id, wire_index

    def fail_all(self, detail: str) -> None:
        """End every request (broker_disconnected, ABORT deferred) and utility call: the client stops."""
        with self._lock:
            for mb in self._requests_locked():
                self._fail_locked(mb, ErrorCode.BROKER_DISCONNECTED, detail)
            self._fail_calls_locked(None, detail)

    def fail_overdue(self, replace_wait: float) -> None:
        """End the requests past their deadline, and those lost with Redis that waited `replace_wait` s."""
        now = time.time()
        with self._lock:
            for mb in self._requests_locked():
                if mb.deadline is not None and mb.deadline <= now:
                    self._expire_locked(mb)
            for mb in self._requests_locked():
                if mb.lost_with_redis and mb.orphaned_at is not None \
                        and time.monotonic() - mb.orphaned_at >= replace_wait:
                    self._fail_locked(mb, ErrorCode.BROKER_DISCONNECTED, "lost the connection to Redis and it was "
                                      f"not back within {replace_wait:.0f} s")

    def in_flight(self) -> int:
        """Wire ids in flight (a request resumed as n continuations counts n)."""
        with self._lock:
            return len(self._mailboxes)

    # ----------------------------------------------------------------- outputs and utility results

    def deliver(self, outs: EngineOutputs) -> None:
        """Hand one step's outputs to their mailboxes and calls: a duplicate seq is dropped, a skipped one
        fails that engine's requests and calls first (output_lost). A continuation's outputs are renamed to
        its request's id and index, and every token handed over is kept in `Mailbox.delivered`."""
        engine_id = outs.engine_id
        with self._lock:
            last = self._last_seq.get(engine_id)
            if last is not None and outs.seq <= last:
                return  # a duplicate from a retried PUBLISH
            self._last_seq[engine_id] = outs.seq
            if last is not None and outs.seq > last + 1:
                self._record_gap_locked(engine_id, outs.seq - last - 1)
            for out in outs.outputs:
                mb = self._mailboxes.get(out.request_id)
                # A request lost with Redis runs again under a fresh id: whatever still comes for the old
                # one (an engine that had read the ADD before Redis went) is dropped, never mixed in.
                if mb is not None and mb.engine_id == engine_id and not mb.lost_with_redis:
                    self._route_locked(mb, out)
            for result in outs.utility_results:
                call = self._calls.pop(result.call_id, None)
                if call is not None:
                    call[1].put(result)

    def _record_gap_locked(self, engine_id: str, missing: int) -> None:
        victims = [mb for mb in self._requests_locked() if mb.engine_id == engine_id and not mb.lost_with_redis]
        logger.warning("client %s: %d message(s) from engine %s were lost; failing its %d request(s)",
                       self._client_id, missing, engine_id, len(victims))
        for mb in victims:
            self._fail_locked(mb, ErrorCode.OUTPUT_LOST, f"{missing} output message(s) from engine {engine_id} were lost")
        self._fail_calls_locked(engine_id, f"output message(s) from engine {engine_id} were lost")

    def _route_locked(self, mb: Mailbox, out: RequestOutput) -> None:
        index = mb.routes.get(out.request_id)
        if index is not None:  # a continuation: sequence `index` of the original request
            out.request_id, out.index = mb.request_id, index
        if out.error_code is ErrorCode.ENGINE_FAILED:
            mb.engine_error = out.error_message or ""  # the request may still resume: the liveness check decides
            self._declare_gone_locked(mb.engine_id, mb.incarnation, "engine_failed")
            return
        if out.new_token_ids:
            mb.delivered.setdefault(out.index, []).extend(out.new_token_ids)
        mb.got_output = True
        if out.finish_reason is not None:
            mb.finished_indices.add(out.index)
        last = out.error_code is not None or len(mb.finished_indices) >= mb.n
        mb.outputs.put((out, last))
        if last:
            self._finish_locked(mb)
        elif out.handoff:  # its prefill engine is done with it: the maintenance thread moves it now
            mb.handoff_pending = True
            self._liveness_due.set()

    # ----------------------------------------------------------------- utility calls

    def add_call(self, call_id: str, engine_id: str) -> queue.SimpleQueue:
        """Expect the answer to utility call `call_id` from `engine_id`; it arrives in the returned queue."""
        answer: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._calls[call_id] = (engine_id, answer)
        return answer

    def forget_call(self, call_id: str) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    # ----------------------------------------------------------------- engines

    def note_incarnation(self, engine_id: str, incarnation: str | None) -> None:
        """Work goes to `engine_id` as `incarnation`: a new one restarts its seq numbering (the requests of
        the old one are dealt with by the liveness check)."""
        if incarnation is None:
            return
        with self._lock:
            if self._incarnations.get(engine_id) != incarnation:
                self._incarnations[engine_id] = incarnation
                self._last_seq.pop(engine_id, None)

    def gone_engines(self) -> list[str]:
        """Engines declared gone before their registration says so: never chosen for new work."""
        with self._lock:
            return list(self._gone)

    def declare_gone(self, engine_id: str, incarnation: str | None, reason: str) -> None:
        """`engine_id` (as `incarnation`) is gone for `reason`, unless it was declared gone already (the first
        reason stays); the maintenance thread checks liveness at once."""
        with self._lock:
            self._declare_gone_locked(engine_id, incarnation, reason)

    def _declare_gone_locked(self, engine_id: str, incarnation: str | None, reason: str) -> None:
        self._gone.setdefault(engine_id, (incarnation, reason))
        self._liveness_due.set()

    def withdraw_exited(self, engines: Iterable[tuple[str, str]]) -> None:
        """These (engine, incarnation) have a presence subscriber again: forget their engine_exited verdict."""
        with self._lock:
            for engine_id, incarnation in engines:
                if self._gone.get(engine_id) == (incarnation, "engine_exited"):
                    del self._gone[engine_id]

    def presence_targets(self) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        """(engine, incarnation) pairs whose presence matters: those requests in flight are on, and those
        declared engine_exited (to notice they are back)."""
        with self._lock:
            used = {(mb.engine_id, mb.incarnation) for mb in self._requests_locked() if mb.incarnation is not None}
            exited = {(e, inc) for e, (inc, reason) in self._gone.items() if reason == "engine_exited"}
        return used, exited

    def take_liveness_due(self) -> bool:
        """True (once) if an engine was declared gone since the last call."""
        if not self._liveness_due.is_set():
            return False
        self._liveness_due.clear()  # a verdict landing now is seen by the check that follows
        return True

    def collect_orphans(self, live: Mapping[str, dict[str, Any]], resubmit_limit: int,
                        resume_blocker: Callable[[Mailbox], str | None]) -> Orphans:
        """Sort out the requests of engines that are not in `live` (the registry's live engines) as their
        incarnation, or declared gone: re-place those with no output yet (up to `resubmit_limit` times),
        resume started ones that `resume_blocker` lets move, and fail the rest (engine_gone, or the engine's
        engine_failed error). Verdicts the registry now agrees with are dropped; the calls and seq numbering
        of engines gone or restarted are ended. Requests lost with Redis come back as `resend` (no output yet)
        or `resume` with reason `REDIS_LOST` (started)."""
        orphans = Orphans()
        with self._lock:
            declared = dict(self._gone)  # the verdicts, kept for the reasons below even when the registry caught up
            for engine_id, (incarnation, _) in list(self._gone.items()):
                if live.get(engine_id, {}).get("incarnation") != incarnation:
                    del self._gone[engine_id]  # deregistered, declared dead or restarted: the registry knows now
            live = {e: info for e, info in live.items() if e not in self._gone}
            for engine_id, incarnation in list(self._incarnations.items()):
                if live.get(engine_id, {}).get("incarnation") != incarnation:
                    del self._incarnations[engine_id]
                    self._last_seq.pop(engine_id, None)
                    self._fail_calls_locked(engine_id, f"engine {engine_id} is gone")
            for mb in self._requests_locked():
                if mb.lost_with_redis:
                    if mb.got_output:
                        orphans.resume.append((mb, REDIS_LOST))
                    else:
                        orphans.resend.append(mb)
                    continue
                if mb.handoff_pending:
                    orphans.resume.append((mb, HANDOFF))
                    continue
                if mb.engine_id in live and live[mb.engine_id].get("incarnation") == mb.incarnation:
                    continue
                if not mb.got_output and mb.resubmits < resubmit_limit:
                    orphans.replace.append(mb)
                elif mb.got_output and (blocker := resume_blocker(mb)) is None:
                    mb.gone_reason = mb.gone_reason or self._gone_reason(mb, live, declared)
                    orphans.resume.append((mb, mb.gone_reason))
                else:
                    self._fail_gone_locked(mb, blocker if mb.got_output else None)
        return orphans

    @staticmethod
    def _gone_reason(mb: Mailbox, live: Mapping[str, Any], declared: Mapping[str, Verdict]) -> str:
        """Why `mb`'s engine counts as gone: engine_exited, engine_failed, engine_restarted or heartbeat_expired.
        `declared` is the verdicts as they were before this check pruned those the registry now agrees with."""
        if mb.engine_error is not None:
            return "engine_failed"
        verdict = declared.get(mb.engine_id)
        if verdict is not None and verdict[0] == mb.incarnation:
            return verdict[1]
        return "engine_restarted" if mb.engine_id in live else "heartbeat_expired"

    def _fail_gone_locked(self, mb: Mailbox, blocker: str | None) -> None:
        if mb.engine_error is not None:
            self._fail_locked(mb, ErrorCode.ENGINE_FAILED, mb.engine_error, abort=False)
            return
        why = f"; not resumed: {blocker}" if blocker else ""
        self._fail_locked(mb, ErrorCode.ENGINE_GONE, f"engine {mb.engine_id} is gone{why}", abort=False)

    # ----------------------------------------------------------------- moving requests

    def re_place(self, mb: Mailbox, engine_id: str, incarnation: str | None, after_outage: bool) -> bool:
        """Point `mb` (no output yet) at `engine_id`; after a Redis outage it also gets a fresh id (`~rN`) and
        its old id is ABORTed (deferred) on its old engine. False if `mb` ended meanwhile."""
        with self._lock:
            if mb.done:
                return False
            old, old_id = mb.engine_id, mb.request_id
            self._released(old)
            mb.engine_id, mb.incarnation = engine_id, incarnation
            mb.resubmits += 1
            mb.orphaned_at = None
            mb.engine_error = mb.gone_reason = None
            if after_outage:
                self._unroute_locked(mb)
                mb.add = dataclasses.replace(mb.add, request_id=f"{old_id.split('~r')[0]}~r{mb.resubmits}")
                mb.routes = {mb.request_id: None}
                mb.lost_with_redis = False
                self._mailboxes[mb.request_id] = mb
                self._pending_aborts.setdefault(old, set()).add(old_id)
            self._placed(engine_id)
            return True

    def move_to_continuations(self, mb: Mailbox, engine_id: str, incarnation: str | None,
                              handoff: bool = False) -> Continuation | None:
        """Resume `mb` on `engine_id`: end the sequences the caller stopped, build the ADDs that continue the
        running ones (`broker.client.request_resume`) and route `mb` under their ids only, in one step (late outputs
        for the old ids are dropped). None if `mb` ended (or had to fail: it cannot be continued), or, for a
        `handoff`, if it was handed over already."""
        with self._lock:
            if mb.done or (handoff and not mb.handoff_pending):
                return None
            if handoff:
                mb.handoff_pending = False
                mb.handoffs += 1
            old, old_ids = mb.engine_id, list(mb.routes)
            self._end_abandoned_locked(mb)
            if mb.done:
                return None
            try:
                adds = continuation_adds(mb.add, mb.delivered, mb.running, mb.migrations + 1)
            except ValueError as e:  # a sequence with no budget left that did not finish: never expected
                self._fail_locked(mb, ErrorCode.ENGINE_GONE, f"engine {old} is gone and the request cannot resume: {e}",
                                  abort=False)
                return None
            self._unroute_locked(mb)
            mb.routes = {rid: index for rid, (index, _) in adds.items()}
            for rid in mb.routes:
                self._mailboxes[rid] = mb
            self._released(old)
            mb.engine_id, mb.incarnation = engine_id, incarnation
            self._placed(engine_id)
            mb.migrations += 1
            mb.lost_with_redis = False
            mb.orphaned_at = None
            mb.engine_error = mb.gone_reason = None
            return Continuation(old, old_ids, adds)

    def park(self, mb: Mailbox, replace_wait: float) -> bool:
        """No engine can take `mb` now: it waits (True the first time), until `replace_wait` s have passed
        since then (no_engine)."""
        now = time.monotonic()
        with self._lock:
            if mb.done:
                return False
            if mb.orphaned_at is None:
                mb.orphaned_at = now
                return True
            if now - mb.orphaned_at >= replace_wait:
                self._fail_locked(mb, ErrorCode.NO_ENGINE, f"engine {mb.engine_id} is gone and no engine became "
                                  f"ready within {replace_wait:.0f} s", abort=False)
            return False

    # ----------------------------------------------------------------- deferred ABORTs

    def defer_aborts(self, engine_id: str, request_ids: Iterable[str]) -> None:
        """ABORT these wire ids on `engine_id` later (Redis did not take them now)."""
        with self._lock:
            self._pending_aborts.setdefault(engine_id, set()).update(request_ids)

    def take_deferred_aborts(self) -> dict[str, set[str]]:
        """The deferred ABORTs by engine, handed over (give back with `defer_aborts` what cannot go)."""
        with self._lock:
            pending, self._pending_aborts = self._pending_aborts, {}
            return pending

    # ----------------------------------------------------------------- ending requests (under the lock)

    def _requests_locked(self) -> list[Mailbox]:
        """Each request in flight once (a resumed one sits under several wire ids)."""
        return list(dict.fromkeys(self._mailboxes.values()))

    def _unroute_locked(self, mb: Mailbox) -> None:
        for rid in mb.routes:
            if self._mailboxes.get(rid) is mb:
                del self._mailboxes[rid]

    def _finish_locked(self, mb: Mailbox) -> None:
        if mb.done:
            return
        mb.done = True
        self._unroute_locked(mb)
        self._released(mb.engine_id)

    def _fail_locked(self, mb: Mailbox, code: ErrorCode, detail: str, abort: bool = True) -> None:
        if mb.done:
            return
        mb.outputs.put((RequestOutput.failure(mb.request_id, code, detail), True))
        self._finish_locked(mb)
        if abort:
            self._pending_aborts.setdefault(mb.engine_id, set()).update(mb.routes)

    def _expire_locked(self, mb: Mailbox) -> None:
        self._fail_locked(mb, ErrorCode.DEADLINE_EXCEEDED, f"request {mb.request_id} ran past its deadline")

    def _end_aborted_locked(self, mb: Mailbox) -> None:
        if mb.done:
            return
        mb.outputs.put((RequestOutput(mb.request_id, 0, [], FinishReason.ABORT), True))
        self._finish_locked(mb)

    def _end_abandoned_locked(self, mb: Mailbox) -> None:
        """Sequences the caller stopped (a stop string) are not continued: end them here."""
        for index in sorted(mb.abandoned - mb.finished_indices):
            mb.finished_indices.add(index)
            last = len(mb.finished_indices) >= mb.n
            mb.outputs.put((RequestOutput(mb.request_id, index, [], FinishReason.ABORT), last))
            if last:
                self._finish_locked(mb)

    def _fail_calls_locked(self, engine_id: str | None, detail: str) -> None:
        for call_id, (owner, answer) in list(self._calls.items()):
            if engine_id is None or owner == engine_id:
                del self._calls[call_id]
                answer.put(UtilityResult(call_id, None, make_error(ErrorCode.ENGINE_GONE, detail)))
