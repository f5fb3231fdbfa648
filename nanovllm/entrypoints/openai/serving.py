"""/v1/completions and /v1/chat/completions on top of AsyncLLMEngine: prompts to token ids, request
fields to SamplingParams, engine outputs to OpenAI responses or server-sent-event chunks.

Tokenization and chat templates run on the server's own tokenizer instance, on worker threads
(`TokenizePool`), never on the event loop.
"""
import asyncio
import functools
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.engine.request_output import RequestRejected
from nanovllm.entrypoints.openai.chat_output import ChatOutputStream
from nanovllm.entrypoints.openai.chat_prompt import chat_prompt_text
from nanovllm.entrypoints.openai.protocol import (
    APIError, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs,
    CompletionRequest, CompletionResponse, DeltaMessage, FunctionCall, SamplingRequest, TokenLogprob, ToolCall,
    TopLogprob, random_id)
from nanovllm.entrypoints.openai.request_job import Job, abort, stream_or_collect
from nanovllm.entrypoints.openai.structured_requests import check_not_implemented, logit_bias, structured_outputs
from nanovllm.entrypoints.openai.tokenize_pool import TokenizePool
from nanovllm.entrypoints.openai.tool_parsers import ToolSet
from nanovllm.reasoning import reasoning_parser
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams

