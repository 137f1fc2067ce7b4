"""``redserve redis-cli``: plain `redis-cli` on the stack's Redis, authenticated, with no secret on argv.

Rules:
- The Redis URL comes from ``--redis-url``, else ``$REDSERVE_REDIS_URL``, else the running ``redserve
  serve``'s stack file (`common.stack_state`); ``--admin`` takes the stack's admin URL instead (the
  embedded server's operator user, which may run CONFIG, FLUSHDB, SHUTDOWN, ...).
- A ``redis+sentinel://`` URL is resolved to the primary the sentinels name now (`broker.connection.primary_url`):
  redis-cli talks to one server. A ``redis+cluster://`` URL becomes its first node, with ``-c`` (redis-cli
  follows the cluster's redirections).
- The password reaches redis-cli in ``REDISCLI_AUTH`` (`redserve.redis_server.redis_cli_invocation`), never
  on its command line; everything after the options is passed to redis-cli as is (a command, or nothing
  for its prompt). The process is replaced by redis-cli (exec), so its exit code is redis-cli's.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=os.environ.get("REDSERVE_REDIS_URL"),
                        help="Redis URL (default: $REDSERVE_REDIS_URL, else the running `redserve serve`)")
    parser.add_argument("--admin", action="store_true",
                        help="connect as the embedded Redis's admin user (from the running `redserve serve`)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="a redis-cli command and its arguments")


def resolve_url(args: argparse.Namespace) -> str:
    """The URL to connect to, by the module's precedence; SystemExit with the reason when there is none."""
    from common.stack_state import read_stack_state

    if args.admin:
        stack = read_stack_state()
        if stack is None or not stack.admin_redis_url:
            sys.exit("redserve redis-cli --admin: no running `redserve serve` with an embedded Redis on this "
                     "machine (the admin user exists only there)")
        return stack.admin_redis_url
    if args.redis_url:
        return args.redis_url
    stack = read_stack_state()
    if stack is None:
        sys.exit("redserve redis-cli: pass --redis-url (or set REDSERVE_REDIS_URL): no running `redserve serve` "
                 "found on this machine")
    return stack.redis_url


def run_from_args(args: argparse.Namespace) -> int:
    import redis

    from broker.connection import is_cluster_url, primary_url
    from redserve.redis_server import redis_cli_invocation

    try:
        resolved = resolve_url(args)
        url = primary_url(resolved)
    except redis.RedisError as e:
        sys.exit(f"redserve redis-cli: no sentinel named the primary: {e}")
    argv, extra_env = redis_cli_invocation(url)
    if is_cluster_url(resolved):
        argv.append("-c")  # follow MOVED redirections to the node that owns a key
    os.execve(argv[0], [*argv, *args.args], {**os.environ, **extra_env})
    return 1  # not reached
