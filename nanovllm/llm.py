"""The offline entry point: `LLM(model, **config).generate(prompts, sampling_params)`."""
import time
from collections.abc import Iterator
from itertools import count

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence
from nanovllm.models.model_path import resolve_model_path
from nanovllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        unknown = sorted(set(kwargs) - Config.field_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s): {', '.join(unknown)}; "
                            f"valid options are the fields of nanovllm.config.Config")
        config = Config(resolve_model_path(model), **kwargs)
        self.config = config
        self.engine = LLMEngine(config)
        self._request_ids = count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict:
        """The engine's counters since it started (LLMEngine.get_metrics): preemptions, prefix-cache
        tokens, and with speculative decoding spec_decode_num_drafts, spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens and spec_decode_num_accepted_tokens_per_pos."""
        return self.engine.get_metrics()

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        # Validate everything before queuing anything, so a bad prompt costs no work.
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for sp in params:
            self.engine.check_params(sp)
        requests = [self.engine.add_request(next(self._request_ids), ids, sp) for ids, sp in zip(token_ids, params)]
        remaining = {id(seq) for seqs in requests for seq in seqs}
        seqs_left_per_request = [len(seqs) for seqs in requests]
        request_of_seq = {id(seq): i for i, seqs in enumerate(requests) for seq in seqs}
        # A request's output is built as soon as its last sequence finishes: on a GPU the host does it
        # while the device runs the next steps, instead of for every request after the last step.
        outputs: list[dict | None] = [None] * len(requests)
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while remaining:
                start = time.perf_counter()
                finished, num_prefill, num_decode = self.engine.step()
                elapsed = max(time.perf_counter() - start, 1e-9)
                if num_prefill:
                    bar.set_postfix_str(f"prefill {num_prefill / elapsed:,.0f} tok/s", refresh=False)
                elif num_decode:
                    bar.set_postfix_str(f"decode {num_decode / elapsed:,.0f} tok/s", refresh=False)
                for seq in finished:
                    remaining.discard(id(seq))
                    r = request_of_seq[id(seq)]
                    seqs_left_per_request[r] -= 1
                    if seqs_left_per_request[r] == 0:
                        outputs[r] = self._request_output(requests[r])
                        bar.update(1)
        except BaseException:
            for seqs in requests:
                self.engine.abort_request(seqs[0].request_id)
            raise
        finally:
            bar.close()
        return outputs

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, **template_kwargs) -> list[dict]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer, so it has no chat template")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts or of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [tokenizer.apply_chat_template(list(conv), tokenize=False, add_generation_prompt=True,
                                                 **template_kwargs) for conv in conversations]
        # The template already holds any special tokens: tokenize without adding them again.
        token_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """The text of one completion, yielded piece by piece as it is generated."""
        sp = sampling_params or SamplingParams()
        if sp.n != 1:
            raise ValueError(f"stream() produces one completion: n must be 1, got {sp.n}")
        if self.engine.tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer: there is no text to stream")
        token_ids = self.engine.tokenize(prompt)
        request_id = next(self._request_ids)
        seq, = self.engine.add_request(request_id, token_ids, sp)
        processor = self.engine.output_processor
        processor.watch(seq)
        try:
            while not seq.is_finished:
                self.engine.step()
                delta = processor.take_delta(seq)
                if delta:
                    yield delta
            delta = processor.take_delta(seq)
            if delta:
                yield delta
        finally:
            if not seq.is_finished:
                self.engine.abort_request(request_id)

    def _request_output(self, seqs: list[Sequence]) -> dict:
        outputs = [self._completion(seq) for seq in seqs]
        first = seqs[0]
        return {**outputs[0], "prompt_token_ids": first.prompt_token_ids,
                "num_cached_tokens": first.num_cached_tokens, "outputs": outputs}

    def _completion(self, seq: Sequence) -> dict:
        out = {"index": seq.index, "text": self.engine.output_processor.text(seq),
               "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason}
        if seq.logprobs is not None:
            out["logprobs"] = seq.logprobs
        return out

    # ---- lifecycle ----------------------------------------------------------------------
    def shutdown(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        if not prompts:
            raise ValueError("prompts must not be empty")
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of strings or a list of token-id lists, "
                    f"got {type(prompts).__name__}")


def _as_params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts; "
                             "pass one SamplingParams or exactly one per prompt")
        if not all(isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError("sampling_params must be SamplingParams objects")
        return list(sampling_params)
    raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
