"""The benchmark tools' own logic (no speed is checked): percentiles, the redserve-vs-vLLM-vs-llama.cpp table,
the perplexity comparison's chunking and parsing, the decode step split's attribution, and the server
launcher's start/stop through real processes."""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gpu import main as bench_gpu_main  # noqa: E402
from benchmarks.bench_gpu import table as bench_gpu_table  # noqa: E402
from benchmarks.bench_servers import (  # noqa: E402
    ServerSpec,
    free_port,
    llamacpp_spec,  # noqa: E402
    running_server,
)
from benchmarks.bench_vs_vllm import (  # noqa: E402
    CASES,
    Model,
    format_table,
    llamacpp_slots,
    median_report,
    parse_args,
    redserve_quantization,
    round_ratios,
    server_spec,
)
from benchmarks.llamacpp_build import CMAKE_OPTIONS, cmake_options, cpu_key, cpu_summary  # noqa: E402
from benchmarks.perplexity import chunks, parse_llama_perplexity, perplexity, scored_logprobs  # noqa: E402
from benchmarks.step_split import ENGINE_OTHER, MODEL_OTHER, format_split, measure, split_events  # noqa: E402
from redserve.bench_serve import Client, bench_args, percentile  # noqa: E402


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_the_client_replaces_a_kept_alive_connection_the_server_closed() -> None:
    import http.server
    import socket
    import threading

    class CloseAfterEachAnswer(http.server.BaseHTTPRequestHandler):  # as llama-server does after a stream
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"usage": {"completion_tokens": 1}}\n\n' \
                   b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            self.request.shutdown(socket.SHUT_WR)  # the FIN follows the body at once, as llama-server's close does
            self.close_connection = True

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), CloseAfterEachAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}", None)
        results = [client.stream_completion({"prompt": [1]}) for _ in range(3)]
    finally:
        server.shutdown()
    assert [(r.ok, r.output_tokens, r.error) for r in results] == [(True, 1, "")] * 3


def test_bench_args_rejects_unknown_options() -> None:
    assert bench_args(concurrency=3).concurrency == 3
    with pytest.raises(ValueError, match="nope"):
        bench_args(nope=1)


def _report(tok_s: float, ttft: float, failed: int = 0) -> dict:
    return {"output_tok_per_s": tok_s, "request_per_s": tok_s / 128, "ttft_ms_p50": ttft, "ttft_ms_p99": 2 * ttft,
            "tpot_ms_p50": 10.0, "itl_ms_p99": 20.0, "failed": failed}


def test_table_has_a_row_per_system_and_the_ratio() -> None:
    results = {"redserve": {"dtype": "float32", "cases": {"c1": _report(60.0, 30.0)}},
               "vllm": {"dtype": "float32", "cases": {"c1": _report(40.0, 60.0, failed=2)}}}
    lines = format_table(results, ["c1"]).splitlines()
    assert lines[0].startswith("| case | system | out tok/s |")
    assert lines[2] == "| c1 | redserve (float32) | 60.0 | 0.47 | 30.0 | 60.0 | 10.00 | 20.0 |"
    assert lines[3].startswith("| c1 | vllm (float32) (2 failed) | 40.0 |")
    assert lines[4] == "| c1 | **redserve/vLLM** | 1.50 | 1.50 | 0.50 | 0.50 | 1.00 | 1.00 |"


def test_one_system_alone_prints_no_ratio_row() -> None:
    results = {"redserve": {"dtype": "auto", "cases": {"c1": _report(60.0, 30.0)}}}
    assert "redserve/vLLM" not in format_table(results, ["c1"])


def test_cases_and_prompt_counts() -> None:
    args = parse_args(["--cases", "c64,prefill", "--systems", "redserve", "--num-prompts", "8",
                       "--redserve-env", "OMP_NUM_THREADS=1", "--redserve-env", "A=b=c"])
    assert args.cases == ["c64", "prefill"] and args.systems == ["redserve"]
    assert args.redserve_env == {"OMP_NUM_THREADS": "1", "A": "b=c"}
    assert CASES["c64"].num_prompts(8) == 64 and CASES["prefill"].num_prompts(8) == 16
    assert CASES["c1"].num_prompts(None) == 16 and CASES["c64"].num_prompts(None) == 256
    assert (CASES["prefill"].input_len, CASES["prefill"].output_len) == (512, 32)
    with pytest.raises(SystemExit):
        parse_args(["--systems", "sglang"])


