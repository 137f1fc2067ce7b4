"""EngineCore: the scheduler, the KV block manager and an executor, stepped by its caller.

``add_request`` and ``abort_request`` may be called between steps; ``step()`` runs one
schedule -> execute -> update cycle and returns one ``RequestOutput`` (the broker's wire type, so the
engine process sends it as is) per sequence that produced a token or finished. A request with n > 1 runs as n child sequences; the first computes the prompt
and the others start once its full blocks are in the prefix cache, so they share them.

Batch queue (pipeline parallelism, async scheduling): the executor may take up to ``max_in_flight`` steps
at once (one per pipeline stage; two under async scheduling). While there is room, ``step()`` schedules a
new batch and submits it, returning nothing yet; once the queue is full (or nothing new can be scheduled)
it waits for the oldest batch and applies its output. The new batch holds the requests not already in
flight, and under async scheduling also those that run ahead (``engine.scheduler``), so the device runs
step N + 1 while the host applies step N's output. With one stage and no async scheduling this is
exactly schedule -> execute -> update.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.kv_tier import open_kv_tier
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_metrics import StepMetrics
from engine.structured_output import LLMatcher, StructuredOutputs
from protocol.engine_load import EngineLoad
from protocol.messages import RequestOutput
from protocol.request_ids import sequence_id
from protocol.sampling_params import SamplingParams
from protocol.step_types import SchedulerOutput
from worker.config import EngineConfig
from worker.executor import Executor, make_executor

logger = logging.getLogger(__name__)
KV_WAIT = 0.005  # seconds an engine with only KV-tier lookups to wait for sleeps on them per step


@dataclass
class EngineStats:
    load: EngineLoad  # waiting, running, KV usage, step: the figures every tier shares
    num_kv_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    generated_tokens: int
    prompt_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    histograms: dict = field(default_factory=dict)  # engine.step_metrics.StepMetrics.wire()
    kv_tier: dict | None = None  # engine.kv_tier.KVTier.stats(), when the engine has a tier


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, dp_rank: int = 0, rendezvous=None):
        self.config = config
        self.executor = executor or make_executor(config, dp_rank, rendezvous)
        self.num_kv_blocks = self.executor.num_kv_blocks
        self.max_model_len = self._usable_model_len(self.executor.max_model_len)
        self.vocab_size = self.executor.vocab_size
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.enable_chunked_prefill,
                            1 if self.executor.overlaps_steps else self.executor.max_in_flight,
                            async_scheduling=self.executor.overlaps_steps),
            self.block_manager, self.executor.eos_token_ids)
        self.children: dict[str, list[str]] = {}
        self.held_siblings: dict[str, list[Request]] = {}
        self.in_flight: deque[SchedulerOutput] = deque()
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.metrics = StepMetrics()
        self.kv_tier = open_kv_tier(config, self.executor, self.block_manager) if config.kv_tier_url else None
        self._handed_off: queue.SimpleQueue[list[RequestOutput]] = queue.SimpleQueue()  # filled by the tier's thread
        self.structured = StructuredOutputs(config.model, self.vocab_size, list(self.executor.eos_token_ids))
        logger.info("async scheduling %s", "on: the next step is launched before the last one's tokens are back"
                    if self.executor.overlaps_steps else "off: one step at a time")

    def _usable_model_len(self, model_len: int) -> int:
        """The longest sequence this engine can always finish: one that fits the whole KV pool and,
        without chunked prefill, one step's token budget (a longer one could never be scheduled)."""
        limits = {"the model": model_len, "the KV cache": self.num_kv_blocks * self.config.block_size}
        if not self.config.enable_chunked_prefill:
            limits["max_num_batched_tokens (chunked prefill is off)"] = self.config.max_num_batched_tokens
        source, usable = min(limits.items(), key=lambda item: item[1])
        if usable < model_len:
            logger.warning("max_model_len lowered from %d to %d to fit %s", model_len, usable, source)
        return usable

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, handoff: bool = False) -> None:
        """Queue a request. Raises ValueError (nothing queued) for a bad prompt or a duplicate id. ``handoff``:
        prefill it only (``protocol.messages.AddRequest.handoff``; ignored without a KV tier or with n > 1)."""
        if request_id in self.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; at least one token is required")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids out of range [0, {self.vocab_size}): {bad_stops[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the model's context is "
                             f"{self.max_model_len} tokens and at least one must be generated")
        arrival_time = time.time() if arrival_time is None else arrival_time
        if params.n == 1:
            kids = [Request(request_id, prompt_token_ids, params, arrival_time)]
        else:
            kids = [Request(sequence_id(request_id, i, params.n), prompt_token_ids, params.for_child(i), arrival_time,
                            parent_id=request_id, index=i) for i in range(params.n)]
        if params.structured_output is not None:
            for kid in kids:  # one matcher per sequence; raises ValueError if the grammar does not compile
                kid.grammar = self.structured.matcher(params.structured_output)
        self.children[request_id] = [k.request_id for k in kids]
        self.metrics.on_queued(self.children[request_id])
        self.prompt_tokens += len(prompt_token_ids)
        kids[0].handoff = handoff and params.n == 1 and self.kv_tier is not None
        self.scheduler.add_request(kids[0])
        if self.kv_tier is not None:
            self.kv_tier.lookup(kids[0])
        if len(kids) > 1 and self.config.enable_prefix_caching:
            self.held_siblings[kids[0].request_id] = kids[1:]
        else:
            for kid in kids[1:]:
                self.scheduler.add_request(kid)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (by the id given to ``add_request``); unknown ids are ignored."""
        outputs = []
        for request_id in request_ids:
            kid_ids = self.children.pop(request_id, [])
            if not kid_ids:
                continue
            self.metrics.forget(kid_ids)
            held = self.held_siblings.pop(kid_ids[0], [])
            aborted = self.scheduler.abort_requests(kid_ids) + held
            for req in aborted:
                req.status = RequestStatus.FINISHED_ABORTED
                outputs.append(self._output(req, [], None))
        return outputs

    def abort_sequence(self, request_id: str, index: int) -> list[RequestOutput]:
        """Abort one of the n sequences of a request (e.g. it hit a stop string); the others go on.
        Returns its "abort" output, or nothing if that sequence is unknown or already finished."""
        kids = self.children.get(request_id, [])
        kid_id = sequence_id(request_id, index, len(kids))
        if kid_id not in kids:
            return []
        aborted = self.scheduler.abort_requests([kid_id])
        self.metrics.forget([kid_id])
        for held in self.held_siblings.values():
            aborted += [r for r in held if r.request_id == kid_id]
            held[:] = [r for r in held if r.request_id != kid_id]
        self._forget_child(request_id, kid_id)
        for req in aborted:
            req.status = RequestStatus.FINISHED_ABORTED
        return [self._output(req, [], None) for req in aborted]

    def has_unfinished_requests(self) -> bool:
        return bool(self.children) or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        """Submit a new batch when the executor has room; apply the oldest batch's output once it is full or
        nothing new was scheduled (see the module docstring). May return nothing while work remains."""
        outputs = self._take_handed_off()
        if self.kv_tier is not None:
            self.kv_tier.apply_loaded(self.scheduler.requests)
        if len(self.in_flight) < self.executor.max_in_flight:
            sched = self.scheduler.schedule()
            if not sched.is_empty or sched.finished_req_ids:
                self.metrics.on_scheduled(sched.num_scheduled_tokens)
                sched.grammar_bitmasks = self.structured.bitmasks(self._constrained_rows(sched))
                self.executor.submit_step(sched)
                self.in_flight.append(sched)
                if not sched.is_empty and len(self.in_flight) < self.executor.max_in_flight:
                    return outputs
        if not self.in_flight:
            if self.kv_tier is not None and self.kv_tier.has_pending and not outputs:
                self.kv_tier.wait(KV_WAIT)  # nothing to run until a prefix is in or a handoff stored: do not spin
            return outputs
        sched = self.in_flight.popleft()
        result = self.executor.collect_step()
        self.steps += 1
        updates = self.scheduler.update_from_output(sched, result)
        handoffs = []
        self.generated_tokens += len(updates)
        on_token = self.metrics.on_token
        for update in updates:
            request, token = update.request, update.token
            out = self._output(request, [token.token_id], token.logprobs, token.prompt_logprobs)
            if request.handoff and not update.finished:
                self.scheduler.finish_handoff(request)  # its blocks stay cached; the tier gets them just below
                out.handoff = True
                handoffs.append(out)
                on_token(request.request_id, True)
                continue
            outputs.append(out)
            on_token(request.request_id, update.finished)
            if update.finished:
                self._forget_child(request.parent_id, request.request_id)
        if self.kv_tier is not None:
            self.kv_tier.save_computed()
            if handoffs:  # answered once the tier holds the prompt's blocks, so the decode engine finds them
                self.kv_tier.after_stored(lambda outs=handoffs: self._handed_off.put(outs))
        if self.held_siblings:
            self._release_siblings()
        return outputs

    def _take_handed_off(self) -> list[RequestOutput]:
        """The handoff outputs whose blocks the tier has stored since the last step (see ``AddRequest.handoff``)."""
        outputs = []
        while not self._handed_off.empty():
            for out in self._handed_off.get():
                self._forget_child(out.request_id, out.request_id)
                outputs.append(out)
        return outputs

    def _constrained_rows(self, sched: SchedulerOutput) -> list[tuple[str, LLMatcher]]:
        """(req_id, matcher) of the structured-output sequences that sample a token this step."""
        rows = []
        for req_id, num_new in sched.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.grammar is not None and req.num_computed_tokens + num_new >= req.num_tokens:
                rows.append((req_id, req.grammar))
        return rows

    def _output(self, req: Request, tokens: list[int], logprobs: list | None,
                prompt_logprobs: list | None = None) -> RequestOutput:
        # positional: this runs once per sequence per step (RequestOutput's field order)
        return RequestOutput(req.parent_id, req.index, tokens, req.status.finish_reason, req.stop_reason,
                             len(req.prompt_token_ids), max(req.num_cached_tokens, 0),
                             None if logprobs is None else [logprobs], None, prompt_logprobs)

    def _forget_child(self, parent_id: str, kid_id: str) -> None:
        kids = self.children.get(parent_id)
        if kids is None or kid_id not in kids:
            return
        kids.remove(kid_id)
        if not kids:
            del self.children[parent_id]

    def _release_siblings(self) -> None:
        for first_id in list(self.held_siblings):
            first = self.scheduler.requests.get(first_id)
            if first is None or first.num_computed_tokens >= first.num_prompt_tokens:
                for sibling in self.held_siblings.pop(first_id):
                    self.scheduler.add_request(sibling)

    def load(self) -> EngineLoad:
        """The load figures now; held-back n > 1 siblings count as waiting."""
        held = sum(len(v) for v in self.held_siblings.values())
        return EngineLoad(waiting=self.scheduler.num_waiting + held, running=self.scheduler.num_running,
                          kv_usage=self.block_manager.usage, step=self.steps, ts=time.time())

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            load=self.load(), num_kv_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
            num_preemptions=self.scheduler.num_preemptions,
            generated_tokens=self.generated_tokens, prompt_tokens=self.prompt_tokens,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            histograms=self.metrics.wire(), kv_tier=None if self.kv_tier is None else self.kv_tier.stats())

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.kv_tier is not None:
            self.kv_tier.close()
        self.executor.shutdown()
