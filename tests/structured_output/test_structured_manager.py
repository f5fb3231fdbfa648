"""The engine's structured-output interface without a model: compiled grammars are cached, masks are
filled only for the rows that need one (equal to xgrammar's own mask), the reasoning gate opens at
the closing tag, min_tokens and ignore_eos meet a finished grammar as documented."""
import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from helpers import make_reasoning_model
from nanovllm import SamplingParams, StructuredOutputsParams
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import unpack_bitmask
from nanovllm.reasoning import PromptState, reasoning_parser
from nanovllm.structured_output.manager import Phase, StructuredOutputs

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_reasoning_model(str(tmp_path_factory.mktemp("reasoning"))))


def _manager(tokenizer, reasoning=None):
    return StructuredOutputs(tokenizer, VOCAB, {tokenizer.eos_token_id}, reasoning)


def _seq(tokenizer, manager, prompt="hi", **params):
    sp = SamplingParams(**params)
    seq = Sequence(tokenizer.encode(prompt), sp, seed=0)
    manager.attach([seq])
    return seq


def _fill(manager, seqs):
    rows = np.zeros(len(seqs), dtype=np.int32)
    masks = torch.zeros(len(seqs), manager.words, dtype=torch.int32)
    num = manager.fill_masks(seqs, rows, masks)
    return rows, unpack_bitmask(masks[:num], VOCAB)


def _allowed_text(tokenizer, allowed_row) -> set[str]:
    return {tokenizer.decode([t]) for t in allowed_row.nonzero().flatten().tolist()}


def test_compiled_grammars_are_cached_by_their_text(tokenizer):
    m = _manager(tokenizer)
    a = m.compiler.compile(StructuredOutputsParams(json={"type": "object"}))
    assert m.compiler.compile(StructuredOutputsParams(json='{"type": "object"}')) is a  # the same text
    assert m.compiler.compile(StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)) is not a


def test_masks_only_for_constrained_rows_and_equal_to_xgrammars(tokenizer):
    m = _manager(tokenizer)
    choice = StructuredOutputsParams(choice=["Paris", "Berlin"])
    free = _seq(tokenizer, m)
    constrained = _seq(tokenizer, m, structured_outputs=choice)
    done = _seq(tokenizer, m, structured_outputs=choice)
    done.status = done.status.FINISHED
    assert m.num_live == 2 and m.needs_masks([free, constrained]) and not m.needs_masks([free])
    rows, allowed = _fill(m, [free, constrained, done])
    assert rows.tolist() == [-1, 0, -1] and allowed.shape[0] == 1
    tokens = m.compiler.vocab_size  # xgrammar's vocabulary: the tokenizer's, the model's rows beyond never allowed
    assert tokens == len(tokenizer) < VOCAB
    reference = xgr.allocate_token_bitmask(1, tokens)
    xgr.GrammarMatcher(m.compiler.compile(choice)).fill_next_token_bitmask(reference)
    assert torch.equal(allowed[0][:tokens], unpack_bitmask(reference, tokens)[0]) and not allowed[0][tokens:].any()
    assert all("Paris".startswith(t) or "Berlin".startswith(t) for t in _allowed_text(tokenizer, allowed[0]))
    m.release(constrained)
    m.release(done)
    m.release(free)  # no grammar: nothing to release
    assert m.num_live == 0 and not m.needs_masks([constrained])


def _feed_text(tokenizer, m, seq, text):
    for token in tokenizer.encode(text):
        assert m.advance([seq], [token]) == []
        seq.append_token(token)


