"""``redserve batch worker | submit | status | results | ping``.

Rules:
- Importing this module is cheap (argparse and os): ``redserve.cli`` imports it to build its parser.
- Redis is found by ``--redis-url``, else ``$REDSERVE_REDIS_URL``, else the state file of a running
  ``redserve serve`` (`common.stack_state`); the key prefix and model the same way (flag, env,
  state file, default). No Redis URL: exit code 2 with the reason on stderr.
- ``submit`` prints the batch id on stdout; with ``--output`` it then waits, drawing progress on
  stderr, writes the results there and exits 0 (1 if the batch could not finish in ``--timeout``).
- ``status`` prints "ID: STATUS, DONE/TOTAL done (FAILED failed)" or, with ``--json``, OpenAI's batch
  object. ``results`` writes the output lines (item order) to ``--output`` or stdout.
- Unknown batch id: exit code 1.
- ``ping`` (a healthcheck: docker-compose's batch worker) exits 0 when a batch worker of this host (its
  Celery node name ends in ``@<hostname>``; ``--any-host``: of any host) answers a Celery ping within
  ``--timeout`` seconds, printing its node name; 1 otherwise, with the reason on stderr. Only those workers
  are pinged, and the first answer ends the wait (a healthy check takes milliseconds, not the timeout).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, TextIO

from common.model_source import convert_in_child, resolve_model_dir


def _add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDSERVE_REDIS_URL"),
                   help="Redis URL (default: $REDSERVE_REDIS_URL, else the running `redserve serve`)")
    p.add_argument("--key-prefix", default=None,
                   help="Redis key prefix (default: $REDSERVE_KEY_PREFIX, else the running stack's, else rs)")


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``batch`` subcommands to `parser`."""
    sub = parser.add_subparsers(dest="batch_command", required=True)
    env = os.environ

    w = sub.add_parser("worker", help="run a Celery worker for batch jobs (never loads a model)")
    _add_redis_args(w)
    w.add_argument("--model", default=env.get("REDSERVE_MODEL"),
                   help="model directory, for its tokenizer and chat template (default: $REDSERVE_MODEL)")
    w.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) batch bodies may use, as the API's (default: the basename of --model)")
    w.add_argument("--concurrency", type=int, default=env.get("REDSERVE_BATCH_CONCURRENCY", 2),
                   help="worker processes, each running one chunk at a time (default 2)")
    w.add_argument("--visibility-timeout", type=float, default=env.get("REDSERVE_BATCH_VISIBILITY_TIMEOUT", 1200),
                   help="seconds before a chunk taken by a vanished worker is delivered again (default 1200)")
    w.add_argument("--request-timeout", type=float, default=600.0, help="seconds one item may generate")
    w.add_argument("--retry-for", type=float, default=300.0,
                   help="seconds an item keeps retrying 429/503 answers (no engine ready, ...)")

    s = sub.add_parser("submit", help="submit an OpenAI batch file (JSONL); prints the batch id")
    _add_redis_args(s)
    s.add_argument("input", help="JSONL file: custom_id, method, url, body per line ('-' for stdin)")
    s.add_argument("--output", default=None, help="wait for the batch and write its results to this file")
    s.add_argument("--chunk-size", type=int, default=32, help="items per Celery task (default 32)")
    s.add_argument("--ttl", type=float, default=7.0, help="days the batch and its results are kept (default 7)")
    s.add_argument("--timeout", type=float, default=None, help="with --output: seconds to wait at most")
    s.add_argument("--poll-interval", type=float, default=1.0, help=argparse.SUPPRESS)

    st = sub.add_parser("status", help="progress of a batch: done / failed / total")
    _add_redis_args(st)
    st.add_argument("batch_id")
    st.add_argument("--json", action="store_true", help="print the batch object as JSON")

    r = sub.add_parser("results", help="write a batch's output lines (OpenAI batch output format)")
    _add_redis_args(r)
    r.add_argument("batch_id")
    r.add_argument("--output", default=None, help="file to write (default: stdout)")
    r.add_argument("--wait", action="store_true", help="wait until the batch has completed")

    pg = sub.add_parser("ping", help="exit 0 if a batch worker of this host answers a Celery ping (a healthcheck)")
    _add_redis_args(pg)
    pg.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    pg.add_argument("--any-host", action="store_true", help="any batch worker of the stack, not only this host's")


