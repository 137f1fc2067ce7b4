"""Runs the model for one scheduler step on one rank: builds inputs, runs the forward pass over the
paged KV cache, samples. Owns the weights and the KV cache of its rank.

Under pipeline parallelism a runner holds one stage: the KV cache of its layers only, the hidden stream
in from the previous stage and out to the next (``worker.pipeline.StageLink``); only the last stage
samples. The other stages never see sampled tokens, so each step brings them the tokens sampled for its
requests since they were last scheduled (``new_token_ids``, kept by the executor).

On CUDA (Triton attention, one pipeline stage, no ``--enforce-eager``) decode-only steps replay a CUDA
graph captured per batch bucket once the KV cache exists (``worker.cuda_graphs``); prefill and mixed
steps run eagerly, and so do logits and sampling.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from protocol.step_types import ModelRunnerOutput, SchedulerOutput
from worker import kv_block_copy
from worker.config import EngineConfig
from worker.cuda_graphs import CudaGraph, GraphRunner, capture_sizes, graphs_off_reason
from worker.device_memory import DeviceMemory, device_memory_for, kv_cache_budget
from worker.input_batch import PLACEHOLDER_TOKEN, InputBatch, PendingToken, PromptLogprobRows
from worker.kernels import available_extensions, load_extension
from worker.layers import attention
from worker.model_loader import ModelLoadError, build_model, eos_token_ids, load_config
from worker.parallel_state import pp_group, tp_group
from worker.pipeline import StageLink
from worker.sampler import SampledBatch, Sampler, prompt_logprob_entries
from worker.transfer import to_device

logger = logging.getLogger(__name__)
_PROMPT_LOGPROB_ROWS = 512


@dataclass
class PendingStep:
    """A submitted step whose tokens are not read back: the sampled requests, where each one's placeholder
    sits in its ``token_ids``, and the samples on their way to the host (None: the step samples nothing)."""

    states: list = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    samples: SampledBatch | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.hf_config = load_config(config.model)
        choice = config.dtype_choice(getattr(self.hf_config, "dtype", None)
                                     or getattr(self.hf_config, "torch_dtype", None))
        self.dtype = choice.dtype
        if tp_group().rank == 0 and pp_group().is_first:  # one line per engine, not per rank
            logger.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), choice.reason)
            if choice.warning:
                logger.warning(choice.warning)
        self.max_model_len = self._max_model_len()
        started = time.perf_counter()
        self.model = build_model(config.model, self.hf_config, self.dtype, self.device, self.max_model_len,
                                 gguf_file=config.quantized_gguf_file, int8=config.quantization == "int8")
        logger.info("loaded %s (%s, %s) in %.2fs", config.model, self.dtype, self.device,
                    time.perf_counter() - started)
        hf = self.hf_config
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.num_kv_heads = (hf.num_key_value_heads or hf.num_attention_heads) // tp_group().size
        self.eos_token_ids = eos_token_ids(config.model, hf)
        self.input_batch = InputBatch(config.block_size, self.device,
                                      hf.num_attention_heads // (hf.num_key_value_heads or hf.num_attention_heads),
                                      self.eos_token_ids)
        self.sampler = Sampler(self.device)
        if self.device.type == "cpu":  # build (or find in the cache) the C++ kernels now, before READY
            for name in available_extensions():
                load_extension(name)
        if self.input_batch.use_kernel:
            self.input_batch.kernel_prefill_max_queries = attention.kernel_prefill_max_queries(self.model, self.dtype)
        self.num_layers = len(self.model.layer_range)  # this stage's
        self.link = StageLink(hf.hidden_size, self.dtype, self.device) if pp_group().size > 1 else None
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: GraphRunner | None = None
        self.memory: DeviceMemory | None = device_memory_for(self.device)

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ModelLoadError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

    @property
    def kv_bytes_per_block(self) -> int:
        layers = self.num_layers
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * layers * self.config.block_size * self.num_kv_heads * self.head_dim * elem

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the KV budget: the CPU byte budget, or free device memory after a profile run."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.memory is not None:
            budget = self._profiled_kv_budget(self.memory)
        else:
            budget = self.config.kv_cache_memory
        return max(int(budget // self.kv_bytes_per_block), 0)

    def _profiled_kv_budget(self, memory: DeviceMemory) -> int:
        """Profile one step at the full token budget over a probe cache just big enough for it, then
        size the real cache from what the device has left (``worker.device_memory``)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        probe_blocks = -(-tokens // self.config.block_size) + 1
        memory.reset_peak()
        self._allocate_kv_cache(probe_blocks)
        self.profile_run(tokens)
        self.kv_caches = []
        memory.release_cached()
        snapshot = memory.snapshot()
        budget = kv_cache_budget(snapshot, self.config.gpu_memory_utilization, probe_blocks * self.kv_bytes_per_block)
        logger.info("KV cache budget %.2f GiB (device total %.2f GiB, free %.2f GiB, profile peak %.2f GiB)",
                    budget / 2**30, snapshot.total / 2**30, snapshot.free / 2**30, snapshot.torch_peak / 2**30)
        return budget

    def profile_run(self, num_tokens: int) -> None:
        from protocol.sampling_params import SamplingParams
        from protocol.step_types import NewRequestData
        blocks = list(range(-(-num_tokens // self.config.block_size)))
        req = NewRequestData("__profile__", [0] * num_tokens, [], SamplingParams(max_tokens=1), blocks, 0)
        self.execute_model(SchedulerOutput(new_requests=[req], num_scheduled_tokens={"__profile__": num_tokens}))
        self.input_batch.requests.pop("__profile__", None)

    def init_kv_cache(self, num_blocks: int) -> None:
        min_blocks = -(-self.max_model_len // self.config.block_size)
        if num_blocks < min_blocks and self.config.num_kv_blocks is None:
            more = "--gpu-memory-utilization" if self.memory is not None else "the KV memory"
            raise ModelLoadError(
                f"the KV cache budget holds {num_blocks * self.config.block_size} tokens, fewer than "
                f"max_model_len {self.max_model_len}; raise {more} or lower --max-model-len")
        self._allocate_kv_cache(num_blocks)
        reason = graphs_off_reason(device=self.device, enforce_eager=self.config.enforce_eager,
                                   use_triton=self.input_batch.use_triton,
                                   pipeline_parallel_size=pp_group().size)
        if reason is not None:
            if self.device.type == "cuda":
                logger.info("CUDA graphs off (%s): every step runs eagerly", reason)
            return
        try:
            self.capture_graphs()
        except Exception:  # noqa: BLE001 - a capture that fails leaves the engine serving eagerly
            logger.exception("CUDA graph capture failed; every step runs eagerly")
            self.graph_runner = None

    def capture_graphs(self, backend: type = CudaGraph, sizes: list[int] | None = None) -> GraphRunner:
        """Capture the decode graphs over the current KV cache (``worker.cuda_graphs``); the CPU tests pass
        the eager stand-in as ``backend``."""
        kernels = attention.triton_attention()
        kv_heads, longest = self.num_kv_heads, self.max_model_len

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_caches, meta)

        runner = GraphRunner(
            forward, sizes=sizes or capture_sizes(self.config.max_num_seqs),
            max_blocks=-(-longest // self.config.block_size), block_size=self.config.block_size,
            hidden_size=self.hf_config.hidden_size, dtype=self.dtype, device=self.device, max_seq_len=longest,
            num_splits=lambda size: kernels.choose_num_splits(size * kv_heads, longest, self.device),
            backend=backend, logits=self.model.compute_logits, vocab_size=self.hf_config.vocab_size)
        runner.capture()
        self.graph_runner = runner
        return runner

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.graph_runner = None  # its graphs bind the old cache's addresses
        self.kv_caches = []
        shape = (2, num_blocks * self.config.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]

    def kv_layout(self) -> dict:
        """What decides the bytes of this rank's KV blocks (the KV tier's namespace)."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads * tp_group().size, "head_size": self.head_dim,
                "block_size": self.config.block_size}

    def start_kv_read(self, block_ids: list[int]) -> kv_block_copy.ReadBlocks:
        """Start copying whole KV blocks to the host (the KV tier's pieces, ``worker.kv_block_copy``)."""
        return kv_block_copy.start_read(self.kv_caches, block_ids, self.config.block_size)

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """This rank's piece of each block, as bytes (the form a worker process replies in)."""
        return [bytes(piece) for piece in self.start_kv_read(block_ids).pieces()]

    def write_kv_blocks(self, block_ids: list[int], pieces_by_rank: list[list[bytes]]) -> None:
        """Fill whole KV blocks with this rank's pieces (``pieces_by_rank[tp rank][i]`` for block i)."""
        kv_block_copy.write(self.kv_caches, block_ids, self.config.block_size, pieces_by_rank[tp_group().rank])

    def execute_model(self, sched: SchedulerOutput,
                      new_token_ids: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """One step, start to end. ``new_token_ids``: tokens sampled (by the last pipeline stage) for requests
        of this step since this stage last saw them; the last stage sampled them itself and ignores them."""
        return self.collect_step(self.submit_step(sched, new_token_ids))

    @torch.inference_mode()
    def submit_step(self, sched: SchedulerOutput,
                    new_token_ids: dict[str, list[int]] | None = None) -> PendingStep:
        """Launch one step: inputs up, forward, sampling, and the copy of the tokens down, without waiting for
        the device. Each sampled request gets a placeholder token until ``collect_step``; a request that runs
        ahead into the next step (async scheduling) gets that token fed on the device
        (``_feed_placeholders``)."""
        self.input_batch.update(sched)
        if new_token_ids and not pp_group().is_last:
            for req_id, tokens in new_token_ids.items():
                self.input_batch.requests[req_id].token_ids.extend(tokens)
        if sched.is_empty:
            return PendingStep()
        inputs = self.input_batch.prepare(sched)
        self._feed_placeholders(inputs)
        graphed = self.link is None and self.graph_runner is not None and self.graph_runner.can_run(inputs)
        hidden = self._forward(inputs)
        if hidden is None:
            return PendingStep()
        for rows in inputs.prompt_rows:
            self._accumulate_prompt_logprobs(hidden, rows)
        if not inputs.sampled_states:
            return PendingStep()
        batch = self.input_batch.sampling_batch(inputs.sampled_states)
        if sched.grammar_bitmasks:
            batch.grammar_bitmasks = [sched.grammar_bitmasks.get(s.req_id) for s in inputs.sampled_states]
        if graphed and self.graph_runner.logits is not None:  # decode-only: every row samples, in order
            logits = self.graph_runner.logits[:len(inputs.sampled_states)]
        else:
            logits = self.model.compute_logits(hidden[inputs.logits_indices], float32=not batch.plain_greedy)
        samples = self.sampler.sample(logits, batch)
        samples.start_copy()
        step = PendingStep(inputs.sampled_states, [len(s.token_ids) for s in inputs.sampled_states], samples)
        for row, state in enumerate(inputs.sampled_states):
            state.pending = PendingToken(len(state.token_ids), samples, row)
            state.token_ids.append(PLACEHOLDER_TOKEN)
        return step

    def collect_step(self, step: PendingStep) -> ModelRunnerOutput:
        """Wait for a submitted step's tokens and put them in place of its placeholders."""
        if step.samples is None:
            return ModelRunnerOutput()
        tokens = step.samples.tokens()
        for state, position, token in zip(step.states, step.positions, tokens, strict=True):
            state.token_ids[position] = token.token_id
            if state.pending is not None and state.pending.position == position:
                state.pending = None
            if state.wants_prompt_logprobs:
                token.prompt_logprobs = state.prompt_logprobs or []
                state.prompt_logprobs, state.prompt_logprobs_sent = None, True
        return ModelRunnerOutput({s.req_id: t for s, t in zip(step.states, tokens, strict=True)})

    def _feed_placeholders(self, inputs) -> None:
        """Rows whose input token is still a placeholder take it from the device tensor it was sampled into."""
        by_samples: dict[int, tuple[SampledBatch, list[int], list[int]]] = {}
        for row, pending in inputs.placeholders:
            _, rows, sources = by_samples.setdefault(id(pending.samples), (pending.samples, [], []))
            rows.append(row)
            sources.append(pending.row)
        for samples, rows, sources in by_samples.values():
            index = to_device(sources, torch.long, self.device)
            inputs.input_ids[to_device(rows, torch.long, self.device)] = samples.token_ids[index]

    def _forward(self, inputs) -> torch.Tensor | None:
        """This stage's layers; the final hidden stream on the last stage, None on the others (their
        output went to the next stage)."""
        if self.link is None:
            if self.graph_runner is not None and self.graph_runner.can_run(inputs):
                return self.graph_runner.run(inputs)
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        pp = pp_group()
        intermediate = None if pp.is_first else self.link.receive(inputs.input_ids.shape[0])
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, intermediate)
        if pp.is_last:
            return out
        self.link.send(*out)
        return None

    def _accumulate_prompt_logprobs(self, hidden: torch.Tensor, rows: PromptLogprobRows) -> None:
        """Logits over this chunk's prompt positions (only for requests that asked), kept until the
        prompt's last chunk, whose output carries them."""
        entries = rows.state.prompt_logprobs or []
        for first in range(0, len(rows.hidden_indices), _PROMPT_LOGPROB_ROWS):  # bounds the [rows, vocab] tensors
            part = slice(first, first + _PROMPT_LOGPROB_ROWS)
            index = torch.tensor(rows.hidden_indices[part], dtype=torch.long, device=hidden.device)
            logits = self.model.compute_logits(hidden[index])
            entries += prompt_logprob_entries(logits, rows.next_token_ids[part], rows.state.params.prompt_logprobs)
        rows.state.prompt_logprobs = entries

    def info(self) -> dict:
        """What the engine needs to know about the model (sent back over the response queue)."""
        return {"max_model_len": self.max_model_len, "eos_token_ids": list(self.eos_token_ids),
                "vocab_size": self.hf_config.vocab_size}
