"""The ``--model`` argument of the engine, API and serve commands: checked, defaulted, converted.

Rules:
- A ``--model`` that is neither a directory nor an existing ``.gguf`` file ends the command with one line
  and exit code 1 (no traceback).
- No ``--model``: the tiny test model (random weights), created once in the cache, said in a warning.
- A GGUF ``--model`` is converted now, in a child process (so `serve` stays torch-free), so the processes
  started next find it cached; ``args.model`` keeps the GGUF path: it is the served name and every process
  resolves it alike.
- Imported by `redserve.cli` and `redserve.stack`; imports neither.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def resolve_model(args: argparse.Namespace) -> None:
    """Fill in the tiny test model when no --model is given; convert a GGUF --model now (in a child
    process, so `serve` stays torch-free) so the engines and API workers started next find it cached.
    ``args.model`` keeps the GGUF path: it is the served name and every process resolves it alike."""
    if args.model is not None:
        check_model_path(args)
        _convert_gguf(args)
    else:
        from worker.models.tiny_model import default_model_dir, ensure_default_model
        logging.getLogger("redserve").warning(
            "no --model given: serving the tiny test model (random weights) at %s", default_model_dir())
        args.model = str(ensure_default_model())


def check_model_path(args: argparse.Namespace) -> None:
    """Exit with one line (no traceback) when ``--model`` is neither a directory nor a ``.gguf`` file."""
    from common.model_source import is_gguf
    if args.model is None:
        return
    if is_gguf(args.model) and not os.path.isfile(args.model):
        sys.exit(f"redserve {args.command}: GGUF file not found: {args.model}")
    if not is_gguf(args.model) and not os.path.isdir(args.model):
        sys.exit(f"redserve {args.command}: --model {args.model!r} is not a directory or a GGUF file")


def _convert_gguf(args: argparse.Namespace) -> None:
    from common.model_source import convert_in_child, is_gguf, resolve_model_dir
    if is_gguf(args.model):
        try:
            resolve_model_dir(args.model, convert_in_child)
        except ValueError as e:
            sys.exit(f"redserve {args.command}: {e}")