def run_batch(args: argparse.Namespace) -> int:
    """Run a ``redserve batch`` subcommand; its exit code."""
    from api.batch.tasks import configure

    try:
        settings = _settings(args)
    except ValueError as e:
        print(f"redserve batch {args.batch_command}: {e}", file=sys.stderr)
        return 2
    configure(settings)
    command = {"worker": _worker, "submit": _submit, "status": _status, "results": _results,
               "ping": _ping}[args.batch_command]
    return command(args, settings)


def _settings(args: argparse.Namespace):
    from api.batch.tasks import BatchSettings
    from common.stack_state import read_stack_state

    stack = read_stack_state()
    redis_url = args.redis_url or (stack.redis_url if stack else None)
    from_stack = stack is not None and not args.redis_url
    prefix = args.key_prefix or os.environ.get("REDSERVE_KEY_PREFIX") or (stack.key_prefix if from_stack else "rs")
    extra: dict[str, Any] = {}
    if args.batch_command == "worker":
        if args.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        names = args.served_model_name or (stack.served_model_names if from_stack and not args.model else [])
        extra = dict(model=args.model or (stack.model if from_stack else None), served_model_names=names,
                     visibility_timeout=args.visibility_timeout, request_timeout=args.request_timeout,
                     retry_for=args.retry_for)
    return BatchSettings(redis_url=redis_url or "", key_prefix=prefix, **extra)


def _store(settings):
    from api.batch.store import BatchStore
    from broker.connection import connect

    return BatchStore(connect(settings.redis_url, client_name="redserve-batch-cli"), settings.keys)


def _worker(args: argparse.Namespace, settings) -> int:
    from api.batch.tasks import QUEUE, TITLE, app
    from common.proctitle import set_title

    try:
        settings.api_config()
        if not os.path.isfile(os.path.join(resolve_model_dir(settings.model, convert_in_child), "tokenizer.json")):
            raise ValueError(f"{settings.model} has no tokenizer.json: the batch worker needs its tokenizer")
    except ValueError as e:
        print(f"redserve batch worker: {e}", file=sys.stderr)
        return 2
    set_title(TITLE)
    app.conf.worker_hijack_root_logger = False  # `redserve` has configured logging already
    log_level = (getattr(args, "log_level", None) or "INFO").upper()
    argv = ["worker", f"--concurrency={args.concurrency}", "--pool=prefork", f"--loglevel={log_level}",
            f"--hostname={TITLE}-{os.getpid()}@%h", f"--queues={QUEUE}",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]
    try:
        app.worker_main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    return 0


def _submit(args: argparse.Namespace, settings) -> int:
    from api.batch.tasks import enqueue

    store = _store(settings)
    try:
        with _open_input(args.input) as lines:
            info = store.create(lines, chunk_size=args.chunk_size, ttl=max(1, int(args.ttl * 86400)),
                                input_file=os.path.basename(args.input))
    except (OSError, ValueError) as e:
        print(f"redserve batch submit: {e}", file=sys.stderr)
        return 2
    enqueue(info.id, range(info.num_chunks))
    print(info.id, flush=True)
    if args.output is None:
        return 0
    batch_id = info.id
    info = _wait(store, batch_id, args.timeout, args.poll_interval, sys.stderr)
    if info is None:
        print(f"redserve batch submit: batch {batch_id} disappeared from Redis", file=sys.stderr)
        return 1
    _write_results(store, info, args.output)
    print(f"batch {info.id}: {info.done}/{info.total} done ({info.failed} failed); results in {args.output}",
          file=sys.stderr)
    return 0 if info.status == "completed" else 1


