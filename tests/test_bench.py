"""bench.py end to end on the CPU with a tiny random-weight config: the figures it prints and its
diagnostic switches (the GPU numbers come from the same code)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_runs_and_reports_host_stages(tmp_path):
    with open(os.path.join(ROOT, "benchmarks/configs/qwen3-0.6b.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=10240, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "bench.py", "--config", str(path), "--device", "cpu", "--num-seqs", "5",
         "--max-input-len", "130", "--max-output-len", "104", "--max-model-len", "512", "--host-stages",
         "--repeat", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["prompts"] == 5 and result["output_tokens"] >= 5 * 100 and result["throughput_tok_s"] > 0
    assert result["steps"] > 100 and sum(row["count"] for row in result["breakdown"]) == result["steps"]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("Total: ") and "tok/s" in line for line in lines)
    assert any(line.startswith("repeat 1 (fresh prompt tokens)") for line in lines)
    # One line per prefill step and three decode steps after them, each with its host stages.
    stages = [line for line in lines if line.strip().startswith("step ")]
    assert len(stages) >= 4 and "prompt" in stages[0] and "model forward (eager launch)" in stages[0]
    assert all("wall" in line and "execute (all)" in line for line in stages)
