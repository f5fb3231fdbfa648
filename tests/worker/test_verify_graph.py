"""The verification graphs' input layout (worker/verify_graph.py), on the CPU: a verification step
laid out as fixed windows of k + 1 rows (real tokens last, padding before, padding sequences after)
gives the logits the general (ragged) path gives, through the multi-query decode attention. The
capture and replay themselves run on the GPU (tests/gpu/test_spec_decode_gpu.py)."""
import numpy as np
import torch

from helpers import prefilled_sequences
from nanovllm import LLM
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.verify_graph import fill_verify_inputs, verify_metadata, verify_step_fits

K = 3
Q = K + 1


def _views(bs: int, max_blocks: int) -> dict[str, np.ndarray]:
    rows = bs * Q
    return {"input_ids": np.zeros(rows, np.int64), "positions": np.zeros(rows, np.int64),
            "slot_mapping": np.zeros(rows, np.int64), "logits_rows": np.zeros(rows, np.int64),
            "seq_lens": np.zeros(bs, np.int32), "decode_order": np.zeros(bs, np.int32),
            "block_tables": np.zeros((bs, max_blocks), np.int32)}


def test_window_layout_gives_the_general_paths_logits(model_factory):
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(model_factory("qwen3"), dtype="float32", max_model_len=256, kvcache_block_size=16,
             speculative_config=spec) as llm:
        runner = llm.engine.model_runner
        # A block boundary inside a window (20 + 3 drafts crosses 16 -> 32... at 31/32), a plain decode row,
        # a context shorter than the window (2 tokens, 3 drafts: padding rows before the context's start).
        seqs = prefilled_sequences(runner, [list(range(40, 71)), list(range(5, 25)), [7, 8]], K)
        drafts = [[1, 2, 3], [], [9, 10, 11]]
        order = [1, 0, 2]  # decodes first, as the scheduler orders a batch
        batch = ScheduledBatch([seqs[i] for i in order], [len(drafts[i]) + 1 for i in order], num_decodes=1,
                               spec=[drafts[i] for i in order])
        assert verify_step_fits(batch, Q, max_bs=4)
        expect = runner.forward(runner.host_inputs(batch))

        padded = 4  # one padding sequence
        views = _views(padded, runner.max_blocks_per_seq)
        num_rows = fill_verify_inputs(views, batch, padded, Q, runner.block_size)
        assert num_rows == expect.shape[0] == 1 + 4 + 4
        assert (views["slot_mapping"].reshape(padded, Q) >= 0).sum() == num_rows  # padding rows store nothing
        static = {name: torch.from_numpy(a.copy()) for name, a in views.items()}
        # The torch backend never sees padding slots (the Triton store kernel skips them): a spare one here.
        static["slot_mapping"][static["slot_mapping"] < 0] = runner.num_blocks * runner.block_size - 1
        meta = verify_metadata(static, torch.arange(0, padded * Q + 1, Q, dtype=torch.int32), padded, Q,
                               llm.config.max_model_len, seq_lens_host=views["seq_lens"].tolist())
        with torch.inference_mode():
            hidden = runner.model(static["input_ids"], static["positions"], meta)
            got = runner.model.compute_logits(hidden)[static["logits_rows"][:num_rows]]
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)


def test_only_pure_verification_steps_fit():
    params = SamplingParams(temperature=0.0)
    decode, prefill = Sequence([1, 2, 3], params, seed=0), Sequence([4, 5, 6, 7], params, seed=1)
    decode.num_computed_tokens = 2
    ok = ScheduledBatch([decode], [3], num_decodes=0, spec=[[8, 9]])
    assert verify_step_fits(ok, Q, max_bs=1)
    assert not verify_step_fits(ok, query_len=2, max_bs=1)  # more drafts than the window holds
    assert not verify_step_fits(ok, Q, max_bs=0)  # past the captured batch sizes
    assert not verify_step_fits(ScheduledBatch([decode], [1], num_decodes=1), Q, max_bs=1)  # no drafts: a decode step
    assert not verify_step_fits(ScheduledBatch([decode, prefill], [3, 4], num_decodes=0, spec=[[8, 9], []]), Q, 2)
    decode.append_pending()  # a token still in flight
    assert not verify_step_fits(ScheduledBatch([decode], [3], num_decodes=0, spec=[[8, 9]]), Q, max_bs=1)


