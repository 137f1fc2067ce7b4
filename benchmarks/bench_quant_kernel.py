"""The GGUF block kernel (worker/kernels/csrc/quant_gemm.cpp), this tree against another revision's, on every
weight of a SmolLM2-shaped model once: the few-row int8 path (`quant_linear`, a decode step's matmuls at 1 to 8
rows) or, with ``--op quant_matmul``, the many-row one (a batch's decode step or a prefill chunk).

    python benchmarks/bench_quant_kernel.py [--rev HEAD~1] [--formats Q4_1,Q4_0,Q8_0] [--rows 1,2,4,8]
                                            [--threads 1,2] [--repeats 5] [--op quant_linear|quant_matmul]

Why: the served figures drift by more than a kernel change on a small VM, so the two kernels are timed here in one
process, alternating, best of ``--repeats``. The other revision's ``quant_gemm.cpp`` and headers are read with
``git show`` into a temp folder and built there (its own cache key). The weights are random blocks (scales fixed,
codes random) of SmolLM2-135M's shapes: 30 layers of q/k/v (960 x 576), o (576 x 576), gate/up (3072 x 576) and
down (576 x 1536), and the tied LM head (49152 x 576), 96 MB as Q4_1: more than the caches hold, as in a step.
Prints one line per (format, rows, threads): both times, the ratio, and the largest difference of their outputs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.kernels import build  # noqa: E402
from worker.layers.quantized_linear import BlockFormat, quant_gemm_kernel  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
SOURCES = ("quant_gemm.cpp", "quant_rows.h", "q8_matmul.h", "amx_tiles.h", "bf16_rows.h")


def kernel_at(rev: str, folder: Path):
    """quant_gemm as built from revision ``rev``'s sources (a header it lacks is skipped)."""
    for name in SOURCES:
        shown = subprocess.run(["git", "show", f"{rev}:worker/kernels/csrc/{name}"], cwd=ROOT, capture_output=True)
        if shown.returncode == 0:
            (folder / name).write_bytes(shown.stdout)
    tag = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return build.load_extension(f"quant_gemm_at_{tag}", (folder / "quant_gemm.cpp",))


def weights(fmt: BlockFormat) -> list[tuple[torch.Tensor, int]]:
    torch.manual_seed(0)
    out = []
    for n, k in SHAPES:
        b = torch.randint(0, 256, (n, k // 32, fmt.block_bytes), dtype=torch.uint8)
        b[..., 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d = 2^-7 (fp16)
        if fmt is BlockFormat.Q4_1:
            b[..., 2:4] = torch.tensor([0x00, 0xA0], dtype=torch.uint8)  # m = -2^-7
        out.append((b.reshape(n, -1).contiguous(), k))
    return out


def best_of(kernel, op: str, ws, xs, outs, fmt: BlockFormat, repeats: int) -> float:
    best = float("inf")
    multiply = getattr(kernel, op)
    for _ in range(repeats):
        start = time.perf_counter()
        for (blocks, k), out in zip(ws, outs, strict=True):
            multiply(out, xs[k], blocks, int(fmt), None)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default="HEAD~1", help="the revision to compare with (git)")
    p.add_argument("--formats", default="Q4_1,Q4_0,Q8_0")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--op", default="quant_linear", choices=["quant_linear", "quant_matmul"],
                   help="the few-row int8 path or the many-row one")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        other, this = kernel_at(args.rev, Path(tmp)), quant_gemm_kernel()
    if other is None or this is None:
        raise SystemExit("a kernel did not build")
    for fmt in (BlockFormat[f] for f in args.formats.split(",")):
        ws = weights(fmt)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for _, k in SHAPES}}
            outs = [torch.empty(rows, b.shape[0], dtype=dtype) for b, _ in ws]
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                then = best_of(other, args.op, ws, xs, outs, fmt, args.repeats)
                now = best_of(this, args.op, ws, xs, outs, fmt, args.repeats)
                a, b = torch.empty_like(outs[2]), torch.empty_like(outs[2])
                getattr(other, args.op)(a, xs[576], ws[2][0], int(fmt), None)
                getattr(this, args.op)(b, xs[576], ws[2][0], int(fmt), None)
                diff = (a.float() - b.float()).abs().max() / b.float().abs().max()
                print(f"{fmt.name} {args.op} rows={rows} threads={threads}: {args.rev} {then:.2f} ms, this tree "
                      f"{now:.2f} ms ({then / now:.2f}x), max |diff| / max |y| {float(diff):.1e}", flush=True)


if __name__ == "__main__":
    main()
