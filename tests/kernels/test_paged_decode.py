import pytest
import torch

from attention_dtypes import DTYPES, ON_GPU, TOL
from nanovllm.kernels import alloc_decode_workspace, choose_num_splits, paged_decode_attention
from nanovllm.kernels import reference as ref


def _run_case(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
              num_splits=None, workspace=None, order=None, config=None):
    k_cache, v_cache, block_tables = ref.random_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    # q as a non-contiguous view (rows of a fused qkv output).
    qkv = torch.randn(len(seq_lens), 2 * num_q_heads, head_dim, generator=gen).to(device, dtype)
    q = qkv[:, :num_q_heads]
    scale = head_dim ** -0.5

    out = torch.full((len(seq_lens), num_q_heads, head_dim), float("nan"), dtype=dtype,
                     device=device)  # poisoned: every element must be written
    res = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale, out=out,
                                 num_splits=num_splits, workspace=workspace, order=order, _config=config)
    assert res is out
    expect = ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale)
    assert not out.isnan().any()
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), expect.float(), atol=tol, rtol=tol)
    return out


def _lens(gen, batch, max_len):
    return torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,block_size",
    [
        (4, 4, 64, 16),  # MHA, tiles span several cache blocks
        (8, 2, 128, 64),  # GQA 4
        (16, 2, 64, 256),  # GQA 8, tile inside one block
    ],
)
def test_decode_matches_reference(num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                  device, gen):
    max_len = 4096 if ON_GPU else 300
    seq_lens = _lens(gen, 24 if ON_GPU else 5, max_len)
    seq_lens[1] = 0  # padding row: zeros, not NaN
    seq_lens[2] = 1
    seq_lens[-1] = max_len
    out = _run_case(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, gen)
    assert not out[1].any()


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_split_counts(num_splits, device, gen):
    """Split counts that leave some splits empty for short rows must merge correctly."""
    seq_lens = [1, 2, 0, 130, 64]
    if ON_GPU:
        seq_lens += [4096, 1000, 17]
    _run_case(seq_lens, 4, 2, 64, 16, torch.float16, device, gen, num_splits=num_splits)


def test_decode_odd_shapes(device, gen):
    """head_dim that is not a power of two, and a GQA group larger than one head tile."""
    dtype = torch.float32 if not ON_GPU else torch.float16
    _run_case([33, 0, 70], 6, 2, 80, 16, dtype, device, gen)  # group 3, D=80
    _run_case([40, 5], 128, 1, 32, 64, dtype, device, gen, num_splits=2)  # group 128


def test_decode_preallocated_workspace(device, gen):
    """Graph-style use: one workspace sized for the max batch, reused across calls."""
    num_splits = 4
    ws = alloc_decode_workspace(8, 8, 64, num_splits, device)
    for seq_lens in ([5, 100, 0], [64, 1, 2, 3, 150, 0, 7, 33]):
        _run_case(seq_lens, 8, 4, 64, 16, torch.float16, device, gen,
                  num_splits=num_splits, workspace=ws)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_longest_first_order(num_splits, device, gen):
    """Programs dispatched longest-first (a permutation of the rows) give the same outputs."""
    seq_lens = [5, 300, 0, 77, 160, 1]
    order = torch.tensor(sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]), dtype=torch.int32, device=device)
    dtype = torch.float32 if not ON_GPU else torch.float16
    _run_case(seq_lens, 8, 2, 64, 16, dtype, device, gen, num_splits=num_splits, order=order)


def test_decode_all_padding(device, gen):
    out = _run_case([0, 0], 4, 2, 64, 16, torch.float16, device, gen, num_splits=2)
    assert not out.any()


def test_choose_num_splits_is_host_only():
    cpu = torch.device("cpu")
    # Many programs already: no split.  Few programs: split, bounded by the length hint.
    assert choose_num_splits(512, 32, 8, 128, cpu) == 1
    assert choose_num_splits(1, 16, 8, 128, cpu) > 1
    assert choose_num_splits(1, 16, 8, 128, cpu, max_seq_len_hint=100) == 1
    assert 1 <= choose_num_splits(1, 64, 1, 128, cpu) <= 64


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_decode_launch_variants_cover_every_batch(kv_fp8, monkeypatch):
    """The warm-up's decode counts (worker/warmup.compile_kernels) reach every compiled variant
    that some batch of 1..512 picks, each from its smallest batch; on the H200's 132 SMs with
    Qwen3-0.6B's heads that includes the merge over 3-4 splits (9-15 sequences), which nothing
    else compiled before a multi-turn run met it, and over an FP8 cache the split kernel's two
    warp counts."""
    from nanovllm.kernels import decode_plan
    monkeypatch.setattr(decode_plan, "device_sms", lambda device: 132)
    cpu = torch.device("cpu")

    def variant(batch):  # what the launch compiles, as paged_decode_attention picks it
        splits = choose_num_splits(batch, 16, 8, 128, cpu, 8192)
        warps = decode_plan.launch_config(batch, 16, 8, 128, cpu, splits, kv_fp8=kv_fp8)[2]
        return None if splits == 1 else decode_plan.merge_variant(splits, 128), warps

    batches = decode_plan.decode_launch_variants(512, 16, 8, 128, cpu, 8192, kv_fp8)
    assert batches == sorted(batches) and 9 in batches and variant(batches[-1])[0] is None  # direct from some batch on
    assert len({variant(b) for b in batches}) == len(batches)
    assert {variant(b)[1] for b in batches} == ({2, 4} if kv_fp8 else {4})
    for batch in range(1, 513):
        first = next(b for b in batches if variant(b) == variant(batch))
        assert first <= batch


