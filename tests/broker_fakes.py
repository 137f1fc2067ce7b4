"""Fake engines and fixtures for the BrokerClient tests (tests/test_broker_client*.py): a real Redis (the
conftest fixtures), engines played by threads built on `broker.engine_link`.

Test modules import the fixtures they use (`cluster`, `engines`) along with the helpers.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import defaultdict

import pytest

from broker.client import BrokerClient
from broker.connection import connect
from broker.engine_link import EngineHeartbeat, EngineRegistry, OutputPublisher, RequestReader
from broker.engine_presence import EnginePresence
from protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    FinishReason,
    RequestOutput,
    UtilityCall,
    UtilityResult,
)
from protocol.sampling_params import SamplingParams

PROMPT_LEN = 3  # `add()` prompts: [first_token, 7, 7]
STALL_AFTER: dict[str, int] = {}  # request id -> tokens per sequence before it stalls (see `add`)


class FakeEngine:
    """Stands in for an engine process: every step gives each running sequence one token.

    Token k (1-based) of a request is prompt_token_ids[0] * 1000 + k. Params: max_tokens (default
    4), n; `STALL_AFTER` (set by `add(stall_after=...)`) stops a request after that many tokens, to keep it
    in flight.
    Utility methods: echo(*args) -> args, fail() -> error, stats() -> {"running": ...}.
    """

    def __init__(self, url, keys, engine_id, ttl=1.0, step_delay=0.002):
        self.engine_id = engine_id
        self.redis = connect(url, backoff_cap=0.1)
        self.registry = EngineRegistry(self.redis, keys)
        self.reader = RequestReader(self.redis, keys, engine_id, backoff_cap=0.1)
        self.publisher = OutputPublisher(self.redis, keys, engine_id, backoff_cap=0.1)
        self.heartbeat = EngineHeartbeat(self.registry, engine_id, ttl=ttl, interval=ttl / 10)
        self.step_delay = step_delay
        self.go = threading.Event()
        self.go.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.running: dict[str, dict] = {}
        self.utility: dict[str, list[UtilityResult]] = defaultdict(list)
        self.adds: list[str] = []
        self.aborts: list[str] = []

    def start(self, ready=True):
        self.reader.reset()
        self.registry.register(self.engine_id, {"dp_rank": 0, "tp": 1, "model": "fake"})
        self.heartbeat.start()
        if ready:
            self.registry.mark_ready(self.engine_id, num_kv_blocks=100, block_size=16, max_model_len=1024)
        self._thread.start()
        return self

    def crash(self):
        """Stop everything without deregistering: the heartbeat key will expire."""
        self._stop.set()
        self.heartbeat.stop()
        if self._thread.is_alive():
            self._thread.join()

    def stop(self):
        self.crash()
        with contextlib.suppress(Exception):
            self.registry.deregister(self.engine_id)
        self.redis.close()

    def _loop(self):
        while not self._stop.is_set():
            busy = bool(self.running) and self.go.is_set()
            for msg_id, msg in self.reader.read(block_ms=0 if busy else 20):
                self._handle(msg_id, msg)
            if (busy and self.running) or self.utility:
                self._step()

    def _handle(self, msg_id, msg):
        if isinstance(msg, AddRequest):
            if msg.request_id in self.running:
                return
            self.adds.append(msg.request_id)
            n = msg.params.n
            self.running[msg.request_id] = {"msg_id": msg_id, "add": msg, "made": [0] * n, "done": set()}
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.aborts.append(rid)
                state = self.running.pop(rid, None)
                if state is not None:
                    self.reader.ack([state["msg_id"]])
        elif isinstance(msg, UtilityCall):
            if msg.method == "echo":
                result = UtilityResult(msg.call_id, msg.args, None)
            elif msg.method == "stats":
                result = UtilityResult(msg.call_id, {"running": len(self.running)}, None)
            else:
                result = UtilityResult(msg.call_id, None, f"no such method {msg.method!r}")
            self.utility[msg.client_id].append(result)

    def _step(self):
        outputs: dict[str, list[RequestOutput]] = defaultdict(list)
        acks = []
        for rid, st in list(self.running.items()) if self.go.is_set() else []:
            add = st["add"]
            max_tokens = add.params.max_tokens
            stall = STALL_AFTER.get(rid)
            for i, made in enumerate(st["made"]):
                if i in st["done"] or (stall is not None and made >= stall):
                    continue
                made = st["made"][i] = made + 1
                finish = FinishReason.LENGTH if made >= max_tokens else None
                if finish:
                    st["done"].add(i)
                token = add.prompt_token_ids[0] * 1000 + made
                outputs[add.client_id].append(RequestOutput(rid, i, [token], finish, None, len(add.prompt_token_ids), 0))
            if len(st["done"]) == len(st["made"]):
                acks.append(st["msg_id"])
                del self.running[rid]
        clients = set(outputs) | set(self.utility)
        step = {c: EngineOutputs(self.engine_id, outputs[c], time.time(), self.utility.pop(c, [])) for c in clients}
        if step or acks:
            self.publisher.publish(step, acks, {"running": len(self.running)})
        time.sleep(self.step_delay)


@pytest.fixture
def cluster(redis_url, redis_keys):
    """Start fake engines and clients; everything is stopped after the test."""
    made = {"engines": [], "clients": []}

    class Cluster:
        url, keys = redis_url, redis_keys

        def engine(self, engine_id, **kw):
            ready = kw.pop("ready", True)
            eng = FakeEngine(redis_url, redis_keys, engine_id, **kw).start(ready=ready)
            made["engines"].append(eng)
            return eng

        def client(self, **kw):
            opts = dict(heartbeat_ttl=2.0, engine_refresh=0.05, liveness_interval=0.1, subscribe_timeout=3.0) | kw
            client = BrokerClient(redis_url, redis_keys, **opts)
            made["clients"].append(client)
            assert client.wait_subscribed(5)
            return client

    yield Cluster()
    for client in made["clients"]:
        client.stop()
    for eng in made["engines"]:
        eng.stop()


def add(first_token=1, deadline_in=None, stall_after=None, max_tokens=4, **params):
    """An AddRequest with a fresh id, prompt [first_token, 7, 7] and these sampling params (max_tokens 4 unless
    given); with `stall_after`, a `FakeEngine` stops the request after that many tokens per sequence."""
    deadline = None if deadline_in is None else time.time() + deadline_in
    request = AddRequest(uuid.uuid4().hex, "", [first_token, 7, 7], SamplingParams(max_tokens=max_tokens, **params),
                         time.time(), deadline)
    if stall_after is not None:
        STALL_AFTER[request.request_id] = stall_after
    return request


def collect(handle, timeout=5.0):
    """Every output of `handle` until it ends; AssertionError if that takes over `timeout` s."""
    outs = []
    end = time.monotonic() + timeout
    while not handle.finished:
        out = handle.get(timeout=max(0.0, end - time.monotonic()))
        if out is None:
            raise AssertionError(f"request {handle.request_id} timed out; got {outs}")
        outs.append(out)
    return outs


def fake_ready_engine(cluster, engine_id="e0"):
    """A registered, READY, heartbeating engine that reads nothing: the test publishes its outputs by hand.
    Returns the heartbeat (stop it at the end)."""
    registry = EngineRegistry(connect(cluster.url), cluster.keys)
    registry.register(engine_id, {})
    registry.mark_ready(engine_id, 10, 16, 128)
    return EngineHeartbeat(registry, engine_id, ttl=2.0, interval=0.2).start()


class ContinuingEngine(FakeEngine):
    """Sequence i of a request whose prompt starts with t goes t*1000 + 100*i + 1, + 2, ...; a prompt longer
    than `PROMPT_LEN` is a continuation: it goes on from its last token. `hold()` stops every output."""

    def __init__(self, *args, presence: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.presence = EnginePresence(args[0], args[1], args[2], lambda: self.incarnation) if presence else None
        self.incarnation = ""
        self.received: dict[str, AddRequest] = {}

    def start(self, ready=True):
        self.reader.reset()
        self.incarnation = self.registry.register(self.engine_id, {"dp_rank": 0, "tp": 1, "model": "fake",
                                                                    **({"presence": 1} if self.presence else {})})
        if self.presence:
            self.presence.start()
            assert self.presence.wait_subscribed(5)
        self.heartbeat.start()
        self.registry.mark_ready(self.engine_id, num_kv_blocks=100, block_size=16, max_model_len=1024)
        self._thread.start()
        return self

    def hold(self) -> None:
        self.go.clear()

    def crash(self):
        super().crash()
        if self.presence:
            self.presence.stop()  # as the kernel closing a killed process's socket

    def _handle(self, msg_id, msg):
        if isinstance(msg, AddRequest):
            self.received[msg.request_id] = msg
        super()._handle(msg_id, msg)

    def _step(self):
        outputs: dict[str, list[RequestOutput]] = defaultdict(list)
        acks = []
        for rid, st in list(self.running.items()) if self.go.is_set() else []:
            add_, prompt = st["add"], st["add"].prompt_token_ids
            params = add_.params
            for i, made in enumerate(st["made"]):
                if i in st["done"]:
                    continue
                made = st["made"][i] = made + 1
                start = prompt[-1] if len(prompt) > PROMPT_LEN else prompt[0] * 1000 + 100 * i
                finish = FinishReason.LENGTH if made >= params.max_tokens else None
                if finish:
                    st["done"].add(i)
                outputs[add_.client_id].append(RequestOutput(rid, i, [start + made], finish, None, len(prompt), 0))
            if len(st["done"]) == len(st["made"]):
                acks.append(st["msg_id"])
                del self.running[rid]
        step = {c: EngineOutputs(self.engine_id, outs, time.time()) for c, outs in outputs.items()}
        if step or acks:
            self.publisher.publish(step, acks, {"running": len(self.running)})
        time.sleep(self.step_delay)


@pytest.fixture
def engines(cluster):
    """`engines(engine_id, **kw)` starts a ContinuingEngine; all are stopped after the test."""
    made = []

    def start(engine_id, **kw):
        eng = ContinuingEngine(cluster.url, cluster.keys, engine_id, **kw).start()
        made.append(eng)
        return eng
    yield start
    for eng in made:
        eng.stop()
        if eng.presence:
            eng.presence.stop()
