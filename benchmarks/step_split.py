"""Where a decode step's time goes: matmuls, attention, and the rest, at batch 1 and batch 64.

    python benchmarks/step_split.py [--model DIR|FILE.gguf] [--dtype float32] [--batches 1,64] [--steps 8]
                                    [--quantization auto|none|gguf] [--prefill N]

``--prefill N`` splits prefill steps instead: each step takes N new prompts of ``--input-len`` tokens at once
(N x input_len must fit ``max_num_batched_tokens``, 2048 by default: 16 x 128), so what a served c=64 run spends
on its arrivals (each 128-token prompt's prefill stalls every stream in decode) is measured on its own.

Runs the engine in this process (``LLM``, in-process executor), brings B requests into decode, then
times a few ``EngineCore.step()`` calls plainly (the step ms) and once more under ``torch.profiler``
(CPU) to split them. Each labelled piece runs inside a ``record_function("split:<category>")`` range
put around it for the run only; every profiled op and every range's own Python time counts for the
innermost range around it.

Rules:
- Categories by the class of the module (or object) an op runs under: ``*Linear*`` modules and the LM
  head's ``compute_logits`` are ``matmul``; on the CPU kernel path (one flat loop of kernel calls, no module
  forwards: worker/models/llama_kernel_path.py) by the kernel called, its projections ``matmul``; the paged attention object (``worker.layers.attention``)
  is ``attention``; ``*Norm*`` norm, ``*Rotary*`` rope, ``*MLP*`` (what its linears leave: the
  activation and the gate*up) activation, ``*Embedding`` embedding; the runner's sampler is
  ``sampler``; ``InputBatch.update/prepare/sampling_batch`` are ``input prep``. The rest of the model
  call (residual adds, splits, views) is ``model other``, the rest of the step (scheduler, outputs)
  ``engine other``.
- Percentages come from the profiled steps (the profiler adds a few microseconds per op, so small-op
  categories read a little high); ms are those percentages of the unprofiled step time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

PREFIX = "split:"
STEP = "step"
MODEL_OTHER = "model other"
ENGINE_OTHER = "engine other"
ORDER = ["matmul", "attention", "norm", "rope", "activation", "embedding", "sampler", "input prep",
         MODEL_OTHER, ENGINE_OTHER]
SUBTOTALS = {"matmuls": ("matmul",), "attention": ("attention",)}


def module_category(module: nn.Module) -> str | None:
    """The category of a module by its class name (see the module rules); None for containers."""
    name = type(module).__name__
    for needle, category in (("Linear", "matmul"), ("LMHead", "matmul"), ("Norm", "norm"),
                             ("Rotary", "rope"), ("MLP", "activation"), ("Embedding", "embedding")):
        if needle in name:
            return category
    return None


def _labelled(fn: Callable, category: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(PREFIX + category):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def labels(llm) -> Iterator[None]:
    """Wrap the engine's pieces in ``record_function`` ranges for the duration of the block."""
    runner = llm.engine.executor.runner
    undo: list[Callable[[], None]] = []

    def patch(owner, attr: str, category: str) -> None:
        original = owner.__dict__.get(attr)
        setattr(owner, attr, _labelled(getattr(owner, attr), category))
        undo.append(lambda: setattr(owner, attr, original) if original is not None else delattr(owner, attr))

    for module in runner.model.modules():
        if module is runner.model.lm_head:
            patch(module, "compute_logits", "matmul")  # the LM head's matmul (forward is never called)
        elif (category := module_category(module)) is not None:
            patch(module, "forward", category)
    for cls in _attention_classes(runner.model):
        patch(cls, "forward" if issubclass(cls, nn.Module) else "__call__", "attention")
    patch(type(runner.sampler), "__call__", "sampler")
    patch(type(runner.sampler), "sample", "sampler")  # what the runner calls (submit_step)
    for attr in ("update", "prepare", "sampling_batch"):
        patch(runner.input_batch, attr, "input prep")
    for attr in ("execute_model", "submit_step", "collect_step"):  # the step runs submit + collect
        patch(runner, attr, MODEL_OTHER)
    for path in _kernel_paths(runner.model):
        undo.append(_label_kernel_path(path))
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


# The kernel path's direct kernel calls by category (worker/models/llama_kernel_path.py: its ``ops`` are the
# fused_ops kernel, its ``attention`` the paged-attention kernel; each layer's four projections are closures).
KERNEL_PATH_OPS = {"rms_norm": "norm", "fused_add_rms_norm": "norm", "rotary_embedding": "rope",
                   "silu_and_mul": "activation", "write_kv": "attention", "paged_attention": "attention"}
KERNEL_PATH_LINEARS = ("qkv", "o", "gate_up", "down")


class _LabelledKernels:
    """A kernel module whose functions named in ``KERNEL_PATH_OPS`` run inside their category's range."""

    def __init__(self, kernels) -> None:
        self._kernels = kernels

    def __getattr__(self, name: str):
        fn = getattr(self._kernels, name)
        return _labelled(fn, KERNEL_PATH_OPS[name]) if name in KERNEL_PATH_OPS else fn


def _kernel_paths(model: nn.Module) -> list:
    """The CPU kernel paths bound so far (a model binds its own at the first step the path serves)."""
    return [path for module in model.modules() if (path := module.__dict__.get("_kernel_path")) is not None]


