"""Start-up work of the model runner (worker/warmup.py) and the engine that must leave nothing behind."""
import gc

from nanovllm import LLM, SamplingParams
from nanovllm.worker.warmup import WARM_SAMPLING, run_largest_step, warm_sampler

KWARGS = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8)


def _generate(llm):
    prompts = [[1, 2, 3, 4, 5], [7] * 40, list(range(100, 190))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_largest_step_leaves_no_state_behind(model_factory):
    """The step that takes the activations back into the allocator at the end of a GPU start-up
    writes into cache blocks no request holds yet: later outputs must not change."""
    path = model_factory("qwen3")
    with LLM(path, **KWARGS) as llm:
        expect = _generate(llm)
    with LLM(path, **KWARGS) as llm:
        runner = llm.engine.model_runner
        run_largest_step(runner, llm.config.max_num_batched_tokens, llm.config.max_num_seqs, runner.num_blocks)
        assert _generate(llm) == expect


def test_engine_freezes_its_start_up_heap_until_shutdown(model_factory):
    with LLM(model_factory("qwen3"), **KWARGS) as llm:
        assert gc.get_freeze_count() > 0  # out of the collector's reach while the engine runs
        _generate(llm)
    assert gc.get_freeze_count() == 0


def test_sampler_warm_up_takes_every_eager_path_and_leaves_no_state_behind(model_factory):
    """The start-up run of the eager sampler's paths (on a GPU, where CUDA loads each library kernel
    on its first call) accepts its parameter sets, none of them the plain draw, and changes no later
    output."""
    assert not any(SamplingParams(temperature=0.8, **extra).plain for extra in WARM_SAMPLING)
    path = model_factory("qwen3")
    with LLM(path, **KWARGS) as llm:
        expect = _generate(llm)
    with LLM(path, **KWARGS) as llm:
        warm_sampler(llm.engine.model_runner)
        assert _generate(llm) == expect
