"""The API server's settings, checked once (ValueError says what to fix)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field


@dataclass
class ApiConfig:
    """Settings of one API deployment (shared by every gunicorn worker).

    `served_model_names` defaults to the basename of `model`; requests may also name the model by
    the `model` path as given. `api_key` None leaves the /v1 routes open.
    """

    model: str
    redis_url: str
    served_model_names: list[str] = field(default_factory=list)
    key_prefix: str = "rs"
    api_key: str | None = None
    max_queued_requests: int = 1024
    request_timeout: float = 600.0
    max_body_bytes: int = 32 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ValueError("a Redis URL is required: pass --redis-url or set REDSERVE_REDIS_URL")
        if not os.path.isdir(self.model):
            raise ValueError(f"--model {self.model!r} is not a directory")
        if not os.path.isfile(os.path.join(self.model, "tokenizer.json")):
            raise ValueError(f"--model {self.model!r} has no tokenizer.json (the API needs a fast tokenizer)")
        if not self.served_model_names:
            self.served_model_names = [os.path.basename(os.path.normpath(self.model))]
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be at least 1")
        if self.request_timeout <= 0:
            raise ValueError("--request-timeout must be positive")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be at least 1024")

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
                   max_queued_requests=args.max_queued_requests, request_timeout=args.request_timeout,
                   max_body_bytes=args.max_body_bytes)
