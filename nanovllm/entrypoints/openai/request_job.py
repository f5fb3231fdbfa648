"""One HTTP request's engine requests on their way back (`Job`: choice numbering, usage, the merged
stream of outputs), and its response: the final outputs collected (aborted if the client goes away
first) or a server-sent-event stream (`stream_or_collect`)."""
import asyncio
import json

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from nanovllm.engine.async_engine import RequestHandle
from nanovllm.engine.request_output import CompletionOutput, RequestOutput, RequestRejected
from nanovllm.entrypoints.openai.protocol import APIError, PromptTokensDetails, Usage


class _ClientGone(Exception):
    pass


class Job:
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


async def stream_or_collect(req, job: Job, handles: list[RequestHandle], out_queue: asyncio.Queue,
                             raw: Request, chunks):
    """A streaming request's SSE response (chunks: the endpoint's chunk generator); otherwise
    the final outputs, or a 499 response when the client went away first."""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _sse(chunks(job, out_queue, include_usage), handles, job)
    finals = await _collect(handles, out_queue, raw)
    return Response(status_code=499) if finals is None else finals


def abort(handles: list[RequestHandle]):
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
        abort(handles)


def _sse(chunks, handles: list[RequestHandle], job: Job) -> StreamingResponse:
    async def events():
        try:
            async for data in chunks:
                yield f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
        finally:
            # A closed stream (client gone, or cancelled) stops generation and frees the blocks now.
            abort(handles)
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