def test_llamacpp_gets_a_ratio_row_and_the_format_labels_each_system() -> None:
    results = {"redserve": {"dtype": "float32", "format": "Q4_1 GGUF blocks, float32",
                            "cases": {"c1": _report(60.0, 30.0)}},
               "llamacpp": {"dtype": "float32", "format": "Q4_1 GGUF", "cases": {"c1": _report(30.0, 15.0)}}}
    lines = format_table(results, ["c1"]).splitlines()
    assert lines[2].startswith("| c1 | redserve (Q4_1 GGUF blocks, float32) | 60.0 |")
    assert lines[3].startswith("| c1 | llamacpp (Q4_1 GGUF) | 30.0 |")
    assert lines[4] == "| c1 | **redserve/llama.cpp** | 2.00 | 2.00 | 2.00 | 2.00 | 1.00 | 1.00 |"
    assert "redserve/vLLM" not in format_table(results, ["c1"])


def test_llamacpp_serves_gguf_files_only_with_a_slot_per_request() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--systems", "redserve,llamacpp"])  # the tiny model is a directory
    assert parse_args(["--systems", "redserve,llamacpp", "--smollm2"]).smollm2 == "Q4_1"
    assert parse_args(["--systems", "llamacpp", "--smollm2", "Q8_0"]).smollm2 == "Q8_0"
    assert parse_args(["--systems", "llamacpp", "--model", "/m/x.Q4_1.gguf"]).systems == ["llamacpp"]
    assert llamacpp_slots([CASES["c1"], CASES["c64"]]) == (64, 256)
    assert llamacpp_slots([CASES["c1"], CASES["prefill"]]) == (16, 768)
    spec = llamacpp_spec(Path("/b"), "/m/x.gguf", 8080, "m", 64, 256, 2, "--no-warmup")
    assert spec.argv == ["/b/llama-server", "-m", "/m/x.gguf", "--host", "127.0.0.1", "--port", "8080",
                         "-c", "16384", "-np", "64", "-t", "2", "-a", "m", "--no-warmup"]


def test_redserve_quantization_is_read_from_its_extra_arguments() -> None:
    assert redserve_quantization("--no-batch-worker") == "auto"
    assert redserve_quantization("--quantization none --no-batch-worker") == "none"
    assert redserve_quantization("--quantization=gguf") == "gguf"


def test_cpu_summary_marks_missing_flags_and_the_key_ignores_order() -> None:
    assert cpu_summary({"avx2", "avx512_bf16"}) == "avx2 -avx512f -avx512_vnni avx512_bf16 -amx_bf16"
    assert cpu_key({"a", "b"}) == cpu_key({"b", "a"}) != cpu_key({"a"})


def test_llamacpp_builds_without_amx_where_the_cpu_reports_tiles_that_fault() -> None:
    """A VM may list amx_tile while its tiles raise SIGILL: llama.cpp's native build then dies at the first decode,
    so it is built for the CPU's other features by name."""
    flags = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
    assert cmake_options({"avx2", "fma"}) == CMAKE_OPTIONS  # no AMX reported: native
    assert cmake_options(flags, amx=True) == CMAKE_OPTIONS  # AMX that runs: native
    options = cmake_options(flags, amx=False)
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_NATIVE=ON" not in options
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX2=ON",
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"} <= set(options)


