"""Incremental detokenization, stop strings and streaming hold-back; the OutputProcessor around them.

Run on the tests' tiny byte-level BPE tokenizer and on the real SmolLM2 tokenizer (from the
default GGUF), whose tokens split CJK characters and emoji over several tokens.
"""
import pytest
from transformers import AutoTokenizer

from helpers import make_tokenizer
from nanovllm.engine.detokenizer import IncrementalDetokenizer, decode_completion
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

TEXTS = ["The capital of France is Paris. The end.", "東京タワー 🚀 café naïve — Ünïcödé",
         "おはようございます", "Hello, world! 2 3 5 7 11 13", "\U0001F600\U0001F680 mixed 東 text"]


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def smol_tok():
    from nanovllm.models.default_model import default_model_path
    from nanovllm.models.gguf_convert import convert_gguf
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(convert_gguf(path))


@pytest.fixture(params=["tiny", "smol"])
def tok(request):
    return request.getfixturevalue(f"{request.param}_tok")


def _encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _run(tok, ids, prompt=(), **params):
    """Feed ids one at a time; returns (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, list(prompt), SamplingParams(**params))
    deltas = []
    for t in ids:
        delta, stop = detok.add(t)
        deltas.append(delta)
        if stop is not None:
            return deltas, detok
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_one_shot_decode(tok, text):
    ids = _encode(tok, text)
    prompt = _encode(tok, "Say something:")
    deltas, detok = _run(tok, ids, prompt)
    assert "".join(deltas) == detok.text == text == decode_completion(tok, prompt, ids)
    assert not any("\ufffd" in d for d in deltas), deltas  # never a half character


def test_a_character_split_over_tokens_is_emitted_once_complete(smol_tok):
    ids = _encode(smol_tok, "東京")
    assert len(ids) > 2  # each character is several byte tokens
    deltas, _ = _run(smol_tok, ids)
    assert [d for d in deltas if d] == ["東", "京"]
    assert deltas[0] == ""


def test_an_unfinished_character_is_flushed_as_replacement(smol_tok):
    ids = _encode(smol_tok, "ok 東京")[:-1]
    deltas, detok = _run(smol_tok, ids)
    assert detok.text == smol_tok.decode(ids) and detok.text.endswith("\ufffd")
    assert deltas[-1].endswith("\ufffd")  # only the final flush shows it


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = _encode(tok, "Hello") + [tok.convert_tokens_to_ids("<|im_end|>")] + _encode(tok, " world")
    deltas, detok = _run(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) != skip


def test_stop_string_across_a_token_boundary(smol_tok):
    text = "The capital of France is Paris. The end."
    ids = _encode(smol_tok, text)
    assert " of" in [smol_tok.decode([i]) for i in ids]  # "of Fr" spans " of" | " France"
    for include, want in [(False, "The capital "), (True, "The capital of Fr")]:
        deltas, detok = _run(smol_tok, ids, stop=["xyz", "of Fr"], include_stop_str_in_output=include)
        assert detok.stopped_by == "of Fr" and detok.text == want and "".join(deltas) == want


def test_earliest_stop_string_wins(smol_tok):
    ids = _encode(smol_tok, "The capital of France is Paris.")
    # " Paris" completes both stop strings at once: the one that starts first wins, whatever the list order.
    _, detok = _run(smol_tok, ids, stop=["ri", "ar"])
    assert detok.stopped_by == "ar" and detok.text == "The capital of France is P"


def test_multibyte_stop_string(tok):
    text = "東京タワー 🚀 café"
    for stop, want in [("🚀", "東京タワー "), ("ワ", "東京タ"), ("é", "東京タワー 🚀 caf")]:
        _, detok = _run(tok, _encode(tok, text), stop=stop)
        assert detok.stopped_by == stop and detok.text == want


def test_streaming_shows_all_but_a_possible_stop_string_start(tiny_tok):
    text = "Paris is the capital of France. Berlin is the capital of Germany."
    stop = "capital of Germany"
    detok = IncrementalDetokenizer(tiny_tok, [], SamplingParams(stop=[stop, "Berlin was"]))
    shown, held_somewhere = "", False
    for t in _encode(tiny_tok, text):
        delta, stopped = detok.add(t)
        shown += delta
        if stopped:
            break
        # Exactly the longest tail of the text that could still begin a stop string is held back.
        held = max(n for n in range(len(stop))
                   if detok.text.endswith(stop[:n]) or detok.text.endswith("Berlin was"[:n]))
        assert shown == detok.text[:len(detok.text) - held]
        held_somewhere |= held > 0
    assert held_somewhere and stopped == stop
    assert shown == detok.text == text[:text.index(stop)]


def test_held_back_text_is_released_at_the_end(tiny_tok):
    ids = _encode(tiny_tok, "Hello, world")
    deltas, detok = _run(tiny_tok, ids, stop=["world!"])
    assert detok.stopped_by is None and deltas[-1].endswith("world") and "".join(deltas) == "Hello, world"


def test_include_stop_str_needs_no_hold_back(tiny_tok):
    ids = _encode(tiny_tok, "Hello, world! How are you")
    detok = IncrementalDetokenizer(tiny_tok, [], SamplingParams(stop="How are you", include_stop_str_in_output=True))
    shown = "".join(detok.add(t)[0] for t in ids)
    assert shown == detok.text == "Hello, world! How are you"


def test_no_stop_check_under_min_tokens(tiny_tok):
    detok = IncrementalDetokenizer(tiny_tok, [], SamplingParams(stop="Hello"))
    for t in _encode(tiny_tok, "Hello"):
        assert detok.add(t, check_stop=False)[1] is None
    for t in _encode(tiny_tok, " world Hello"):
        stop = detok.add(t)[1]
    assert stop == "Hello" and detok.text == "Hello world "


# ---- OutputProcessor -----------------------------------------------------------------------------
EOS = 2  # <|im_end|> in both tokenizers


def _feed(proc, seq, ids):
    reason = None
    for t in ids:
        reason = proc.append(seq, t)
        if reason:
            break
    return reason


def test_processor_stop_string_truncates_and_reports(tiny_tok):
    proc = OutputProcessor({EOS}, 1024, tiny_tok)
    ids = _encode(tiny_tok, "Hello, world! How are you today?")
    seq = Sequence([5, 6], SamplingParams(stop=["are"], max_tokens=100), seed=0)
    assert _feed(proc, seq, ids) == "stop"
    assert seq.stop_reason == "are" and proc.text(seq) == "Hello, world! How "
    assert proc.take_delta(seq) == "Hello, world! How " and proc.take_delta(seq) == ""


@pytest.mark.parametrize("stream", [False, True])
def test_processor_eos_and_stop_token_text(tiny_tok, stream):
    proc = OutputProcessor({EOS}, 1024, tiny_tok, stream_all=stream)
    hello = _encode(tiny_tok, "Hello")
    stop_id = _encode(tiny_tok, "!")[0]
    cases = [  # (params, ids, reason, stop_reason, text)
        (SamplingParams(skip_special_tokens=False), hello + [EOS, 7], "stop", None, "Hello"),
        (SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), hello + [EOS], "stop", None,
         "Hello<|im_end|>"),
        (SamplingParams(stop_token_ids=[stop_id]), hello + [stop_id, 7], "stop", stop_id, "Hello"),
        (SamplingParams(stop_token_ids=[stop_id], min_tokens=len(hello) + 1, max_tokens=len(hello) + 2),
         hello + [stop_id, 7], "length", None, "Hello!" + tiny_tok.decode([7])),
        (SamplingParams(ignore_eos=True, max_tokens=len(hello) + 1), hello + [EOS], "length", None, "Hello"),
    ]
    for sp, ids, reason, stop_reason, text in cases:
        seq = Sequence([5, 6], sp, seed=0)
        if stream:
            proc.watch(seq)
        assert _feed(proc, seq, ids) == reason, sp
        seq.finish_reason = reason
        assert seq.stop_reason == stop_reason and proc.text(seq) == text, sp
        if stream:
            assert proc.take_delta(seq) == text


def test_processor_without_stop_strings_makes_no_detokenizer(tiny_tok):
    proc = OutputProcessor({EOS}, 1024, tiny_tok)
    seq = Sequence([5, 6], SamplingParams(max_tokens=3), seed=0)
    assert _feed(proc, seq, [40, 41, 42]) == "length"
    assert getattr(seq, "detokenizer", None) is None and proc.take_delta(seq) == ""
    seq.finish_reason = "length"
    assert proc.text(seq) == tiny_tok.decode([40, 41, 42])


def test_processor_records_logprobs():
    proc = OutputProcessor({EOS}, 1024)
    seq = Sequence([5, 6], SamplingParams(logprobs=1, max_tokens=4), seed=0)
    proc.append(seq, 9, ([9, 3, 9], [-1.5, -0.5, -1.5], 2))
    assert seq.logprobs == [{"token_id": 9, "logprob": -1.5, "rank": 2,
                             "top_logprobs": [{"token_id": 3, "logprob": -0.5}]}]


def _one_by_one(proc, seq, ids, logprobs=None):
    for j, t in enumerate(ids):
        reason = proc.append(seq, t, None if logprobs is None else logprobs[j])
        if reason:
            return reason
    return None


def _state(seq):
    return seq.token_ids, seq.stop_reason, seq.logprobs, getattr(seq, "detokenizer", None) is not None


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_append_run_is_appending_one_by_one(tiny_tok, with_tokenizer):
    """A verification step's accepted run: the same tokens, stop and reason as appending each in turn,
    for eos, stop ids, ignore_eos, min_tokens, max_tokens, max_model_len, stop strings, logprobs."""
    import random
    rng = random.Random(0)
    tok = tiny_tok if with_tokenizer else None
    for case in range(600):
        options = {"max_tokens": rng.randint(1, 12), "min_tokens": rng.choice([0, 0, 2, 5]),
                   "stop_token_ids": rng.choice([[], [7], [7, 8]]), "ignore_eos": rng.random() < 0.2}
        if with_tokenizer and rng.random() < 0.3:
            options["stop"] = ["ab"]
        if rng.random() < 0.2:
            options["logprobs"] = 0
        options["min_tokens"] = min(options["min_tokens"], options["max_tokens"])
        max_model_len = rng.choice([1024, rng.randint(5, 14)])
        prompt = [rng.randint(3, 60) for _ in range(rng.randint(1, 4))]
        done = rng.randint(0, 6)  # outputs before the run
        run = [rng.choice([EOS, 7, 8] + list(range(30, 60))) for _ in range(rng.randint(1, 6))]
        logprobs = [([t], [-1.0], 1) for t in run] if rng.random() < 0.5 else None
        seqs = []
        for _ in range(2):
            seq = Sequence(prompt, SamplingParams(**options), seed=0)
            seq.token_ids += [40] * done
            seqs.append(seq)
        if len(seqs[0]) >= max_model_len or done >= options["max_tokens"]:
            continue  # finished before the run
        proc = OutputProcessor({EOS}, max_model_len, tok, stream_all=with_tokenizer and case % 2 == 0)
        got = proc.append_run(seqs[0], run, logprobs)
        expected = _one_by_one(proc, seqs[1], run, logprobs)
        assert (got, _state(seqs[0])) == (expected, _state(seqs[1])), (options, max_model_len, done, run)