def _ping(args: argparse.Namespace, settings) -> int:
    import socket

    from api.batch.tasks import TITLE, app

    host = socket.gethostname()
    pattern = f"{TITLE}-*" if args.any_host else f"{TITLE}-*@{host}"
    try:  # only the batch workers wanted are asked, and the first answer ends the wait
        replies = app.control.ping(timeout=args.timeout, pattern=pattern, matcher="glob", limit=1)
    except Exception as e:  # noqa: BLE001 - the broker unreachable: unhealthy, one line
        print(f"redserve batch ping: no answer ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    nodes = sorted(name for reply in replies for name in reply
                   if name.startswith(f"{TITLE}-") and (args.any_host or name.endswith(f"@{host}")))
    if not nodes:
        where = "any host" if args.any_host else host
        print(f"redserve batch ping: no batch worker of {where} answered within {args.timeout:g} s", file=sys.stderr)
        return 1
    print("\n".join(nodes))
    return 0


def _open_input(path: str) -> TextIO:
    return sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115 - used with `with`


def _status(args: argparse.Namespace, settings) -> int:
    import json

    info = _store(settings).info(args.batch_id)
    if info is None:
        print(f"redserve batch status: no batch {args.batch_id} (unknown, or expired)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info.to_dict()))
    else:
        print(f"{info.id}: {info.status}, {info.done}/{info.total} done ({info.failed} failed)")
    return 0


def _results(args: argparse.Namespace, settings) -> int:
    store = _store(settings)
    info = _wait(store, args.batch_id, None, 1.0, sys.stderr) if args.wait else store.info(args.batch_id)
    if info is None:
        print(f"redserve batch results: no batch {args.batch_id} (unknown, or expired)", file=sys.stderr)
        return 1
    if info.status != "completed":
        print(f"redserve batch results: batch {info.id} is {info.status}: {info.done} of {info.total} results "
              "so far", file=sys.stderr)
    _write_results(store, info, args.output)
    return 0


def _write_results(store, info, output: str | None) -> None:
    import json

    out = open(output, "w", encoding="utf-8") if output else sys.stdout  # noqa: SIM115 - closed below
    try:
        for line in store.results(info.id, info.total):
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    finally:
        if output:
            out.close()
        else:
            out.flush()


def _wait(store, batch_id: str, timeout: float | None, poll_interval: float, progress: TextIO):
    """Poll until the batch completes (or `timeout`), drawing a progress bar; the last BatchInfo."""
    deadline = None if timeout is None else time.monotonic() + timeout
    bar = ProgressBar(progress)
    while True:
        info = store.info(batch_id)
        if info is None:
            return None
        bar.show(info.done, info.failed, info.total)
        if info.status == "completed" or (deadline is not None and time.monotonic() > deadline):
            bar.close()
            return info
        time.sleep(poll_interval)


class ProgressBar:
    """``[#####.....] 25/50 done, 1 failed`` on a terminal (redrawn in place); elsewhere one line
    per change, at most every 5 seconds (and the last one always)."""

    WIDTH = 30

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last: tuple[int, int] | None = None
        self._last_at = 0.0
        self._pending = ""

    def show(self, done: int, failed: int, total: int) -> None:
        if (done, failed) == self._last:
            return
        self._last = (done, failed)
        filled = self.WIDTH * done // max(1, total)
        text = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} done, {failed} failed"
        if self.tty:
            self.stream.write(f"\r{text}")
            self.stream.flush()
        elif time.monotonic() - self._last_at >= 5 or done == total:
            self._write_line(text)
        else:
            self._pending = text

    def _write_line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last_at = time.monotonic()
        self._pending = ""

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
        elif self._pending:
            self._write_line(self._pending)
