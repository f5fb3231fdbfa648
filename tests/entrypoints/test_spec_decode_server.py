"""The server with --speculative-config: vLLM's spec-decode counters on /metrics (read with
prometheus_client's parser), the official openai client's completions unchanged, and a bad
config refused at startup naming the field."""
import json
import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from openai_server_utils import REPO, TINY_ARGS, RemoteServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _samples(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def test_server_counts_drafts_and_accepted_tokens(model_factory):
    server = RemoteServer([model_factory("qwen3"), *TINY_ARGS, "--speculative-config", json.dumps(NGRAM)])
    try:
        client = server.client()
        model = client.models.list().data[0].id
        before = _samples(server.url)
        assert before[("vllm:spec_decode_num_draft_tokens_total", None)] == 0
        prompt = [5, 6, 7, 8, 9, 10] * 6
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert len(out.choices[0].text) > 0 and out.usage.completion_tokens == 24
        server.wait_idle()
        after = _samples(server.url)
        drafted = after[("vllm:spec_decode_num_draft_tokens_total", None)]
        accepted = after[("vllm:spec_decode_num_accepted_tokens_total", None)]
        per_pos = [after[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(3)]
        assert drafted > 0 and 0 <= accepted <= drafted and after[("vllm:spec_decode_num_drafts_total", None)] > 0
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    finally:
        server.stop()


def test_server_refuses_a_bad_speculative_config(model_factory):
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    proc = subprocess.run([sys.executable, "-m", "nanovllm", "serve", model_factory("qwen3"), *TINY_ARGS,
                           "--speculative-config", bad], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "speculative_config.num_speculative_tokens" in proc.stderr
