"""/v1/completions and /v1/chat/completions on top of AsyncLLMEngine: prompts to token ids, request
fields to SamplingParams, engine outputs to OpenAI responses or server-sent-event chunks.

Tokenization and chat templates run on the server's own tokenizer instance, on worker threads
(`TokenizePool`), never on the event loop.
"""
import asyncio
import functools
import json
import time

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanovllm.engine.async_engine import AsyncLLMEngine, RequestHandle
from nanovllm.engine.request_output import CompletionOutput, RequestOutput, RequestRejected
from nanovllm.entrypoints.openai.chat_output import ChatOutputStream
from nanovllm.entrypoints.openai.chat_prompt import chat_prompt_text
from nanovllm.entrypoints.openai.protocol import (
    APIError, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs,
    CompletionRequest, CompletionResponse, DeltaMessage, FunctionCall, PromptTokensDetails, SamplingRequest,
    TokenLogprob, ToolCall, TopLogprob, Usage, random_id)
from nanovllm.entrypoints.openai.structured_requests import check_not_implemented, logit_bias, structured_outputs
from nanovllm.entrypoints.openai.tokenize_pool import TokenizePool
from nanovllm.entrypoints.openai.tool_parsers import ToolSet
from nanovllm.reasoning import reasoning_parser
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams

_MAX_N = 128            # completions per prompt: beyond this a request is more likely a mistake than a need
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class _ClientGone(Exception):
    pass


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
        job = _Job(random_id("cmpl"), self._model_name(req), req.n, handles, prompts)
        finals = await _stream_or_collect(req, job, handles, out_queue, raw, self._completion_chunks)
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
        job = _Job(random_id("chatcmpl"), self._model_name(req), req.n, handles, [ids])
        job.output_stream = lambda: ChatOutputStream(self.reasoning, ids, tools)
        job.tools = tools
        finals = await _stream_or_collect(req, job, handles, out_queue, raw, self._chat_chunks)
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
            _abort(handles)
            raise
        if errors:
            _abort(handles)
            e = errors[0]
            status = getattr(e, "status", 500)
            # The engine's 400s name what they reject first: a sampling field (logit_bias ids past the
            # vocabulary, a grammar that does not compile), or else the prompt.
            field = str(e).split(" ", 1)[0].split(".", 1)[0]
            param = field if field in SamplingParams.__dataclass_fields__ else prompt_field
            raise APIError(str(e), status, param=param if status == 400 else None)
        return handles, out_queue

    # ---- responses ------------------------------------------------------------------------
    async def _completion_chunks(self, job: "_Job", out_queue: asyncio.Queue, include_usage: bool):
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

    async def _chat_chunks(self, job: "_Job", out_queue: asyncio.Queue, include_usage: bool):
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

    def _chat_choice(self, job: "_Job", output) -> ChatChoice:
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