def _window_reference(batch, padded: int, block_size: int) -> dict[str, list]:
    """The layout spelled out, row by row: a sequence's new tokens in the last columns of its window."""
    ref = {"input_ids": [], "positions": [], "slot_mapping": [], "logits_rows": [], "seq_lens": []}
    for i, (seq, n, draft) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.spec)):
        seq_len = seq.num_computed_tokens + n
        new = seq.token_ids[seq.num_computed_tokens:] + draft
        ref["seq_lens"].append(seq_len)
        for c in range(Q):
            p = seq_len - Q + c
            real = c >= Q - n
            ref["positions"].append(max(p, 0))
            ref["slot_mapping"].append(seq.block_table[p // block_size] * block_size + p % block_size if real else -1)
            ref["input_ids"].append(new[c - (Q - n)] if real else 0)
            if real:
                ref["logits_rows"].append(i * Q + c)
    pad = padded - len(batch.seqs)
    ref["seq_lens"] += [0] * pad
    ref["positions"] += [0] * pad * Q
    ref["slot_mapping"] += [-1] * pad * Q
    ref["input_ids"] += [0] * pad * Q
    return ref


def test_window_layout_full_and_partial_windows():
    """Every window full (each sequence k drafts: no padding rows) and windows with padding rows,
    each with and without padding sequences, against the layout spelled out; stale values in the
    views (a reused pinned buffer) are overwritten."""
    block_size = 4
    params = SamplingParams(temperature=0.0)
    seqs = []
    for i, length in enumerate([9, 14, 3]):
        seq = Sequence(list(range(10 * i, 10 * i + length)), params, seed=i)
        seq.num_computed_tokens = length - 1
        seq.block_table = [7 * i + b for b in range(-(-(length + K) // block_size))]
        seqs.append(seq)
    full = ScheduledBatch(seqs, [Q] * 3, num_decodes=0, spec=[[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    partial = ScheduledBatch(seqs, [Q, 1, 3], num_decodes=0, spec=[[1, 2, 3], [], [7, 8]])
    for batch in (full, partial):
        for padded in (3, 4):
            views = _views(4, 8)
            for a in views.values():
                a.fill(55)
            num_rows = fill_verify_inputs(views, batch, padded, Q, block_size)
            ref = _window_reference(batch, padded, block_size)
            assert num_rows == len(ref["logits_rows"])
            assert views["logits_rows"][:num_rows].tolist() == ref["logits_rows"]
            for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
                assert views[name][:len(ref[name])].tolist() == ref[name], (name, batch.num_new_tokens, padded)
            lens = views["seq_lens"][:3]
            expected_order = np.argsort(-lens, kind="stable").tolist() + [3] * (padded - 3)
            assert views["decode_order"][:padded].tolist() == expected_order


def test_window_layout_orders_equal_contexts_in_batch_order():
    """decode_order: longest context first, equal ones in batch order (as a stable argsort would)."""
    block_size = 4
    params = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.choice([5, 9, 9, 14], int(rng.integers(1, 8))).tolist()
        seqs = []
        for i, length in enumerate(lengths):
            seq = Sequence(list(range(length)), params, seed=i)
            seq.num_computed_tokens = length - 1
            seq.block_table = [50 * i + b for b in range(-(-(length + K) // block_size))]
            seqs.append(seq)
        batch = ScheduledBatch(seqs, [Q] * len(seqs), num_decodes=0, spec=[[1, 2, 3]] * len(seqs))
        padded = len(seqs) + 1
        views = _views(padded, 8)
        fill_verify_inputs(views, batch, padded, Q, block_size)
        ref = _window_reference(batch, padded, block_size)
        assert views["slot_mapping"][:len(ref["slot_mapping"])].tolist() == ref["slot_mapping"]
        seq_lens = np.asarray(lengths) + K
        expected = np.argsort(-seq_lens, kind="stable").tolist() + [len(seqs)]
        assert views["decode_order"][:padded].tolist() == expected
