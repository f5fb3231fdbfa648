"""bench_serving.py against a real server: one client process and several give the same counts."""
import json
import sys

import pytest

from openai_server_utils import REPO, TINY_ARGS, RemoteServer

sys.path.insert(0, REPO)
import bench_serving  # noqa: E402


def test_bench_serving_one_and_several_client_processes(tiny_server, tmp_path):
    summaries = []
    for processes in (1, 2):
        out = tmp_path / f"summary{processes}.json"
        rc = bench_serving.main(["--base-url", tiny_server.url, "--num-prompts", "6", "--concurrency", "4",
                                 "--input-len", "4:12", "--output-len", "5", "--processes", str(processes),
                                 "--json-out", str(out)])
        assert rc == 0
        summaries.append(json.loads(out.read_text()))
    for s in summaries:
        assert s["successful"] == 6 and s["failed"] == 0 and s["output_tokens"] == 30
        assert s["duration_s"] > 0 and s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0
        # Per request, in send order: the first four went out together, the other two as slots freed.
        sent = [r["sent_s"] for r in s["requests"]]
        assert len(sent) == 6 and sent == sorted(sent) and sent[0] == 0
        assert all(r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"] and r["output_tokens"] == 5 for r in s["requests"])
        assert s["ttft_ms_first_wave"]["p50"] > 0 and s["ttft_ms_later"]["p50"] > 0
    # The same seeded prompts whatever the number of client processes.
    assert summaries[0]["input_tokens"] == summaries[1]["input_tokens"]
    assert summaries[1]["client_processes"] == 2


def test_bench_serving_rejects_bad_arguments(capsys):
    for bad in (["--processes", "0"], ["--num-prompts", "0"], ["--request-rate", "0"]):
        try:
            bench_serving.main(bad)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")
    assert "must be >= 1" in capsys.readouterr().err


def test_ttft_of_a_stream_merged_into_its_final_chunk():
    """Under load a server may deliver a whole completion in its last chunk (finish_reason set, text
    empty or held back): its first token arrived then, so TTFT is that chunk's time, not 0."""
    import argparse
    import asyncio

    import httpx

    chunks = [{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"completion_tokens": 5}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    args = argparse.Namespace(temperature=0.0)

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await bench_serving.one_request(client, args, "m", [1, 2, 3], 5)
    result = asyncio.run(run())
    assert result.ok and result.output_tokens == 5 and result.ttft > 0 and result.itl == []


@pytest.fixture(scope="module")
def server_without_tokenizer(model_factory):
    """Logprob tokens come back as ids: the multi-turn histories hold the model's real answers."""
    server = RemoteServer([model_factory("qwen3", with_tokenizer=False), *TINY_ARGS])
    yield server
    server.stop()


MULTI_TURN = ["--multi-turn", "--num-prompts", "3", "--turns", "2:3", "--system-len", "40", "--input-len", "5:20",
              "--output-len", "3:6", "--concurrency", "2"]


def test_multi_turn_histories_are_reused(server_without_tokenizer, tmp_path):
    out = tmp_path / "multi.json"
    assert bench_serving.main(["--base-url", server_without_tokenizer.url, *MULTI_TURN, "--json-out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["successful"] == s["requests"] >= 6 and s["failed"] == 0 and s["answers_echoed"]
    turns = {(t["conversation"], t["turn"]): t for t in s["turns"]}
    assert {c for c, _ in turns} == {0, 1, 2}
    for (c, k), t in turns.items():
        # The warm-up cached the system prompt; a later turn repeats the previous prompt and its
        # answer, all of which the server reuses but the answer's last token (never computed).
        previous = turns.get((c, k - 1))
        assert t["shared_tokens"] == (40 if k == 0 else previous["prompt_len"] + previous["output_tokens"])
        assert t["shared_tokens"] - (k > 0) <= t["cached_tokens"] <= t["shared_tokens"]
        # The headers come once the engine took the request in, before its first token.
        assert 0 < t["headers_ms"] <= t["ttft_ms"]
        if previous is not None:  # a turn is sent once the previous answer is complete
            assert t["sent_s"] >= previous["sent_s"] + previous["ttft_ms"] / 1e3
    assert s["ideal_hit_rate"] - 0.02 < s["hit_rate"] <= s["ideal_hit_rate"]
    assert s["ttft_ms"]["p50"] > 0 and s["ttft_ms_later_turns"]["p50"] > 0 and s["headers_ms"]["p50"] > 0


def test_multi_turn_against_a_server_that_spells_text(tiny_server, tmp_path):
    """Logprob tokens come back as text: the histories hold synthetic answers, which the ideal
    does not count, and every prompt's predecessor is reused whole."""
    out = tmp_path / "multi.json"
    assert bench_serving.main(["--base-url", tiny_server.url, *MULTI_TURN, "--json-out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["failed"] == 0 and not s["answers_echoed"]
    turns = {(t["conversation"], t["turn"]): t for t in s["turns"]}
    for (c, k), t in turns.items():
        assert t["shared_tokens"] == (40 if k == 0 else turns[c, k - 1]["prompt_len"])
        assert t["cached_tokens"] >= t["shared_tokens"]


def test_multi_turn_over_two_client_processes(server_without_tokenizer, tmp_path):
    """The conversations are dealt to the processes: the same turns, prompts and reuse as in one."""
    summaries = []
    for processes in (1, 2):
        out = tmp_path / f"multi{processes}.json"
        assert bench_serving.main(["--base-url", server_without_tokenizer.url, *MULTI_TURN, "--processes",
                                   str(processes), "--json-out", str(out)]) == 0
        summaries.append(json.loads(out.read_text()))
    one, two = ({(t["conversation"], t["turn"]): (t["prompt_len"], t["shared_tokens"]) for t in s["turns"]}
                for s in summaries)
    assert one == two and len(one) >= 6
    assert summaries[1]["client_processes"] == 2 and summaries[1]["failed"] == 0
    assert summaries[1]["client_cpu_share"] > 0
    # The second run's prompts are the first's, all cached by then: at least the ideal's reuse.
    assert summaries[1]["hit_rate"] >= summaries[1]["ideal_hit_rate"] - 0.02