def _label_kernel_path(path) -> Callable[[], None]:
    """Wrap a kernel path's kernels and projections in ranges (it calls no module forwards); returns the undo."""
    ops, attention = path.ops, path.attention
    linears = [(layer, name, getattr(layer, name)) for layer in path.layers for name in KERNEL_PATH_LINEARS]
    path.ops, path.attention = _LabelledKernels(ops), _LabelledKernels(attention)
    for layer, name, linear in linears:
        setattr(layer, name, _labelled(linear, "matmul"))

    def undo() -> None:
        path.ops, path.attention = ops, attention
        for layer, name, linear in linears:
            setattr(layer, name, linear)
    return undo


def _attention_classes(model: nn.Module) -> set[type]:
    """Classes of the paged-attention objects the model's layers hold (modules or plain callables)."""
    found = set()
    for module in model.modules():
        for value in vars(module).values():
            if type(value).__module__ == "worker.layers.attention" and callable(value):
                found.add(type(value))
        for child in module.children():
            if type(child).__module__ == "worker.layers.attention":
                found.add(type(child))
    return found


def split_events(events) -> dict[str, float]:
    """Microseconds per category from a profiler event list (``prof.events()``).

    Every event's self time goes to its innermost ``split:`` range (a range's own self time to
    itself); events outside any category range but inside a ``split:step`` range are engine other.
    Events outside every step range are ignored."""
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        category = _innermost_category(event)
        if category is None:
            continue
        totals[ENGINE_OTHER if category == STEP else category] += event.self_cpu_time_total
    return dict(totals)


def _innermost_category(event) -> str | None:
    node, category = event, None
    while node is not None:
        if node.name.startswith(PREFIX):
            category = category or node.name[len(PREFIX):]
            if node.name == PREFIX + STEP:
                return category
        node = node.cpu_parent
    return None


def format_split(batch: int, step_ms: float, totals: dict[str, float], kind: str = "decode") -> str:
    """A markdown table: one row per category (ms per step and % of the step), subtotals first."""
    whole = sum(totals.values()) or 1.0
    share = {c: totals.get(c, 0.0) / whole for c in ORDER}
    lines = [f"{kind} step split, batch {batch}: {step_ms:.2f} ms/step (unprofiled)", "",
             "| part | ms/step | % of step |", "|---|---:|---:|"]
    rest = 1.0 - sum(share[c] for cats in SUBTOTALS.values() for c in cats)
    rows = [(name, sum(share[c] for c in cats)) for name, cats in SUBTOTALS.items()]
    rows.append(("the rest", rest))
    rows += [(f"  {c}", share[c]) for c in ORDER if c not in ("matmul", "attention")]
    lines += [f"| {name} | {frac * step_ms:.2f} | {frac * 100:.1f} |" for name, frac in rows]
    return "\n".join(lines)


def decode_batch(llm, batch: int, input_len: int, max_tokens: int) -> list[str]:
    """Add ``batch`` random prompts and step until every one has its first token (all in decode)."""
    from protocol.sampling_params import SamplingParams
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(10, llm.engine.vocab_size - 10, (batch, input_len), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"split-{batch}-{i}" for i in range(batch)]
    for req_id, prompt in zip(ids, prompts, strict=True):
        llm.engine.add_request(req_id, prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in llm.engine.step())
    return ids


def measure(llm, batch: int, input_len: int, steps: int) -> tuple[float, dict[str, float]]:
    ids = decode_batch(llm, batch, input_len, max_tokens=3 * steps + 4)
    for _ in range(2):
        llm.engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    with labels(llm), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(PREFIX + STEP):
                llm.engine.step()
    llm.engine.abort_request(ids)
    return step_ms, split_events(prof.events())


def measure_prefill(llm, prompts: int, input_len: int, steps: int) -> tuple[float, dict[str, float]]:
    """Steps that each prefill ``prompts`` fresh prompts of ``input_len`` tokens (nothing in decode)."""
    from protocol.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(prompts)

    def one_step(tag: str) -> None:
        for i in range(prompts):
            ids = torch.randint(10, llm.engine.vocab_size - 10, (input_len,), generator=g).tolist()
            llm.engine.add_request(f"prefill-{tag}-{i}", ids, params)
        llm.engine.step()
        while llm.engine.has_unfinished_requests():  # max_tokens=1: the prefill step finishes them
            llm.engine.step()

    for warm in range(2):
        one_step(f"warm{warm}")
    times = []
    for s in range(steps):
        start = time.perf_counter()
        one_step(f"timed{s}")
        times.append(time.perf_counter() - start)
    with labels(llm), profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(steps):
            with record_function(PREFIX + STEP):
                one_step(f"profiled{s}")
    return sorted(times)[len(times) // 2] * 1e3, split_events(prof.events())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8"],
                        help="a GGUF file: its blocks (auto/gguf) or its dequantized conversion (none)")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="split prefill steps of N prompts of --input-len tokens instead of decode steps")
    args = parser.parse_args()
    from engine import LLM
    from worker.models.tiny_model import ensure_default_model
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(args.model or ensure_default_model()), dtype=args.dtype, max_num_seqs=max(batches),
              quantization=args.quantization)
    try:
        print(f"model={llm.config.model} dtype={args.dtype} quantization={llm.config.quantization} "
              f"threads={torch.get_num_threads()} "
              f"input_len={args.input_len} steps={args.steps}")
        if args.prefill:
            step_ms, totals = measure_prefill(llm, args.prefill, args.input_len, args.steps)
            print("\n" + format_split(args.prefill, step_ms, totals, kind=f"prefill ({args.input_len} tokens each)"))
            print(f"\n{args.prefill * args.input_len / step_ms * 1e3:.0f} prefill tok/s")
            return
        for batch in batches:
            step_ms, totals = measure(llm, batch, args.input_len, args.steps)
            print("\n" + format_split(batch, step_ms, totals))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