_MAX_N = 128            # completions per prompt: beyond this a request is more likely a mistake than a need
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_names: list[str]):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_model_len = engine.config.max_model_len
        self.tokenize_pool = TokenizePool(tokenizer, self.max_model_len)
        name = getattr(engine.config, "reasoning_parser", None)
        self.reasoning = reasoning_parser(name, tokenizer) if name else None  # splits reasoning_content out
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)

    # ---- entry points ---------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.echo:
            raise APIError("echo is not supported", param="echo")
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of is not supported (other than best_of == n)", param="best_of")
        self._check_capacity(_num_prompts(req.prompt))  # before tokenizing what could not be queued anyway
        constraint, _ = structured_outputs(req)
        if _holds_text(req.prompt):
            prompts = await self.tokenize_pool.run(self._completion_prompts, req.prompt, req.add_special_tokens)
        else:
            # Token ids are only checked: here, not on a worker thread (a hop there and back, each
            # waiting its turn on a busy event loop: milliseconds of TTFT).
            prompts = self._completion_prompts(req.prompt)
        params = [self._params(req, ids, req.max_tokens if req.max_tokens is not None else 16, req.logprobs, "prompt",
                               structured_outputs=constraint) for ids in prompts]
        handles, out_queue = await self._submit(prompts, params, req.stream, "prompt")
        job = Job(random_id("cmpl"), self._model_name(req), req.n, handles, prompts)
        finals = await stream_or_collect(req, job, handles, out_queue, raw, self._completion_chunks)
        if isinstance(finals, Response):
            return finals
        choices = []
        for output, base in job.completions(finals):
            logprobs = self._completion_logprobs(output.logprobs, 0) if output.logprobs is not None else None
            choices.append(CompletionChoice(index=base + output.index, text=output.text, logprobs=logprobs,
                                            finish_reason=output.finish_reason, stop_reason=output.stop_reason))
        choices.sort(key=lambda c: c.index)  # finals come in finishing order
        body = CompletionResponse(id=job.id, model=job.model, choices=choices, usage=job.usage(finals))
        return JSONResponse(body.model_dump(mode="json"))

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                           param="top_logprobs")
        tools = ToolSet.from_request(req)
        constraint, source = structured_outputs(req)
        tool_constraint = tools.constraint() if tools is not None else None
        if tool_constraint is not None and constraint is not None:
            raise APIError(f"{source} cannot be combined with tool_choice {req.tool_choice!r}, which constrains "
                           "the output to tool calls", param=source)
        self._check_capacity(1)
        ids = await self.tokenize_pool.run(self._chat_prompt, req, tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(ids))  # as OpenAI: up to the context's end
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = [self._params(req, ids, max_tokens, logprobs, "messages",
                               structured_outputs=tool_constraint or constraint)]
        handles, out_queue = await self._submit([ids], params, req.stream, "messages")
        job = Job(random_id("chatcmpl"), self._model_name(req), req.n, handles, [ids])
        job.output_stream = lambda: ChatOutputStream(self.reasoning, ids, tools)
        job.tools = tools
        finals = await stream_or_collect(req, job, handles, out_queue, raw, self._chat_chunks)
        if isinstance(finals, Response):
            return finals
        choices = [self._chat_choice(job, output) for output, _ in job.completions(finals)]
        body = ChatCompletionResponse(id=job.id, model=job.model, choices=choices, usage=job.usage(finals))
        return JSONResponse(body.model_dump(mode="json"))

    # ---- requests -------------------------------------------------------------------------
    def check_model(self, model: str | None):
        if model is not None and model not in self.model_names:
            raise APIError(f"The model `{model}` does not exist. This server serves: {', '.join(self.model_names)}",
                           400, param="model", code="model_not_found")

    def _model_name(self, req: SamplingRequest) -> str:
        return req.model or self.model_names[0]

    def _check_common(self, req: SamplingRequest):
        self.check_model(req.model)
        req.check_common()
        check_not_implemented(req)
        if isinstance(req.n, int) and req.n > _MAX_N:
            raise APIError(f"n must be at most {_MAX_N}, got {req.n}", param="n")

    def _completion_prompts(self, prompt, add_special_tokens: bool = True) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompt = [prompt]
        token_ids = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise APIError("prompt must not be an empty string", param="prompt")
                if self.tokenizer is None:
                    raise APIError("this model has no tokenizer: send prompts as token ids", param="prompt")
                self.tokenize_pool.check_length(len(p), "prompt")
                p = self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
            if len(p) >= self.max_model_len:  # as the engine would say, without shipping it there
                raise APIError(f"prompt has {len(p)} tokens but max_model_len is {self.max_model_len}; the prompt "
                               "must leave room for at least one generated token", param="prompt")
            token_ids.append(list(p))
        return token_ids

    def _chat_prompt(self, req: ChatCompletionRequest, tools: ToolSet | None) -> list[int]:
        if self.tokenizer is None or not (getattr(self.tokenizer, "chat_template", None) or req.chat_template):
            raise APIError("this model has no chat template: use /v1/completions", param="messages")
        text = chat_prompt_text(self.tokenizer, req, tools, self.tokenize_pool.check_length)
        # The template already holds any special tokens: don't add them again (unless asked to).
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    def _params(self, req: SamplingRequest, ids: list[int], max_tokens: int, logprobs, prompt_field: str,
                structured_outputs=None):
        extra = {"structured_outputs": structured_outputs}
        if req.logit_bias:
            extra["logit_bias"] = logit_bias(req.logit_bias)
        params = req.sampling_params(max_tokens, logprobs, **extra)
        # A prompt that is too long on its own is the engine's to report; here, prompt + completion.
        if len(ids) < self.max_model_len < len(ids) + params.max_tokens:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the {prompt_field}, "
                           f"{params.max_tokens} for the completion). Reduce the {prompt_field} or max_tokens.",
                           param="max_tokens")
        return params

    def _check_capacity(self, num_prompts: int):
        try:
            self.engine.check_capacity(num_prompts)
        except RequestRejected as e:
            raise APIError(str(e), e.status, param="prompt" if e.status == 400 else None,
                           code="server_overloaded" if e.status == 503 else None) from None

    async def _submit(self, prompts, params, stream: bool, prompt_field: str):
        """Queue every prompt and wait until the engine took them all in; all or none."""
        self._check_capacity(len(prompts))
        out_queue: asyncio.Queue = asyncio.Queue()
        handles = [self.engine.add_request(ids, sp, stream, out_queue) for ids, sp in zip(prompts, params)]
        # The answers awaited one after the other, in this task: done when the last is in, as with
        # asyncio.gather, which then takes one more turn of the event loop (its callback, then this
        # task), behind every stream's next chunk: a new stream's first chunk waited for it.
        errors = []
        try:
            for h in handles:
                try:
                    await h.accepted
                except RequestRejected as e:
                    errors.append(e)
        except BaseException:  # cancelled: the client left before the engine answered
            for h in handles:
                h.accepted.cancel()  # as gather's cancellation did: no answer is left unread
            abort(handles)
            raise
        if errors:
            abort(handles)
            e = errors[0]
            status = getattr(e, "status", 500)
            # The engine's 400s name what they reject first: a sampling field (logit_bias ids past the
            # vocabulary, a grammar that does not compile), or else the prompt.
            field = str(e).split(" ", 1)[0].split(".", 1)[0]
            param = field if field in SamplingParams.__dataclass_fields__ else prompt_field
            raise APIError(str(e), status, param=param if status == 400 else None)
        return handles, out_queue

    # ---- responses ------------------------------------------------------------------------
    async def _completion_chunks(self, job: Job, out_queue: asyncio.Queue, include_usage: bool):
        created = int(time.time())
        offsets: dict[int, int] = {}  # choice index -> text offset, for logprobs' text_offset
        async for _, output, index in job.stream(out_queue):
            logprobs = None
            if output.logprobs is not None:
                logprobs = self._completion_logprobs(output.logprobs, offsets.get(index, 0))
                if logprobs.tokens:
                    offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            # Without a tokenizer there is no text: a chunk per step still reports progress.
            if output.text or output.finish_reason or output.logprobs or (self.tokenizer is None and output.token_ids):
                choice = CompletionChoice(index=index, text=output.text, logprobs=logprobs,
                                          finish_reason=output.finish_reason, stop_reason=output.stop_reason)
                chunk = CompletionChunk(id=job.id, created=created, model=job.model, choices=[choice])
                yield chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"})
        if include_usage:
            yield CompletionChunk(id=job.id, created=created, model=job.model, choices=[],
                                  usage=job.usage(job.last)).model_dump(mode="json")

    async def _chat_chunks(self, job: Job, out_queue: asyncio.Queue, include_usage: bool):
        created = int(time.time())

        def chunk(choices, usage=None):
            # As OpenAI: chunks carry "usage" (null until the last) only when include_usage asked for it.
            data = ChatCompletionChunk(id=job.id, created=created, model=job.model, choices=choices, usage=usage)
            data = data.model_dump(mode="json", exclude=None if include_usage else {"usage"})
            for c in data["choices"]:  # as OpenAI: a delta carries only the keys it sets
                c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
            return data

        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(job.n)])
        parsers: dict[int, ChatOutputStream] = {}
        async for _, output, index in job.stream(out_queue):
            parser = parsers.get(index) or parsers.setdefault(index, job.output_stream())
            parts = parser.feed(output.text)
            finish_reason = output.finish_reason
            if finish_reason is not None:  # the output is complete: what the parser held back goes out
                parts = _joined(parts, parser.finish())
                if job.tools is not None:
                    finish_reason = job.tools.finish_reason(finish_reason, bool(parser.tool_calls))
            if parts.content or parts.reasoning or parts.tool_calls or finish_reason or output.logprobs:
                delta = DeltaMessage(content=parts.content or None, reasoning_content=parts.reasoning or None,
                                     tool_calls=parts.tool_calls or None)
                yield chunk([ChatStreamChoice(index=index, delta=delta, logprobs=self._chat_logprobs(output.logprobs),
                                              finish_reason=finish_reason, stop_reason=output.stop_reason)])
        if include_usage:
            yield chunk([], job.usage(job.last))

    def _chat_choice(self, job: Job, output) -> ChatChoice:
        parser = job.output_stream()
        parts = parser.whole(output.text)
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parser.tool_calls]
        finish_reason = job.tools.finish_reason(output.finish_reason, bool(calls)) if job.tools else output.finish_reason
        message = ChatResponseMessage(content=parts.content or (None if calls else ""),
                                      reasoning_content=parts.reasoning or None, tool_calls=calls or None)
        return ChatChoice(index=output.index, message=message, logprobs=self._chat_logprobs(output.logprobs),
                          finish_reason=finish_reason, stop_reason=output.stop_reason)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _chat_logprobs(self, entries: list[dict] | None) -> ChatLogprobs | None:
        if entries is None:
            return None
        content = []
        for e in entries:
            text = self._token_text(e["token_id"])
            top = [TopLogprob(token=(t := self._token_text(x["token_id"])), logprob=max(x["logprob"], _MIN_LOGPROB),
                              bytes=list(t.encode())) for x in e.get("top_logprobs", [])]
            content.append(TokenLogprob(token=text, logprob=max(e["logprob"], _MIN_LOGPROB),
                                        bytes=list(text.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, entries: list[dict], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for e in entries:
            text = self._token_text(e["token_id"])
            out.tokens.append(text)
            out.token_logprobs.append(max(e["logprob"], _MIN_LOGPROB))
            top = {self._token_text(x["token_id"]): max(x["logprob"], _MIN_LOGPROB) for x in e.get("top_logprobs", [])}
            top.setdefault(text, max(e["logprob"], _MIN_LOGPROB))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out


def _joined(a, b):
    a.reasoning += b.reasoning
    a.content += b.content
    a.tool_calls += b.tool_calls
    return a


def _num_prompts(prompt) -> int:
    """How many prompts a completions `prompt` holds: a string, token ids, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _holds_text(prompt) -> bool:
    """Whether a completions `prompt` has text to tokenize (else it is token ids only)."""
    return isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], str))
