"""bench.py end to end on the CPU with a tiny random-weight config: the figures it prints and its
diagnostic switches (the GPU numbers come from the same code)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_config(tmp_path):
    with open(os.path.join(ROOT, "benchmarks/configs/qwen3-0.6b.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=10240, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    return path


def _bench(tmp_path, *args, env=None):
    proc = subprocess.run(
        [sys.executable, "bench.py", "--config", str(_tiny_config(tmp_path)), "--device", "cpu", "--num-seqs", "5",
         "--max-input-len", "130", "--max-output-len", "104", "--max-model-len", "512", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_bench_runs_and_reports_its_steps(tmp_path):
    out, steps_out = tmp_path / "result.json", tmp_path / "steps.json"
    proc = _bench(tmp_path, "--repeat", "2", "--json", str(out), "--steps-json", str(steps_out))
    result = json.loads(out.read_text())
    steps = json.loads(steps_out.read_text())  # the timed run's steps, in order
    assert len(steps) == result["steps"] and steps[0]["tokens"] > steps[0]["decode_rows"] == 0
    assert steps[-1]["tokens"] == steps[-1]["decode_rows"] >= 1 and all(s["wall_ms"] > 0 for s in steps)
    assert result["prompts"] == 5 and result["output_tokens"] >= 5 * 100 and result["throughput_tok_s"] > 0
    assert result["steps"] > 100 and sum(row["count"] for row in result["breakdown"]) == result["steps"]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("Total: ") and "tok/s" in line for line in lines)
    assert any(line.startswith("repeat 1 (fresh prompt tokens)") for line in lines)


def test_bench_passes_gpu_memory_utilization_to_the_engine(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench.py", "--config", str(_tiny_config(tmp_path)), "--device", "cpu",
         "--gpu-memory-utilization", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "gpu_memory_utilization must be in (0, 1], got 1.5" in proc.stderr


FAKE_SMI = """#!{python}
import datetime, sys, time
while True:  # what `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --loop-ms=10` prints
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{{now}}, 1980, 3201, 650.0, 55", flush=True)
    time.sleep(0.01)
"""


def test_bench_clock_trace(tmp_path):
    """--clock-trace reads nvidia-smi's samples of the timed run (a stand-in prints them here) and
    summarises them per segment; without nvidia-smi it says so and the run goes on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable))
    smi.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    lines = _bench(tmp_path, "--clock-trace", env=env).stdout.splitlines()
    summary = [line for line in lines if "SM clock" in line]
    assert any("whole run" in line for line in summary) and any("decode" in line for line in summary)
    # The tiny run's batches stay below 128 sequences: its decode samples all fall in the second cut.
    assert any("decode 1-127" in line for line in summary)
    assert all("1980 / 1980 / 1980 MHz" in line and "650 W" in line for line in summary)
    env["PATH"] = str(tmp_path / "empty")
    assert "clock trace: no nvidia-smi" in _bench(tmp_path, "--clock-trace", env=env).stdout


def test_schedule_recorder_records_every_scheduled_step():
    """The recorder's flat arrays give back each step's rows: decode rows, new tokens, context and
    computed tokens per sequence (steps where nothing was scheduled are not steps)."""
    sys.path.insert(0, ROOT)
    from bench import ScheduleRecorder
    seqs = [SimpleNamespace(num_computed_tokens=c) for c in (5, 0, 100)]
    batches = iter([SimpleNamespace(num_decodes=1, num_new_tokens=[1, 7, 30], seqs=seqs), None,
                    SimpleNamespace(num_decodes=2, num_new_tokens=[1, 1], seqs=seqs[:2])])
    scheduler = SimpleNamespace(schedule=lambda: next(batches))
    recorder = ScheduleRecorder(scheduler)
    for _ in range(3):
        scheduler.schedule()
    assert recorder.steps == [(1, [1, 7, 30], [6, 7, 130], [5, 0, 100]), (2, [1, 1], [6, 1], [5, 0])]
    assert len(recorder.times) == 2


