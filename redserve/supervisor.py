"""Keeps the children of ``redserve serve`` running, and stops them in order within deadlines.

Rules:
- Every child runs in its own session (so a Ctrl-C on the terminal reaches only the launcher, which
  then stops the children in order) and gets PR_SET_PDEATHSIG (it dies with the launcher, even on
  ``kill -9``). Call `start` and `check` from the main thread: the kernel sends that signal when the
  *thread* that started the child exits.
- A child that exits on its own is restarted after a backoff: `RestartPolicy.initial_backoff`,
  doubling up to `max_backoff`; the backoff starts over once the child has stayed up `stable_after`
  seconds. Before the restart, whatever is left of its process group (gunicorn workers, Celery pool
  processes, TP workers) is SIGKILLed, so nothing orphaned holds its port or memory.
- A child that dies again after `max_restarts` restarts within `restart_window` seconds is in a crash
  loop: `check` raises `CrashLoop` and the caller stops the stack.
- Each death is logged (name, exit code or signal, uptime, restart number, backoff) and each restart
  calls `on_restart(name)` (the launcher counts them in Redis).
- `stop(groups)` stops the groups one after the other: SIGTERM to each child, then waits up to that
  child's `stop_timeout`; a child that misses it is named in the log and its whole process group is
  SIGKILLed. `force()` (a second Ctrl-C) makes a stop in progress SIGKILL everything left at once.
  Children whose restart was pending are not started again once a stop has begun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from redserve.redis_server import pdeathsig_preexec

logger = logging.getLogger("redserve.stack")

_POLL = 0.05


class CrashLoop(RuntimeError):
    """A child kept dying: restarted `max_restarts` times within `restart_window` seconds."""


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a dead child; see the module rules."""

    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    stable_after: float = 30.0
    max_restarts: int = 5
    restart_window: float = 60.0

    def __post_init__(self) -> None:
        if self.initial_backoff <= 0 or self.max_backoff < self.initial_backoff:
            raise ValueError("backoffs must be positive, with max_backoff >= initial_backoff")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.restart_window <= 0:
            raise ValueError(f"--restart-window must be positive, got {self.restart_window}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (0-based) of a run of quick deaths."""
        return min(self.max_backoff, self.initial_backoff * 2 ** min(attempt, 32))


@dataclass(frozen=True)
class ChildSpec:
    """How to start one child and how long it may take to stop."""

    name: str
    argv: list[str]
    env: dict[str, str]
    stop_timeout: float


@dataclass(eq=False)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    attempt: int = 0
    restarts: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def running(self) -> bool:
        return self.proc is not None


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def has_exited(proc: subprocess.Popen) -> bool:
    """True if `proc` has exited, WITHOUT reaping it: its pid (= its process group id) stays ours until
    `proc.wait()`, so killing the group first cannot hit an unrelated process that reused the id."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Supervisor:
    """The children of one stack; see the module rules."""

    def __init__(self, policy: RestartPolicy, on_restart: Callable[[str], None] = lambda name: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.children: list[Child] = []
        self._on_restart = on_restart
        self._clock = clock
        self._stopping = False
        self._forced = False

    def start(self, spec: ChildSpec) -> Child:
        child = Child(spec)
        self.children.append(child)
        self._spawn(child)
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def pids(self) -> dict[str, int]:
        """Name -> pid of every running child."""
        return {c.name: c.proc.pid for c in self.children if c.proc is not None}

    def check(self) -> None:
        """Reap children that died, restart those whose backoff is over; raise `CrashLoop`."""
        now = self._clock()
        for child in self.children:
            if child.proc is not None:
                if has_exited(child.proc):
                    self._on_death(child, now)
            elif child.restart_at is not None and now >= child.restart_at and not self._stopping:
                child.restarts.append(now)
                self._spawn(child)
                logger.warning("restarted %s (pid %d; restart %d within %.0f s)", child.name, child.proc.pid,
                               len(child.restarts), self.policy.restart_window)
                self._on_restart(child.name)

    def force(self) -> None:
        """Make a stop in progress (or the next one) SIGKILL everything left at once."""
        self._forced = True

    def stop(self, groups: Iterable[Iterable[str]]) -> None:
        """Stop the named groups of children in order, each within its children's deadlines."""
        self._stopping = True
        for group in groups:
            self._stop_group([self.child(name) for name in group if any(c.name == name for c in self.children)])
        self._stop_group([c for c in self.children if c.proc is not None])  # anything not named above

    # ------------------------------------------------------------------ internals

    def _spawn(self, child: Child) -> None:
        spec = child.spec
        child.proc = subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=pdeathsig_preexec())
        child.started_at = self._clock()
        child.restart_at = None

    def _reap(self, child: Child) -> int:
        """Kill what is left of the child's process group, reap the child; its exit code."""
        proc = child.proc
        _kill_group(proc.pid)
        code = proc.wait()
        child.proc = None
        return code

    def _on_death(self, child: Child, now: float) -> None:
        code = self._reap(child)
        if not self._stopping:
            self.plan_restart(child, code, now)

    def plan_restart(self, child: Child, code: int, now: float) -> None:
        """Set the restart time of a child that died with `code`, or raise `CrashLoop`; see the module rules.

        Also for a process that the caller starts itself (the embedded Redis): `child` is then only its record.
        """
        uptime = now - child.started_at
        policy = self.policy
        if uptime >= policy.stable_after:
            child.attempt = 0
        child.restarts = [t for t in child.restarts if now - t < policy.restart_window]
        if len(child.restarts) >= policy.max_restarts:
            raise CrashLoop(f"{child.name} {describe_exit(code)} after {uptime:.1f} s up, and it was restarted "
                            f"{len(child.restarts)} times within {policy.restart_window:.0f} s: it is in a crash "
                            f"loop (--max-restarts {policy.max_restarts}, --restart-window "
                            f"{policy.restart_window:.0f}); stopping the stack")
        backoff = policy.backoff(child.attempt)
        child.attempt += 1
        child.restart_at = now + backoff
        logger.error("%s %s after %.1f s up; restarting it in %.1f s (attempt %d; %d restarts within %.0f s)",
                     child.name, describe_exit(code), uptime, backoff, child.attempt, len(child.restarts),
                     policy.restart_window)

    def _stop_group(self, group: list[Child]) -> None:
        for child in group:
            child.restart_at = None
        live = [c for c in group if c.proc is not None]
        if not live:
            return
        if not self._forced:
            for child in live:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        start = self._clock()
        while live:
            if self._forced:
                logger.warning("forced stop: killing %s", ", ".join(c.name for c in live))
                for child in live:
                    self._reap(child)
                return
            for child in list(live):
                if has_exited(child.proc):
                    code = self._reap(child)
                    logger.info("%s stopped (%s)", child.name, describe_exit(code))
                    live.remove(child)
                elif self._clock() - start >= child.spec.stop_timeout:
                    logger.error("%s did not stop within %.0f s; killing it", child.name, child.spec.stop_timeout)
                    self._reap(child)
                    live.remove(child)
            if live:
                time.sleep(_POLL)
