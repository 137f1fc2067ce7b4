"""Command-line options of ``redserve api``.

Rules:
- Importing this module is cheap (argparse and os only): ``redserve.cli`` imports it to build its parser.
- Environment defaults: ``REDSERVE_REDIS_URL``, ``REDSERVE_API_KEY``, ``REDSERVE_KEY_PREFIX``.
- ``--log-level`` defaults to ``argparse.SUPPRESS`` so that ``redserve --log-level DEBUG api ...``
  (the top-level option) is not overwritten by a subcommand default.
- ``--served-model-name`` defaults to the basename of ``--model``; requests may name the model by
  any served name or by the ``--model`` path itself.
"""

from __future__ import annotations

import argparse
import os


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
    parser.add_argument("--threads", type=int, default=64,
                        help="threads per worker = concurrent requests (and streams) per worker")
    parser.add_argument("--api-key", default=os.environ.get("REDSERVE_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: $REDSERVE_API_KEY)")
    parser.add_argument("--max-queued-requests", type=int, default=1024,
                        help="requests in flight per API process before answering 429")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may run before it is failed and aborted")
    parser.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                        help="largest request body accepted (413 above)")
    parser.add_argument("--log-level", default=argparse.SUPPRESS,
                        help="logging level (default: the top-level --log-level, else INFO)")
