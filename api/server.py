"""``redserve api``: the Flask app under gunicorn, run programmatically.

Rules:
- `--workers` processes of the ``gthread`` worker class, `--threads` threads each; a request holds
  one thread while it runs (a stream: until its end). Gunicorn queues connections beyond the threads
  where nothing answers them, so the threads must outnumber the requests a worker admits: each
  worker admits `--max-concurrent-streams` slots (prompt x n; `api.state.InFlightLimiter`) and
  answers the rest 429 at once, and `--threads` defaults to that limit + `THREAD_RESERVE` (a value at
  or below the limit is a config error), so /health, /metrics and the 429s always find a thread.
  Workers x limit bounds the concurrent streams. Gunicorn's worker timeout is a liveness check of
  the worker's main loop (not of a request), so long streams are fine.
- The app is loaded in each worker after fork (no preload): its `ApiState`, the `BrokerClient`
  and every Redis connection belong to one process. post_worker_init subscribes the worker's
  client early; worker_exit stops it, failing and ABORTing what is still in flight.
- Before any worker starts, ``PROMETHEUS_MULTIPROC_DIR`` points at a fresh temp dir (removed at
  exit) so /metrics sums all workers; child_exit drops a dead worker's live gauges.
- Master and workers are titled ``redserve-api``. SIGTERM stops gracefully (requests in flight get
  `GRACEFUL_TIMEOUT` s), SIGINT/SIGQUIT quickly; gunicorn handles both. No gunicorn control socket.
- `run_api` returns the process exit code (config errors: 2, with the reason on stderr).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

from gunicorn.app.base import BaseApplication

from api.config import ApiConfig
from api.options import THREAD_RESERVE
from common.proctitle import set_title

logger = logging.getLogger(__name__)

TITLE = "redserve-api"
GRACEFUL_TIMEOUT = 15
WORKER_TIMEOUT = 60


class _GunicornApp(BaseApplication):
    """Gunicorn with options from a dict and an app built by `create_app` in each worker."""

    def __init__(self, config: ApiConfig, options: dict[str, Any]) -> None:
        self._config = config
        self._options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self._options.items():
            if key in self.cfg.settings and value is not None:
                self.cfg.set(key, value)

    def load(self):
        from api.app import create_app

        return create_app(self._config)


def _when_ready(server: Any) -> None:
    set_title(TITLE)
    logger.info("redserve API listening on %s with %d workers", ", ".join(map(str, server.LISTENERS)),
                server.num_workers)


def _pre_fork(server: Any, worker: Any) -> None:
    set_title(TITLE)  # in the master: gunicorn retitles it after when_ready, before spawning workers


def _post_worker_init(worker: Any) -> None:
    set_title(TITLE)
    state = worker.wsgi.extensions["redserve"]
    state.start()


def _worker_exit(server: Any, worker: Any) -> None:
    app = getattr(worker, "wsgi", None)
    state = app.extensions.get("redserve") if app is not None and hasattr(app, "extensions") else None
    if state is not None:
        state.stop()


def _child_exit(server: Any, worker: Any) -> None:
    from api.metrics import mark_worker_dead

    mark_worker_dead(worker.pid)


def worker_threads(args: argparse.Namespace) -> int:
    """`--threads`, or the in-flight limit + `THREAD_RESERVE`; ValueError if it leaves no spare thread."""
    limit = args.max_queued_requests
    threads = args.threads if args.threads is not None else limit + THREAD_RESERVE
    if threads <= limit:
        raise ValueError(f"--threads ({threads}) must exceed --max-concurrent-streams ({limit}): the spare threads "
                         "answer /health, /metrics and 429s while the admitted requests hold theirs")
    return threads


def gunicorn_options(args: argparse.Namespace, log_level: str) -> dict[str, Any]:
    return {
        "bind": f"{args.host}:{args.port}",
        "workers": args.workers,
        "worker_class": "gthread",
        "threads": worker_threads(args),
        "timeout": WORKER_TIMEOUT,
        "graceful_timeout": GRACEFUL_TIMEOUT,
        "keepalive": 5,
        "proc_name": TITLE,
        "loglevel": log_level.lower(),
        "errorlog": "-",
        "preload_app": False,
        "control_socket_disable": True,
        "when_ready": _when_ready,
        "pre_fork": _pre_fork,
        "post_worker_init": _post_worker_init,
        "worker_exit": _worker_exit,
        "child_exit": _child_exit,
    }


def run_api(args: argparse.Namespace) -> int:
    """Serve the API until SIGTERM/SIGINT; the exit code."""
    log_level = getattr(args, "log_level", None) or "INFO"
    logging.getLogger().setLevel(log_level.upper())
    try:
        config = ApiConfig.from_args(args)
        if args.workers < 1:
            raise ValueError("--workers must be at least 1")
        if not 0 <= getattr(args, "nice", 0) <= 19:
            raise ValueError(f"--nice must be 0 to 19, got {args.nice}")
        worker_threads(args)
    except ValueError as e:
        print(f"redserve api: {e}", file=sys.stderr)
        return 2
    if getattr(args, "nice", 0):
        os.nice(args.nice)  # the master before it forks: every worker inherits it
    set_title(TITLE)
    metrics_dir = tempfile.mkdtemp(prefix="redserve-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    master_pid = os.getpid()
    try:
        _GunicornApp(config, gunicorn_options(args, log_level)).run()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if os.getpid() == master_pid:  # workers leave through here too (gunicorn's sys.exit after fork)
            shutil.rmtree(metrics_dir, ignore_errors=True)