def test_a_finished_grammar_allows_only_eos_and_rejections_are_reported(tokenizer):
    m = _manager(tokenizer)
    seq = _seq(tokenizer, m, structured_outputs=StructuredOutputsParams(choice=["Paris"]), ignore_eos=True)
    _feed_text(tokenizer, m, seq, "Paris")
    rows, allowed = _fill(m, [seq])
    assert allowed[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert m.advance([seq], [tokenizer.eos_token_id]) == [] and seq.grammar.phase == Phase.TERMINATED
    rows, allowed = _fill(m, [seq])  # ignore_eos: the grammar still wins, only eos from here on
    assert allowed[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    other = _seq(tokenizer, m, structured_outputs=StructuredOutputsParams(choice=["Paris"]))
    bad = tokenizer.encode("Berlin")[0]
    assert m.advance([other], [bad]) == [other]


def test_an_eos_beyond_the_tokenizer_only_ends_a_finished_grammar(tokenizer):
    """A model's eos in its padding rows (a random model's config over a small tokenizer): xgrammar is
    told only of the tokenizer's stop tokens (an id beyond its vocabulary would be written past the
    mask), the grammar ends with those, and a finished grammar allows both."""
    beyond = VOCAB - 1
    m = StructuredOutputs(tokenizer, VOCAB, {tokenizer.eos_token_id, beyond})
    assert beyond >= m.compiler.vocab_size and m.compiler.stop_token_ids == [tokenizer.eos_token_id]
    seq = _seq(tokenizer, m, structured_outputs=StructuredOutputsParams(choice=["Paris"]), ignore_eos=True)
    _feed_text(tokenizer, m, seq, "Paris")
    rows, allowed = _fill(m, [seq])
    assert allowed[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert m.advance([seq], [tokenizer.eos_token_id]) == [] and seq.grammar.phase == Phase.TERMINATED
    rows, allowed = _fill(m, [seq])
    assert allowed[0].nonzero().flatten().tolist() == sorted([tokenizer.eos_token_id, beyond])
    # One buffer kept, as the runner keeps its own, dirty at first (its warm-up allows every token):
    # the finished grammar's row, then an open grammar's in the same place, allows nothing beyond.
    masks, rows = torch.full((2, m.words), -1, dtype=torch.int32), np.zeros(2, dtype=np.int32)
    fresh = _seq(tokenizer, m, structured_outputs=StructuredOutputsParams(choice=["Paris"]))
    for seqs in ([seq], [fresh], [seq, fresh], [fresh, seq], [fresh]):
        assert m.fill_masks(seqs, rows, masks) == len(seqs)
        for k, s in enumerate(seqs):
            allowed = unpack_bitmask(masks[k:k + 1], VOCAB)[0].nonzero().flatten().tolist()
            if s is seq:
                assert allowed == sorted([tokenizer.eos_token_id, beyond])
            else:
                assert allowed and max(allowed) < m.compiler.vocab_size


def test_min_tokens_keeps_eos_out_unless_nothing_else_is_left(tokenizer):
    m = _manager(tokenizer)
    eos = tokenizer.eos_token_id
    seq = _seq(tokenizer, m, structured_outputs=StructuredOutputsParams(regex="a+"), min_tokens=5)
    _feed_text(tokenizer, m, seq, "a")
    _, allowed = _fill(m, [seq])
    assert not allowed[0, eos] and allowed[0].any()  # "a" may continue: eos out under min_tokens
    done = _seq(tokenizer, m, structured_outputs=StructuredOutputsParams(choice=["a"]), min_tokens=5)
    _feed_text(tokenizer, m, done, "a")
    _, allowed = _fill(m, [done])
    assert allowed[0].nonzero().flatten().tolist() == [eos]  # the grammar is complete: it wins
    assert done.grammar.bans_stop_tokens  # so the sampler does not ban eos for it


def test_reasoning_prompt_states(tokenizer):
    parser = reasoning_parser("qwen3", tokenizer)
    state = lambda text: parser.prompt_state(tokenizer.encode(text))  # noqa: E731
    assert state("<|im_start|>assistant\n") == PromptState.OPEN
    assert state("<|im_start|>assistant\n<think>\n") == PromptState.INSIDE
    assert state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == PromptState.CLOSED
    assert state("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n") == PromptState.OPEN
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        reasoning_parser("r1", tokenizer)


def test_the_grammar_waits_for_the_end_of_the_reasoning(tokenizer):
    m = _manager(tokenizer, "qwen3")
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    params = StructuredOutputsParams(choice=["Paris"])
    seq = _seq(tokenizer, m, prompt="<|im_start|>assistant\n", structured_outputs=params)
    assert seq.grammar.phase == Phase.UNDECIDED
    _, allowed = _fill(m, [seq])  # the first token: the opening tag, or the grammar's start
    assert allowed[0, start] and _allowed_text(tokenizer, allowed[0]) - {"<think>"} <= {"P", "Pa", "Par", "Paris"}
    m.advance([seq], [start])
    assert seq.grammar.phase == Phase.REASONING
    rows, _ = _fill(m, [seq])
    assert rows.tolist() == [-1]  # thinking: no mask
    assert m.advance([seq], tokenizer.encode("Berlin")[:1]) == []  # anything goes while thinking
    m.advance([seq], [end])
    assert seq.grammar.phase == Phase.ACTIVE
    _, allowed = _fill(m, [seq])
    assert not allowed[0, start] and allowed[0].sum() < 10
    closed = _seq(tokenizer, m, prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n", structured_outputs=params)
    assert closed.grammar.phase == Phase.ACTIVE
    inside = _seq(tokenizer, m, prompt="<|im_start|>assistant\n<think>\n", structured_outputs=params)
    assert inside.grammar.phase == Phase.REASONING and not inside.grammar.bans_stop_tokens
    undecided = _seq(tokenizer, m, prompt="<|im_start|>assistant\n", structured_outputs=params)
    m.advance([undecided], tokenizer.encode("P"))  # any other first token: the grammar starts with it
    assert undecided.grammar.phase == Phase.ACTIVE


def test_no_tokenizer_is_a_clear_error():
    m = StructuredOutputs(None, VOCAB, {2})
    m.check(SamplingParams())  # unconstrained: fine
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        m.check(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


def test_fill_and_accept_on_threads_equal_one_thread(tokenizer):
    """Batches large enough to be cut across threads: every row's mask and every accept as on one
    thread, rows in any state (interleaved slices), the rows beyond the tokenizer never allowed."""
    from nanovllm.structured_output.threads import MIN_ROWS_PER_THREAD
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}},
                                           "required": ["a"]})
    one, two = _manager(tokenizer), StructuredOutputs(tokenizer, VOCAB, {tokenizer.eos_token_id}, num_threads=2)
    n = 2 * MIN_ROWS_PER_THREAD + 3
    texts = [('{', '{"a": "x', '{"a": "xy"')[i % 3] for i in range(n)]  # three states
    rows_masks = []
    for m in (one, two):
        seqs = [_seq(tokenizer, m, structured_outputs=schema) for _ in range(n)]
        prefixes = [tokenizer.encode(t) for t in texts]
        for step in range(max(map(len, prefixes))):  # batched accepts of unequal prefixes
            live = [(s, p[step]) for s, p in zip(seqs, prefixes) if step < len(p)]
            assert m.advance([s for s, _ in live], [t for _, t in live]) == []
        rows_masks.append(_fill(m, seqs))
    assert two.threads.num_threads == 2
    (rows1, allowed1), (rows2, allowed2) = rows_masks
    assert rows1.tolist() == rows2.tolist() == list(range(n))
    assert torch.equal(allowed1, allowed2)
    assert not allowed2[:, len(tokenizer):].any() and allowed2[:, :len(tokenizer)].any(dim=1).all()
    assert all(not torch.equal(allowed2[i], allowed2[j]) for i, j in ((0, 1), (1, 2), (0, 2)))  # per-row masks