def test_split_counts_make_one_wave_for_few_sequences(monkeypatch):
    """On an H200-sized GPU (132 SMs): few sequences get one wave of programs that all run at once
    (at most 3 per SM), and up to 4 sequence x KV-head items per SM at least two splits (a ragged
    batch in one wave of whole sequences waits for its longest; kernels/decode_plan.py's figures)."""
    from nanovllm.kernels import decode_plan
    monkeypatch.setattr(decode_plan, "device_sms", lambda device: 132)
    gpu = torch.device("cuda")  # only passed through to the patched SM count
    seen = {}
    for batch in range(1, 257):
        splits = choose_num_splits(batch, 16, 8, 128, gpu, max_seq_len_hint=4096)
        items = batch * 8
        seen[batch] = splits
        assert splits >= (2 if items <= 4 * 132 else 1), batch
        if splits > 2:
            assert items * splits <= 3 * 132, (batch, splits)
    assert (seen[8], seen[16], seen[32], seen[64], seen[96]) == (5, 2, 2, 2, 1)


@pytest.mark.parametrize("block_size", [16, 64, 256])  # tiles across blocks, one block, inside one block
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_block_ids_carried_one_tile_ahead(block_size, num_splits, device, gen):
    """PREFETCH_BLOCKS (block ids loaded an iteration early) gives the same attention."""
    from nanovllm.kernels.decode_plan import decode_config
    config = (*decode_config(64, 2)[:4], True)
    seq_lens = [1, 0, 63, 64, 65, 300, 129]
    _run_case(seq_lens, 4, 2, 64, block_size, torch.float16, device, gen, num_splits=num_splits, config=config)


# ---- several query tokens per sequence (speculative verification) ------------------------------
def _run_multi_query(seq_lens, query_len, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
                     num_splits=None, order=None):
    k_cache, v_cache, block_tables = ref.random_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens) * query_len, num_q_heads, head_dim, generator=gen).to(device, dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, head_dim ** -0.5, out=out,
                           num_splits=num_splits, order=order, query_len=query_len)
    expect = ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, head_dim ** -0.5,
                                        query_len=query_len)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return out


MULTI_QUERY_SHAPES = [  # (query_len, num_q_heads, num_kv_heads, head_dim, block_size)
    (2, 4, 2, 64, 16),    # the draft model's first step: two tokens, GQA 2
    (4, 9, 3, 64, 16),    # SmolLM2's heads (GQA 3): 12 rows per KV head
    (6, 32, 8, 128, 64),  # Qwen3-8B's heads, k = 5: 24 rows
    (5, 16, 1, 32, 16),   # GQA 16 x 5 tokens = 80 rows: more than one program per KV head
]


def _multi_query_cases():
    """Every shape in every dtype and with both split counts, every (dtype, split count) pair: all
    the pairs of the three settings, half their product (the Qwen3-8B shape is the interpreter's
    slowest)."""
    cases = []
    for s, shape in enumerate(MULTI_QUERY_SHAPES):
        for d, dtype in enumerate(DTYPES):
            num_splits = (1, 3)[(s + d) % 2]
            cases.append(pytest.param(*shape, num_splits, dtype,
                                      id=f"{'-'.join(map(str, shape))}-{num_splits}-{str(dtype)[6:]}"))
    return cases


@pytest.mark.parametrize("query_len,num_q_heads,num_kv_heads,head_dim,block_size,num_splits,dtype",
                         _multi_query_cases())
def test_multi_query_decode_matches_reference(query_len, num_q_heads, num_kv_heads, head_dim, block_size, num_splits,
                                              dtype, device, gen):
    """Each sequence's last query_len positions, causal among themselves, every split count: rows
    whose keys a split does not reach merge to the right output."""
    seq_lens = [query_len, 0, 37, 64, 65, 130]
    _run_multi_query(seq_lens, query_len, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
                     num_splits=num_splits)


def test_multi_query_decode_rows_before_the_context_are_zero(device, gen):
    """A sequence shorter than the window (a verification step padded on the left): the rows at
    negative positions see no key and come out as zeros, the others are exact."""
    dtype = torch.float32 if not ON_GPU else torch.float16
    out = _run_multi_query([2, 5, 1], 4, 4, 2, 64, 16, dtype, device, gen, num_splits=2)
    assert not out[0:2].any() and not out[8:11].any()


def test_multi_query_decode_longest_first_order(device, gen):
    seq_lens = [6, 300, 0, 77, 160, 9]
    order = torch.tensor(sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]), dtype=torch.int32, device=device)
    dtype = torch.float32 if not ON_GPU else torch.float16
    _run_multi_query(seq_lens, 3, 8, 2, 64, 16, dtype, device, gen, num_splits=2, order=order)


def test_one_query_token_is_plain_decode(device, gen):
    """query_len=1 is the decode kernel of old: the same outputs as the reference's one-token form."""
    dtype = torch.float32 if not ON_GPU else torch.float16
    _run_multi_query([1, 50, 0, 200], 1, 8, 2, 64, 16, dtype, device, gen, num_splits=2)
