"""bench_serving.py against a real server: one client process and several give the same counts."""
import json
import sys

from openai_server_utils import REPO

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