class _Job:
    """One HTTP request's engine requests: choice numbering (prompt i's completions are choices
    i*n ... i*n+n-1, as vLLM numbers them) and usage."""

    def __init__(self, id_: str, model: str, n: int, handles: list[RequestHandle], prompts: list[list[int]]):
        self.id, self.model, self.n = id_, model, n
        self.output_stream = None  # chat: () -> ChatOutputStream, one per choice
        self.tools = None          # chat: the request's ToolSet
        self.base = {h.request_id: i * n for i, h in enumerate(handles)}
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.last: dict = {}  # request_id -> its latest RequestOutput
        self.num_tokens: dict = {}  # choice index -> completion tokens so far
        self.finished_choices: set[int] = set()
        self.error: RequestRejected | None = None  # why the stream ended early, if it failed

    def completions(self, finals: dict):
        for request_id, out in finals.items():
            for output in out.outputs:
                self.num_tokens[self.base[request_id] + output.index] = output.num_tokens
                yield output, self.base[request_id]

    async def stream(self, out_queue: asyncio.Queue):
        """(request output, completion output, choice index) as the engine produces them. Outputs
        that queued up while the client was being served are merged into one per choice: under
        load a stream sends one chunk per pass instead of one per token, so the server's work
        follows what the clients can take rather than the token rate."""
        pending = set(self.base)
        while pending:
            batch = [await out_queue.get()]
            while True:
                try:
                    batch.append(out_queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            merged: dict[str, RequestOutput] = {}
            for out in batch:
                if out.error is not None:
                    self.error = out.error
                    break
                rid = out.request_id
                merged[rid] = merged[rid].followed_by(out) if rid in merged else out
                if out.finished:
                    pending.discard(rid)
            if self.error is not None:  # a failure ends the stream: the choices still open end as aborted
                for rid in pending:
                    merged[rid] = self._aborted(rid, merged.get(rid))
                pending = set()
            for request_id, out in merged.items():
                self.last[request_id] = out
                for output in out.outputs:
                    index = self.base[request_id] + output.index
                    self.num_tokens[index] = output.num_tokens
                    if output.finish_reason is not None:
                        self.finished_choices.add(index)
                    yield out, output, index

    def _aborted(self, request_id: str, sofar: RequestOutput | None) -> RequestOutput:
        """A request cut short, as its last output: what came so far (sofar, not yet sent), and
        finish_reason "abort" for each choice that had not finished."""
        base = self.base[request_id]
        outputs = {o.index: o for o in sofar.outputs} if sofar is not None else {}
        for i in range(self.n):
            if base + i in self.finished_choices or (i in outputs and outputs[i].finish_reason is not None):
                continue
            o = outputs.get(i)
            outputs[i] = CompletionOutput(i, o.text if o else "", o.token_ids if o else [],
                                          o.logprobs if o else None, "abort", None,
                                          o.num_tokens if o else self.num_tokens.get(base + i, 0))
        last = sofar or self.last.get(request_id)
        return RequestOutput(request_id, list(outputs.values()), True, last.num_prompt_tokens if last else 0,
                             last.num_cached_tokens if last else 0)

    def usage(self, finals: dict) -> Usage:
        completion = sum(self.num_tokens.values())
        cached = sum(out.num_cached_tokens for out in finals.values())
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _stream_or_collect(req, job: "_Job", handles: list[RequestHandle], out_queue: asyncio.Queue,
                             raw: Request, chunks):
    """A streaming request's SSE response (chunks: the endpoint's chunk generator); otherwise
    the final outputs, or a 499 response when the client went away first."""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _sse(chunks(job, out_queue, include_usage), handles, job)
    finals = await _collect(handles, out_queue, raw)
    return Response(status_code=499) if finals is None else finals


def _num_prompts(prompt) -> int:
    """How many prompts a completions `prompt` holds: a string, token ids, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _holds_text(prompt) -> bool:
    """Whether a completions `prompt` has text to tokenize (else it is token ids only)."""
    return isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], str))


def _abort(handles: list[RequestHandle]):
    for h in handles:
        h.abort()


async def _wait_disconnect(raw: Request):
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _collect(handles: list[RequestHandle], out_queue: asyncio.Queue, raw: Request) -> dict | None:
    """Final outputs by request id; None if the client disconnected first (its requests are
    aborted at once: nothing else would notice, as no response is being written yet)."""
    pending = {h.request_id for h in handles}
    finals = {}
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        while pending:
            getter = asyncio.ensure_future(out_queue.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                raise _ClientGone
            out = getter.result()
            if out.error is not None:
                raise APIError(str(out.error), out.error.status)
            if out.finished:
                finals[out.request_id] = out
                pending.discard(out.request_id)
        return finals
    except _ClientGone:
        return None
    finally:
        watcher.cancel()
        _abort(handles)


def _sse(chunks, handles: list[RequestHandle], job: "_Job") -> StreamingResponse:
    async def events():
        try:
            async for data in chunks:
                yield f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
        finally:
            # A closed stream (client gone, or cancelled) stops generation and frees the blocks now.
            _abort(handles)
        if job.error is not None:  # failed mid-stream (after its final chunks): the status line is
            e = job.error          # long gone, so say it here
            yield f"data: {json.dumps(APIError(str(e), e.status).body())}\n\n"
        yield "data: [DONE]\n\n"
    return _EventStream(events(), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _EventStream(StreamingResponse):
    """Starlette's StreamingResponse with the roles of its two tasks swapped: the request's own task
    writes the chunks and a task started aside watches for the client's disconnect (which cancels
    the stream, and its engine requests with it). The other way round, a new stream's first chunk
    waited for the started task's first turn of the event loop, behind every stream's next chunk."""

    async def __call__(self, scope, receive, send):
        failure = None
        async with anyio.create_task_group() as watching:
            async def cancel_on_disconnect():
                await self.listen_for_disconnect(receive)
                watching.cancel_scope.cancel()
            watching.start_soon(cancel_on_disconnect)
            try:
                await self.stream_response(send)
            except Exception as e:  # raised below as itself, not inside the task group's exception group
                failure = e
            watching.cancel_scope.cancel()
        if failure is not None:
            raise failure
