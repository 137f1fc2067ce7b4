"""Where ``redserve serve`` records its running stack, so other commands on this machine find it.

An embedded Redis listens on a random port: ``redserve batch ...`` run in another terminal reads
the URL (and key prefix, model) from here.

Rules:
- The file is ``$REDSERVE_STATE_DIR/stack.json`` (default ``~/.cache/redserve/stack.json``):
  ``{"redis_url", "key_prefix", "model", "served_model_names", "pid", "admin_redis_url", "redis_nodes"}``
  (the admin URL only when ``serve`` started an embedded Redis; the nodes, each ``{"name", "role",
  "address", "pid", "running"}``, only for ``--redis-replicas``).
- The file holds the Redis URL with its password, so it is created with mode 0600 (and its directory,
  when created here, 0700).
- `write_stack_state` replaces it atomically (a file that cannot be written is a warning, not an
  error); `remove_stack_state` removes it only if this process wrote it (a second ``serve`` may
  have replaced it since).
- `read_stack_state` returns None when there is no file, it cannot be read, or the process that
  wrote it is gone (a ``serve`` killed with -9 cannot clean up).
- Precedence for a command that needs Redis: its ``--redis-url``, then ``$REDSERVE_REDIS_URL``,
  then this file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass
class StackState:
    redis_url: str
    key_prefix: str = "rs"
    model: str | None = None
    served_model_names: list[str] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)
    admin_redis_url: str | None = None  # the embedded Redis's operator user (`redserve redis-cli --admin`)
    redis_nodes: list[dict] = field(default_factory=list)  # --redis-replicas / --redis-cluster: the nodes


def state_path() -> Path:
    base = os.environ.get("REDSERVE_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "redserve")
    return Path(base) / "stack.json"


def write_stack_state(state: StackState) -> Path | None:
    """Record `state`; its path, or None (and a warning) if the file cannot be written."""
    path = state_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the mode applies only when created
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # left by a crashed writer with our pid: O_EXCL below must create it afresh
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(asdict(state)))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not record the stack in %s (%s): pass --redis-url to `redserve batch`", path, e)
        return None
    return path


def read_stack_state() -> StackState | None:
    try:
        data = json.loads(state_path().read_text(encoding="utf-8"))
        state = StackState(**data)
    except (OSError, ValueError, TypeError):
        return None
    return state if _running(state.pid) else None


def remove_stack_state() -> None:
    state = read_stack_state()
    if state is not None and state.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            state_path().unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
