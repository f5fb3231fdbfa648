"""scripts/bench_frontend.py: the real engine over a stand-in device of fixed speed, and the whole
server driven by the serving client (a small run, with two engine cores)."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("bench_frontend", os.path.join(ROOT, "scripts/bench_frontend.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stand_in_engine(tmp_path, step_s: float):
    """The real engine over bench_frontend's tiny model and its stand-in device of step_s a step."""
    from nanovllm.config import Config
    bench = _module()
    (tmp_path / "config.json").write_text(json.dumps(bench.TINY_QWEN3))
    config = Config(str(tmp_path), load_format="dummy", device="cpu", max_num_seqs=4, max_model_len=512,
                    num_kvcache_blocks=16)
    return bench.stand_in_engine(step_s, 0.0)(config)


def test_stand_in_device_paces_the_real_engine(tmp_path):
    from nanovllm.sampling_params import SamplingParams
    engine = _stand_in_engine(tmp_path, 0.01)
    for i, n in enumerate((3, 5)):
        engine.add_request(f"r{i}", list(range(1, 40)), SamplingParams(max_tokens=n, ignore_eos=True))
    seqs = [s for r in engine.requests.values() for s in r]
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert [s.completion_token_ids for s in seqs] == [[7] * 3, [7] * 5]
    assert time.perf_counter() - start >= 0.01 * (steps - 1)  # each step waits for its device time


def test_stand_in_device_answers_logprobs_when_asked(tmp_path):
    """A multi-turn client reads the answers' ids from their logprobs, to send them back."""
    from nanovllm.sampling_params import SamplingParams
    engine = _stand_in_engine(tmp_path, 0.001)
    engine.add_request("plain", list(range(1, 20)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("asks", list(range(1, 30)), SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0))
    plain, asks = engine.requests["plain"][0], engine.requests["asks"][0]
    while engine.has_unfinished():
        engine.step()
    assert plain.logprobs is None
    assert [(e["token_id"], e["logprob"], e["rank"]) for e in asks.logprobs] == [(7, 0.0, 1)] * 3


def test_whole_server_run(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "scripts/bench_frontend.py", "--num-prompts", "12", "--concurrency", "6",
                           "--input-len", "20:40", "--output-len", "8:16", "--step-ms", "2", "--port", "8019",
                           "--data-parallel-size", "2", "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["successful"] == 12 and summary["failed"] == 0 and summary["output_tokens"] >= 12 * 8
    assert "nanovllm:engine_emit_seconds_total[engine 1]" in proc.stdout  # two engine cores served
    cpu = [line for line in proc.stdout.splitlines() if line.startswith("CPU of the ")]
    assert len(cpu) == 4 and "API process" in cpu[0] and "client" in cpu[3], proc.stdout[-2000:]
    assert sum("engine process" in line for line in cpu) == 2


def test_multi_turn_run_splits_the_servers_ttft(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "scripts/bench_frontend.py", "--multi-turn", "--num-prompts", "4",
                           "--turns", "2:3", "--system-len", "300", "--input-len", "8:16", "--output-len", "4:8",
                           "--step-ms", "2", "--port", "8020", "--json-out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["hit_rate"] > 0.5 and summary["ttft_ms_later_turns"]["p50"] > 0
    line = next(line for line in proc.stdout.splitlines() if line.startswith("server-side means: TTFT"))
    ttft, queue, prefill, hop = (float(x) for x in re.findall(r"(-?\d+\.\d+)", line))
    assert ttft > 0 and queue >= 0 and prefill > 0 and hop > 0 and abs(queue + prefill + hop - ttft) < 0.02
