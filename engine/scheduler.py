"""Continuous-batching scheduler: token budget, chunked prefill, FCFS, preemption by recompute.

Each step gives every running request its next tokens (one for a decode, a chunk for a prefill) within
``max_num_batched_tokens``, then admits waiting requests while budget, ``max_num_seqs`` and KV blocks
allow. When a running request cannot get a block, the latest-admitted running request is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed (its prefix-cached
blocks usually make that cheap). No waiting request is admitted in a step that preempted. A request whose
prefix is being loaded from the KV tier (``WAITING_FOR_KV``, ``engine.kv_tier``) keeps its place in the queue
but is passed over until its blocks are in.

Steps in flight (pipeline parallelism keeps one per stage): a request scheduled in a step is in flight
until ``update_from_output`` of that step; ``schedule`` skips it (its next tokens depend on that step) and
never picks it as a preemption victim (its blocks are being written). With P > 1 batches in flight a batch
takes at most ceil(min(running + waiting, max_num_seqs) / P) requests, so the requests split into P
batches that take turns through the pipeline instead of one batch that leaves the other stages idle.

Async scheduling (``async_scheduling``: the engine schedules and launches step N + 1 while step N runs on the
device): a request whose one in-flight step samples its next token runs ahead, into the next step, with
that token as a placeholder (one new token at the position after its known ones; the model runner feeds
it on the device from step N's sampled tokens). It does not run ahead, and waits for its step like any
in-flight request, when that step's token is its last by length (max_tokens, the model's context) or when
its next step depends on the token on the host: a structured-output grammar, or penalties over the
generated tokens. A stop token found in step N's output finishes the request then; the token its step
N + 1 sampled is dropped (step N + 1 computed the stop token's KV into the request's own blocks, which
are freed after step N + 1 was launched, so any later writer runs after it on the device).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.structured_output import grammar_finished
from protocol.step_types import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SampledToken,
    SchedulerOutput,
)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_batches_in_flight: int = 1  # the pipeline's stages: each batch takes about 1/P of the requests
    async_scheduling: bool = False  # requests run ahead into the next step (module docstring)


@dataclass
class TokenUpdate:
    """What one step did for one request: its new token (if any) and whether it finished."""

    request: Request
    token: SampledToken | None
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: Iterable[int]):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: list[str] = []
        self._known_to_runner: set[str] = set()
        self._in_flight: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt has {request.num_tokens} tokens; the model's context is "
                             f"{self.config.max_model_len} tokens and at least one must be generated")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is not None and not request.status.finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        budget = self.config.max_num_batched_tokens
        max_seqs = self._batch_seq_limit()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(out.num_scheduled_tokens) < max_seqs:
            request = self.running[i]
            ahead = request.num_in_flight_steps > 0
            if ahead and not self._runs_ahead(request):
                i += 1
                continue
            # Tokens past what is computed or being computed; running ahead, the one its step is sampling.
            num_new = min(request.num_tokens + ahead - request.num_computed_tokens - request.num_in_flight_tokens,
                          budget)
            while not self.block_manager.allocate_slots(request, request.num_in_flight_tokens + num_new):
                victim = self._preemption_victim(out)
                if victim is None:  # every other request is in flight or in this step: wait for a step to end
                    i += 1
                    break
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._record(out, request, num_new, [])
                budget -= num_new
                i += 1
        if not preempted:
            budget = self._admit_waiting(out, budget, max_seqs)
        return out

    def _runs_ahead(self, request: Request) -> bool:
        """Whether an in-flight request goes into the next step too (see the module docstring)."""
        params = request.params
        return (self.config.async_scheduling and request.num_in_flight_steps == 1
                and request.num_computed_tokens + request.num_in_flight_tokens == request.num_tokens
                and (params.max_tokens is None or request.num_output_tokens + 1 < params.max_tokens)
                and request.num_tokens + 1 < self.config.max_model_len
                and request.grammar is None and not params.needs_penalties and not request.handoff)

    def _batch_seq_limit(self) -> int:
        """The most requests one batch may take (see the module docstring)."""
        depth = self.config.max_batches_in_flight
        if depth == 1:
            return self.config.max_num_seqs
        wanted = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-wanted // depth))

    def _preemption_victim(self, out: SchedulerOutput) -> Request | None:
        """The latest-admitted running request neither in flight nor already in this step (``out``), or None.
        Without async scheduling the request being scheduled is always a candidate, so there is one."""
        return next((r for r in reversed(self.running)
                     if not r.num_in_flight_steps and r.request_id not in out.num_scheduled_tokens), None)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, max_seqs: int) -> int:
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(out.num_scheduled_tokens) < max_seqs):
            index = next((i for i, r in enumerate(self.waiting) if r.status != RequestStatus.WAITING_FOR_KV), None)
            if index is None:
                break  # every waiting request is having its prefix loaded (engine.kv_tier)
            request = self.waiting[index]
            computed = self._cached_prefix(request)
            num_computed = request.num_computed_tokens + len(computed) * self.block_manager.block_size
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(request, num_new, computed):
                break
            del self.waiting[index]
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._record(out, request, num_new, computed)
            budget -= num_new
        return budget

    def _cached_prefix(self, request: Request) -> list[int]:
        """Prefix-cache blocks to reuse; none for a request that wants prompt logprobs (as vLLM), since
        those need the logits at every prompt position."""
        if request.num_computed_tokens != 0 or request.params.prompt_logprobs is not None:
            return []
        return self.block_manager.get_computed_blocks(request)

    def _record(self, out: SchedulerOutput, request: Request, num_new: int, computed: list[int]) -> None:
        """Put the request in the step (what the runner needs to know of it) and in flight."""
        out.num_scheduled_tokens[request.request_id] = num_new
        num_computed = request.num_computed_tokens + request.num_in_flight_tokens  # this step's first position
        request.num_in_flight_steps += 1
        request.num_in_flight_tokens += num_new
        self._in_flight[request.request_id] = request
        if request.request_id not in self._known_to_runner:
            self._known_to_runner.add(request.request_id)
            out.new_requests.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling=request.params,
                block_ids=list(request.block_ids),
                num_computed_tokens=request.num_computed_tokens,
            ))
            request.num_blocks_sent = len(request.block_ids)
            return
        resumed = request.num_blocks_sent < 0
        start = 0 if resumed else request.num_blocks_sent
        out.cached_requests.append(CachedRequestData(request.request_id, request.block_ids[start:], num_computed,
                                                     resumed))
        request.num_blocks_sent = len(request.block_ids)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_blocks_sent = -1
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[TokenUpdate]:
        """Advance computed tokens, append sampled tokens, apply stop rules, free finished requests."""
        updates = []
        for req_id, num_new in sched.num_scheduled_tokens.items():
            request = self._in_flight.get(req_id) or self.requests.get(req_id)
            if request is not None and request.num_in_flight_steps:
                request.num_in_flight_steps -= 1
                request.num_in_flight_tokens -= num_new
                if not request.num_in_flight_steps:
                    self._in_flight.pop(req_id, None)
            if request is None or request.status.finished:
                continue
            request.num_computed_tokens += num_new
            # Before a stop can free the blocks: what this step completed stays in the prefix cache even when
            # it is the request's last step (a one-token request still caches its prompt).
            self.block_manager.cache_full_blocks(request)
            token = result.sampled.get(req_id)
            if token is not None:
                request.append_output_token(token.token_id)
                status = self._check_stop(request, token.token_id)
                if status is None and request.grammar is not None and grammar_finished(
                        request.grammar, token.token_id, self.eos_token_ids):
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    self._finish(request, status)
                updates.append(TokenUpdate(request, token, request.status.finished))
        return updates

    def finish_handoff(self, request: Request) -> None:
        """End a prefill-only request after its first token (``Request.handoff``): freed, its blocks cached."""
        self._finish(request, RequestStatus.FINISHED_HANDOFF)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_req_ids.append(request.request_id)
