"""Command-line options of ``redserve api``.

Rules:
- Importing this module is cheap (argparse and os only): ``redserve.cli`` imports it to build its parser.
- Environment defaults: ``REDSERVE_REDIS_URL``, ``REDSERVE_API_KEY``, ``REDSERVE_KEY_PREFIX``; switches
  from ``REDSERVE_PUBLIC_METRICS``, ``REDSERVE_TRUST_REQUEST_CHAT_TEMPLATE`` and
  ``REDSERVE_ENABLE_AUTO_TOOL_CHOICE`` (1/true/yes turn them on); ``REDSERVE_TOOL_CALL_PARSER``.
- ``--log-level`` defaults to ``argparse.SUPPRESS`` so that ``redserve --log-level DEBUG api ...``
  (the top-level option) is not overwritten by a subcommand default.
- Overload, per worker process: ``--max-concurrent-streams`` (alias ``--max-queued-requests``) slots
  of prompt x n are admitted, the rest get 429 + Retry-After at once; gunicorn's ``--threads``
  default to that limit + `THREAD_RESERVE`, so a thread is always free for /health, /metrics and
  the 429s (``--threads`` at or below the limit is a config error). Workers x limit bounds the streams.
- ``--served-model-name`` defaults to the basename of ``--model``; requests may name the model by
  any served name or by the ``--model`` path itself.
"""

from __future__ import annotations

import argparse
import os

THREAD_RESERVE = 16  # gunicorn threads per worker beyond the in-flight limit: /health, /metrics, 429s


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the API server's options to `parser` (a ``redserve api`` subparser or a plain parser)."""
    model = os.environ.get("REDSERVE_MODEL")
    parser.add_argument("--model", required=model is None, default=model,
                        help="Hugging Face model directory: its tokenizer and chat template are used here "
                             "(default: $REDSERVE_MODEL)")
    parser.add_argument("--served-model-name", default=None, nargs="+",
                        help="model name(s) clients use (default: the basename of --model)")
    parser.add_argument("--redis-url", default=os.environ.get("REDSERVE_REDIS_URL"),
                        help="Redis URL of the broker (default: $REDSERVE_REDIS_URL)")
    parser.add_argument("--key-prefix", default=os.environ.get("REDSERVE_KEY_PREFIX", "rs"),
                        help="Redis key prefix shared with the engines (default: rs)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    parser.add_argument("--nice", type=int, default=int(os.environ.get("REDSERVE_API_NICE", "0")),
                        help="raise the API processes' niceness by this much (0-19) before the workers start, so that "
                             "on cores it shares with a CPU engine it does not preempt the engine's threads "
                             "(default: $REDSERVE_API_NICE, else 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="gunicorn threads per worker; must exceed --max-concurrent-streams so that /health, "
                             f"/metrics and 429 answers always find one (default: that limit + {THREAD_RESERVE})")
    parser.add_argument("--api-key", default=os.environ.get("REDSERVE_API_KEY"),
                        help="require `Authorization: Bearer KEY` on every route but /health, /readyz, /livez "
                             "(default: $REDSERVE_API_KEY)")
    parser.add_argument("--public-metrics", action="store_true", default=env_switch("REDSERVE_PUBLIC_METRICS"),
                        help="serve /metrics without the API key, e.g. to a Prometheus scraper on a trusted "
                             "network (default: $REDSERVE_PUBLIC_METRICS=1)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        default=env_switch("REDSERVE_TRUST_REQUEST_CHAT_TEMPLATE"),
                        help="render chat templates that requests carry ('chat_template'): the caller's Jinja "
                             "runs in the server; refused (400) without this flag "
                             "(default: $REDSERVE_TRUST_REQUEST_CHAT_TEMPLATE=1)")
    add_tool_args(parser)
    parser.add_argument("--generation-config", choices=["auto", "vllm"],
                        default=os.environ.get("REDSERVE_GENERATION_CONFIG", "auto"),
                        help="auto: requests that leave temperature, top_p, top_k, min_p or repetition_penalty "
                             "unset get the model's generation_config.json values (as vLLM); vllm: ignore the "
                             "file (default: $REDSERVE_GENERATION_CONFIG, else auto)")
    parser.add_argument("--chat-template-timeout", type=float, default=2.0,
                        help="seconds a chat template may render before the request is refused (400)")
    parser.add_argument("--max-concurrent-streams", "--max-queued-requests", dest="max_queued_requests", type=int,
                        default=64, help="generation slots in flight per API worker process, one per prompt x n "
                                         "(streamed or not); a request that does not fit gets 429 + Retry-After")
    parser.add_argument("--max-engine-waiting", type=int, default=512,
                        help="answer 429 while every READY engine has this many requests waiting to be scheduled")
    parser.add_argument("--max-engine-backlog", type=int, default=10_000,
                        help="answer 503 (engine_overloaded) when the chosen engine's request stream already holds "
                             "this many unread or in-flight requests (requests are never dropped unread)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may run before it is failed and aborted")
    parser.add_argument("--max-migrations", type=int, default=2,
                        help="times a started request (streamed or not) may be resumed on another engine when its "
                             "engine dies, from the tokens already delivered; 0 fails it with engine_gone instead")
    parser.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                        help="largest request body accepted (413 above)")
    parser.add_argument("--log-level", default=argparse.SUPPRESS,
                        help="logging level (default: the top-level --log-level, else INFO)")


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags (`api.tools`), shared by `redserve api` and `redserve serve`."""
    from api.tool_parsers import TOOL_PARSERS

    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                        default=os.environ.get("REDSERVE_TOOL_CALL_PARSER") or None,
                        help="the model's tool-call format, parsed into tool_calls for tool_choice 'auto' "
                             "(default: $REDSERVE_TOOL_CALL_PARSER)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        default=env_switch("REDSERVE_ENABLE_AUTO_TOOL_CHOICE"),
                        help="allow tool_choice 'auto' (needs --tool-call-parser; without it 'auto' is a 400, "
                             "as vLLM) (default: $REDSERVE_ENABLE_AUTO_TOOL_CHOICE=1)")


def env_switch(name: str) -> bool:
    """True when the environment variable `name` says yes (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
