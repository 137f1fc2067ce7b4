"""One streamed greedy completion of the tiny model in a thread, for the broker failover tests: its text, its
usage, an error event or exception, and the longest wait between two chunks once it started."""

from __future__ import annotations

import json
import threading
import time

import requests


class GreedyStream:
    def __init__(self, base_url: str, prompt: list[int], max_tokens: int) -> None:
        self.base_url, self.prompt, self.max_tokens = base_url, prompt, max_tokens
        self.text, self.usage, self.error, self.longest_gap = "", None, None, 0.0
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": "tiny-llama", "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with requests.post(f"{self.base_url}/v1/completions", json=body, stream=True, timeout=60) as resp:
                last = time.monotonic()
                for line in resp.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    now = time.monotonic()
                    if self.started.is_set():
                        self.longest_gap = max(self.longest_gap, now - last)
                    last = now
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]
                    for choice in chunk.get("choices", []):
                        self.text += choice.get("text", "")
                    self.usage = chunk.get("usage") or self.usage
                    self.started.set()
        except requests.RequestException as e:
            self.error = repr(e)

    def join(self) -> GreedyStream:
        self.thread.join(timeout=90)
        assert not self.thread.is_alive(), "a stream hung"
        return self

    @property
    def outcome(self) -> tuple:
        """(error, text, completion tokens): equal for two streams that ended alike."""
        return self.error, self.text, (self.usage or {}).get("completion_tokens")