def test_perplexity_scores_the_second_half_of_each_chunk_like_llama_perplexity() -> None:
    assert chunks(list(range(10)), 4, bos=None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chunks(list(range(10)), 4, bos=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert scored_logprobs([None, -1.0, -2.0, -3.0, -4.0, -5.0], 6) == [-4.0, -5.0]  # ctx/2 + 1 .. ctx - 1
    assert scored_logprobs([None, -1.0, -2.0, -3.0], 4) == [-3.0]
    with pytest.raises(ValueError, match="expected 4"):
        scored_logprobs([None, -1.0], 4)
    assert perplexity([-1.0, -3.0]) == pytest.approx(math.exp(2.0))
    out = "perplexity: 3 chunks\n[1]20.1,[2]25.3,[3]26.4,\nFinal estimate: PPL = 26.4012 +/- 1.52340\n"
    assert parse_llama_perplexity(out) == (26.4012, 1.5234)
    with pytest.raises(ValueError, match="Final estimate"):
        parse_llama_perplexity("failed to load model")


def test_rounds_report_medians_and_each_rounds_ratio() -> None:
    ours = [_report(600.0, 30.0), _report(500.0, 50.0, failed=1), _report(700.0, 40.0)]
    theirs = [_report(400.0, 60.0), _report(400.0, 80.0), _report(350.0, 70.0)]
    med = median_report(ours)
    assert med["output_tok_per_s"] == 600.0 and med["ttft_ms_p50"] == 40.0 and med["ttft_ms_p99"] == 80.0
    assert med["failed"] == 1 and med["rounds"] == ours
    results = {"redserve": {"dtype": "float32", "cases": {"c64": med}},
               "vllm": {"dtype": "float32", "cases": {"c64": median_report(theirs)}}}
    assert round_ratios(results, ["c64", "c1"]) == (
        "c64: redserve/vLLM out tok/s by round 1.50, 1.25, 2.00 (min 1.25, max 2.00)")
    assert "| c64 | **redserve/vLLM** | 1.50 |" in format_table(results, ["c64"])
    assert parse_args(["--rounds", "3"]).rounds == 3 and parse_args([]).rounds == 1
    assert parse_args([]).settle == 3.0 and parse_args(["--settle", "0"]).settle == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_warm_up_repeats_until_every_request_succeeds(monkeypatch) -> None:
    import benchmarks.bench_vs_vllm as bench
    failures = iter([4, 1, 0, 0])
    calls = []
    monkeypatch.setattr(bench, "measure", lambda args: calls.append(args) or {"failed": next(failures)})
    bench.warm_up("http://127.0.0.1:1", pause=0)
    assert len(calls) == 3 and calls[0].concurrency == 4
    calls.clear()
    monkeypatch.setattr(bench, "measure", lambda args: calls.append(args) or {"failed": 4})
    bench.warm_up("http://127.0.0.1:1", timeout=0, pause=0)  # a server that never answers: one try, then on
    assert len(calls) == 1


@dataclass
class FakeEvent:
    name: str
    self_cpu_time_total: float
    cpu_parent: FakeEvent | None = None


def test_split_counts_each_op_for_its_innermost_range() -> None:
    step = FakeEvent("split:step", 5.0)
    runner = FakeEvent(f"split:{MODEL_OTHER}", 2.0, step)
    mlp = FakeEvent("split:activation", 1.0, runner)
    linear = FakeEvent("split:matmul", 0.5, mlp)
    attn = FakeEvent("split:attention", 1.0, runner)
    events = [step, runner, mlp, linear, attn,
              FakeEvent("aten::mm", 30.0, linear), FakeEvent("aten::silu", 4.0, mlp),
              FakeEvent("aten::bmm", 20.0, attn), FakeEvent("aten::add", 3.0, runner),
              FakeEvent("aten::empty", 1.0, step), FakeEvent("aten::outside", 99.0)]
    totals = split_events(events)
    assert totals == {ENGINE_OTHER: 6.0, MODEL_OTHER: 5.0, "activation": 5.0, "matmul": 30.5, "attention": 21.0}
    table = format_split(64, 10.0, totals)
    whole = sum(totals.values())
    assert f"| matmuls | {30.5 / whole * 10:.2f} | {30.5 / whole * 100:.1f} |" in table
    assert f"| the rest | {16 / whole * 10:.2f} | {16 / whole * 100:.1f} |" in table


def test_the_split_labels_the_cpu_kernel_path() -> None:
    """At one row on the CPU the kernel path runs the layers (no module forwards): its projections, norms, RoPE
    and attention must land in their own categories, not in "engine other" (they all did, 5 Dec 2026)."""
    from engine import LLM
    from worker.models.tiny_model import ensure_default_model

    llm = LLM(str(ensure_default_model()), dtype="float32", max_num_seqs=2)
    try:
        kernel_path = llm.engine.executor.runner.model.kernel_path()
        if kernel_path is None:
            pytest.skip("the C++ kernels did not build here: no kernel path to label")
        step_ms, totals = measure(llm, 1, 16, 4)
    finally:
        llm.shutdown()
    whole = sum(totals.values())
    assert step_ms > 0 and whole > 0
    for category in ("matmul", "norm", "rope", "attention"):
        assert totals.get(category, 0.0) > 0, (category, totals)
    assert totals["matmul"] > totals.get(ENGINE_OTHER, 0.0), totals
    assert totals.get(ENGINE_OTHER, 0.0) < 0.5 * whole, totals


HEALTH_SERVER = textwrap.dedent("""
    import signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    if sys.argv[2] == "ignore-sigint":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


@pytest.mark.parametrize("mode", ["default", "ignore-sigint"])
def test_running_server_waits_for_health_and_stops_the_server(tmp_path: Path, mode: str) -> None:
    port = free_port()
    spec = ServerSpec("fake", [sys.executable, "-c", HEALTH_SERVER, str(port), mode], port,
                      startup_timeout=30.0, stop_timeout=1.0)
    with running_server(spec, tmp_path) as proc:
        assert proc.poll() is None
    assert proc.returncode is not None  # stopped by SIGINT, or SIGKILL when it ignores SIGINT


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path: Path) -> None:
    port = free_port()
    spec = ServerSpec("broken", [sys.executable, "-c", "raise SystemExit(3)"], port, startup_timeout=30.0)
    with pytest.raises(RuntimeError, match=r"broken exited with code 3 .*broken\.log"), \
            running_server(spec, tmp_path):
        pass


def test_a_server_that_does_not_start_is_reported_and_the_run_fails(tmp_path: Path, capsys) -> None:
    from benchmarks.bench_vs_vllm import main
    broken = f"{sys.executable} -c 'raise SystemExit(3)'"
    code = main(["--systems", "redserve", "--model", str(tmp_path), "--cases", "c1", "--redserve-cmd", broken,
                 "--log-dir", str(tmp_path / "logs"), "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert "redserve skipped: redserve exited with code 3" in out
    assert '"error"' in (tmp_path / "out.json").read_text()


def test_the_gpu_table_puts_each_figure_beside_its_target_and_floor() -> None:
    args = SimpleNamespace(batch=256, input_len=128, output_len=128, dtype="bfloat16", hbm_tbps=4.8,
                           enforce_eager=False, async_scheduling="auto")
    result = {"device": "cuda:0", "weight_bytes": 2.4e9, "offline_batch_tok_s": 60_000.0,
              "offline_batch_ms_per_step": 4.0, "offline_batch1_ms_per_token": 1.2, "matmul_only_ms_per_step": 1.15,
              "busy_fraction": 0.9, "cpu_ms_per_step": 1.0, "device_ms_per_step": 3.6, "wall_ms_per_step": 4.0,
              "transformers_tok_s": 4_000.0,
              "served": {1: {"tpot_ms_p50": 1.4, "output_tok_per_s": 700.0, "failed": 0},
                         64: {"tpot_ms_p50": 2.5, "output_tok_per_s": 26_000.0, "failed": 2}}}
    text = bench_gpu_table(args, result)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 60,000 | >= 50,000 | matmul-only 1.15 ms/step |" in rows["offline batch 256, output tok/s"]
    assert "| 15.00x | >= 5x |" in rows["offline batch 256 vs transformers generate"]
    assert "weights 0.50 ms" in rows["offline batch 1, ms a token"]  # 2.4 GB at 4.8 TB/s
    assert "| 90% | >= 0.85 |" in rows["steady decode: device busy / wall"]
    assert "1.40 / 700 | <= 1.5 ms | TPOT floor 0.50 ms" in rows["served c=1, TPOT p50 ms / output tok/s"]
    assert "(2 failed) | >= 25,000 tok/s" in rows["served c=64, TPOT p50 ms / output tok/s"]
    assert "CUDA graphs on, async scheduling auto" in text
    on_cpu = bench_gpu_table(args, {**result, "device": "cpu", "busy_fraction": None, "device_ms_per_step": None,
                                    "served": {}})
    assert "| n/a | >= 0.85 |" in on_cpu and "CUDA graphs off" in on_cpu and "served" not in on_cpu


def test_bench_gpu_refuses_unknown_options() -> None:
    with pytest.raises(SystemExit):
        bench_gpu_main(["--no-such-option"])



def test_a_variant_is_one_more_redserve_with_its_own_environment_and_ratio_rows() -> None:
    args = parse_args(["--variant", "spin:GOMP_SPINCOUNT=10000,OMP_WAIT_POLICY=passive",
                       "--redserve-env", "OMP_NUM_THREADS=2"])
    assert args.systems == ["redserve", "vllm", "redserve:spin"]
    assert args.variants == {"redserve:spin": {"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": "passive"}}
    spec = server_spec("redserve:spin", args, Model("/m", "/m"), [])
    assert spec.env["GOMP_SPINCOUNT"] == "10000" and spec.env["OMP_NUM_THREADS"] == "2"
    assert "GOMP_SPINCOUNT" not in server_spec("redserve", args, Model("/m", "/m"), []).env
    for bad in ("spin", ":A=1", "spin:A", "spin:"):
        with pytest.raises(SystemExit):
            parse_args(["--variant", bad])
    with pytest.raises(SystemExit):
        parse_args(["--variant", "a:X=1", "--variant", "a:Y=2"])
    med = {s: median_report([_report(v, 30.0)]) for s, v in (("redserve", 600.0), ("redserve:spin", 660.0),
                                                             ("vllm", 400.0))}
    results = {s: {"dtype": "float32", "cases": {"c64": m}} for s, m in med.items()}
    assert round_ratios(results, ["c64"]).splitlines() == [
        "c64: redserve/vLLM out tok/s by round 1.50 (min 1.50, max 1.50)",
        "c64: redserve:spin/vLLM out tok/s by round 1.65 (min 1.65, max 1.65)"]
    table = format_table(results, ["c64"])
    assert "| c64 | **redserve/vLLM** | 1.50 |" in table and "| c64 | **redserve:spin/vLLM** | 1.65 |" in table