def test_bench_structured_compares_constrained_and_free_decode_steps(tmp_path):
    from helpers import make_tokenizer
    tokenizer = make_tokenizer(str(tmp_path / "tokenizer"))
    out = tmp_path / "result.json"
    proc = _bench(tmp_path, "--structured", "json", "--tokenizer", str(tmp_path / "tokenizer"), "--json", str(out))
    result = json.loads(out.read_text())["structured"]
    assert set(result["compile"]) == {"tool call (required, 1 tool)", "benchmark schema (20 strings)"}
    assert all(t["cached_ms"] < t["first_ms"] for t in result["compile"].values())
    assert result["bins"] and all(b["ratio"] > 0 and b["steps"] > 0 for b in result["bins"].values())
    fill = result["mask_fill"]
    assert fill["steps"] > 100 and 0 < fill["rows_per_step"] <= 5 and fill["ms_per_step"] > 0
    assert fill["hidden_fraction"] is None  # no device to overlap with on the CPU
    assert any(line.startswith("grammar compile, tool call") for line in proc.stdout.splitlines())
    assert any("mask fill:" in line for line in proc.stdout.splitlines()) and len(tokenizer) == 400
def test_bench_structured_host_times_the_grammar_work_per_step(tmp_path):
    """No model: the engine's fill + accept per step for 1, 2, 4 ... --num-seqs rows, on the config's
    vocabulary (wider than the tokenizer's: the copy into the model-wide rows is in the figures)."""
    from helpers import make_tokenizer
    make_tokenizer(str(tmp_path / "tokenizer"))
    out = tmp_path / "result.json"
    proc = _bench(tmp_path, "--structured", "host", "--tokenizer", str(tmp_path / "tokenizer"), "--json", str(out))
    result = json.loads(out.read_text())["structured_host"]
    assert result["vocab_size"] == json.loads(_tiny_config(tmp_path).read_text())["vocab_size"] > 400
    assert result["threads"]["1"].keys() == {"1", "2", "4", "5"}
    assert all(r["fill_ms"] > 0 and r["accept_ms"] > 0 for arm in result["threads"].values() for r in arm.values())
    assert "5 rows: fill" in proc.stdout and "num_kvcache_blocks" not in proc.stdout  # no engine was built


def test_roofline_counts_fp8_weights_and_an_fp8_cache_at_a_byte():
    """Block-FP8 projections: one byte per weight plus an fp32 scale per 128x128 block (the LM head stays
    in the model dtype); an FP8 cache: one byte per K/V value; FP8 products at the FP8 rate."""
    sys.path.insert(0, ROOT)
    from benchmarks.roofline import roofline
    cfg = dict(hidden_size=256, num_hidden_layers=2, vocab_size=1000, num_attention_heads=2, num_key_value_heads=1,
               head_dim=128, intermediate_size=384)
    steps = [(0, [10], [10], [0]), (1, [1], [11], [10])]
    bf16 = roofline(cfg, steps, 1e12, 1e15)
    params = 512 * 256 + 256 * 256 + 768 * 256 + 256 * 384  # qkv, o, gate_up, down
    assert bf16["weight_bytes_per_step"] == 2 * (2 * params + 1000 * 256)
    assert bf16["kv_bytes_per_token"] == 2 * 2 * 128 * 2
    fp8 = roofline(cfg, steps, 1e12, 1e15, fp8_weights=True, kv_dtype_bytes=1, fp8_flops=2e15)
    scales = 4 * 2 + 2 * 2 + 6 * 2 + 2 * 3  # blocks of qkv, o, gate_up, down
    assert fp8["weight_bytes_per_step"] == 2 * (params + 4 * scales) + 2 * 1000 * 256
    assert fp8["kv_bytes_per_token"] == 2 * 2 * 128
    attention = 4 * 2 * 2 * 128 * (10 * 11 / 2)
    linear = 2 * params * 2 * 10
    expect = (2 * fp8["weight_bytes_per_step"] + fp8["kv_bytes_per_token"] * 11) / 1e12 + linear / 2e15 + attention / 1e15
    assert abs(fp8["ideal_time_s"] - expect) < 1e-12


def test_bench_with_fp8_weights_and_cache(tmp_path):
    """--quantization fp8 --kv-cache-dtype fp8 on a config whose projections fill 128x128 blocks: random
    weights quantized to block FP8 at load (dequantized again on the CPU) and an FP8 KV cache."""
    with open(os.path.join(ROOT, "benchmarks/configs/qwen3-0.6b.json")) as f:
        config = json.load(f)
    config.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, vocab_size=10240, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "bench.py", "--config", str(path), "--device", "cpu", "--num-seqs", "3", "--max-input-len",
         "110", "--max-output-len", "101", "--max-model-len", "256", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quantization"] == "fp8" and result["kv_cache_dtype"] == "torch.float8_e4m3fn"
    assert result["throughput_tok_s"] > 0 and "quantization=fp8 kv_cache_dtype=torch.float8_e4m3fn" in proc.stdout


