"""The API server's settings, checked once (ValueError says what to fix)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from common.model_source import convert_in_child, resolve_model_dir


@dataclass
class ApiConfig:
    """Settings of one API deployment (shared by every gunicorn worker).

    `served_model_names` defaults to the basename of `model`; requests may also name the model by
    the `model` path as given. Overload (per API process): `max_queued_requests` in-flight slots
    (prompts x n) before 429; 429 too while every READY engine has `max_engine_waiting` requests
    waiting; 503 when the chosen engine's request stream holds `max_engine_backlog` messages. `api_key` None leaves every route open; with a key, every route but
    /health, /readyz and /livez needs it (and /metrics too unless `public_metrics`). `trust_request_chat_template` lets
    requests carry their own chat template (the caller's Jinja runs here). `tool_call_parser` and
    `enable_auto_tool_choice`: see `api.tools`. `max_migrations`: how many times a started request may
be resumed on another engine when its engine goes (`broker.client.migration`; 0: never). `generation_config`:
    see `api.generation_defaults`.
    """

    model: str
    redis_url: str
    served_model_names: list[str] = field(default_factory=list)
    key_prefix: str = "rs"
    api_key: str | None = None
    max_queued_requests: int = 64
    max_engine_waiting: int = 512
    max_engine_backlog: int = 10_000
    request_timeout: float = 600.0
    max_migrations: int = 2
    max_body_bytes: int = 32 * 1024 * 1024
    public_metrics: bool = False
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 2.0
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    generation_config: str = field(default_factory=lambda: os.environ.get("REDSERVE_GENERATION_CONFIG", "auto"))

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ValueError("a Redis URL is required: pass --redis-url or set REDSERVE_REDIS_URL")
        model_dir = resolve_model_dir(self.model, convert_in_child)  # a GGUF: converted once, cached
        if not os.path.isdir(model_dir):
            raise ValueError(f"--model {self.model!r} is not a directory or a GGUF file")
        if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            raise ValueError(f"--model {self.model!r} has no tokenizer.json (the API needs a fast tokenizer)")
        if not self.served_model_names:
            self.served_model_names = [os.path.basename(os.path.normpath(self.model))]
        if self.max_queued_requests < 1:
            raise ValueError("--max-concurrent-streams must be at least 1")
        if self.max_engine_waiting < 1 or self.max_engine_backlog < 1:
            raise ValueError("--max-engine-waiting and --max-engine-backlog must be at least 1")
        if self.request_timeout <= 0:
            raise ValueError("--request-timeout must be positive")
        if self.max_migrations < 0:
            raise ValueError("--max-migrations must be 0 (never resume) or more")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be at least 1024")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError("--generation-config must be auto or vllm")
        if self.chat_template_timeout <= 0:
            raise ValueError("--chat-template-timeout must be positive")
        from api.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @property
    def model_name(self) -> str:
        """The name reported in responses and /v1/models."""
        return self.served_model_names[0]

    def accepts_model(self, name: str | None) -> bool:
        """True for None (the default model), a served name or the --model path."""
        if name is None or name in self.served_model_names:
            return True
        return name == self.model or os.path.normpath(name) == os.path.normpath(self.model)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ApiConfig:
        return cls(model=args.model, redis_url=args.redis_url, served_model_names=list(args.served_model_name or []),
                   key_prefix=args.key_prefix, api_key=args.api_key or None,
                   max_queued_requests=args.max_queued_requests, max_engine_waiting=args.max_engine_waiting,
                   max_engine_backlog=args.max_engine_backlog, request_timeout=args.request_timeout,
                   max_migrations=getattr(args, "max_migrations", 2),
                   max_body_bytes=args.max_body_bytes,
                   public_metrics=args.public_metrics,
                   trust_request_chat_template=args.trust_request_chat_template,
                   chat_template_timeout=args.chat_template_timeout,
                   tool_call_parser=getattr(args, "tool_call_parser", None),
                   enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                   generation_config=getattr(args, "generation_config", "auto"))