def _tiny_moe_config(tmp_path):
    with open(os.path.join(ROOT, "benchmarks/configs/qwen3-30b-a3b.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_experts=8,
                  num_experts_per_tok=2, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=10240, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "tiny_moe.json"
    path.write_text(json.dumps(config))
    return path


def test_bench_moe_roofline_reads_the_routed_experts(tmp_path):
    """A mixture of experts: the layers' record of the router's choices (one entry per step) prices the
    weights of the experts each step routed to; single requests route a decode token to its top-k."""
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, "bench.py", "--config", str(_tiny_moe_config(tmp_path)), "--device", "cpu", "--num-seqs", "3",
         "--max-input-len", "110", "--max-output-len", "102", "--max-model-len", "512", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "routing record:" not in proc.stdout  # the record covered every step
    result = json.loads(out.read_text())
    assert 2 <= result["mean_experts_per_layer"] <= 8
    decode = [row for row in result["breakdown"] if row["steps"].startswith("decode") and row["count"]]
    assert decode and all(2 <= row["experts_per_layer"] <= 6 for row in decode)  # 1-3 tokens x top-2
    assert any(line.startswith("  routed experts:") for line in proc.stdout.splitlines())


def test_moe_roofline_counts_dense_parts_once_and_experts_per_route():
    sys.path.insert(0, ROOT)
    from benchmarks.roofline import architecture_costs, roofline
    with open(os.path.join(ROOT, "benchmarks/configs/qwen3-30b-a3b.json")) as f:
        cfg = json.load(f)
    costs = architecture_costs(cfg)
    assert costs["sparse_layers"] == 48 and costs["expert_bytes"] == 3 * 2048 * 768 * 2
    total = costs["dense_weight_bytes"] + 48 * 128 * costs["expert_bytes"]
    assert abs(total / 2 + 151936 * 2048 - 30.53e9) < 0.01e9  # 30.5B parameters with the (unread) embedding
    assert abs(costs["active_params"] + 2 * 151936 * 2048 - 3.35e9) < 0.01e9  # 3.3B active with embedding, LM head
    steps = [(1, [1], [100], [99]), (1, [1], [101], [100])]  # two one-row decode steps
    roof = roofline(cfg, steps, 1e12, 1e15, routed_experts=[48 * 8, 48 * 128])
    kv = costs["kv_bytes_per_token"]
    assert roof["step_ideal_s"] == [(costs["dense_weight_bytes"] + 48 * 8 * costs["expert_bytes"] + 100 * kv) / 1e12,
                                    (costs["dense_weight_bytes"] + 48 * 128 * costs["expert_bytes"] + 101 * kv) / 1e12]
    dense = json.load(open(os.path.join(ROOT, "benchmarks/configs/qwen3-0.6b.json")))
    c = architecture_costs(dense)
    layer = 1024 * (16 + 16) * 128 + 16 * 128 * 1024 + 3 * 1024 * 3072
    assert c["dense_weight_bytes"] == (28 * layer + 151936 * 1024) * 2 and c["sparse_layers"] == 0


def test_profile_kernel_kinds():
    """--profile's split of device time by kind of kernel (router+sort, expert GEMMs, attention, ...)."""
    sys.path.insert(0, ROOT)
    from benchmarks.diagnostics import kernel_kinds
    rows = [("_moe_gate_up_kernel", 10, 3e6), ("_moe_down_kernel", 10, 1e6), ("_moe_topk_kernel", 10, 2e5),
            ("_moe_align_kernel", 10, 3e5), ("_decode_split_kernel", 5, 1e6), ("nvjet_tst_64x8_64x16_4x1_v_bz", 3, 4e5),
            ("Memcpy HtoD (Pinned -> Device)", 2, 1e4)]
    assert kernel_kinds(rows) == [("router+sort (top-k, align)", 0.5), ("expert GEMMs", 4.0), ("attention", 1.0),
                                  ("library GEMMs (incl. the MoE router)", 0.4), ("other", 0.01)]


def test_bench_with_a_speculative_config(tmp_path):
    """--speculative-config reaches the engine (its cost on random prompts is the figure); a bad one is
    refused with the engine's message naming the field."""
    out = tmp_path / "result.json"
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    _bench(tmp_path, "--speculative-config", json.dumps(ngram), "--json", str(out))
    result = json.loads(out.read_text())
    assert result["speculative_config"] == ngram and result["output_tokens"] >= 5 * 100
    proc = subprocess.run(
        [sys.executable, "bench.py", "--config", str(_tiny_config(tmp_path)), "--device", "cpu",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "num_speculative_tokens" in proc.stderr, proc.stderr[-2000:]
