"""vLLM's POST /tokenize and /detokenize: the token ids the server would run for a completion prompt
or a chat conversation (its chat template applied), and the text of token ids. Routers that place
requests by the KV-cache blocks the replicas hold (vllm-router's kv_aware policy) ask a replica for a
prompt's ids here, then match them against the blocks its KV events announced."""
import functools

from fastapi.responses import JSONResponse

from nanovllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, TokenizeResponse)
from nanovllm.entrypoints.openai.tool_parsers import ToolSet


class Tokenization:
    def __init__(self, serving):
        self.serving = serving  # its tokenizer, tokenize pool, model names and chat prompt

    async def tokenize(self, req: TokenizeRequest) -> JSONResponse:
        serving = self.serving
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt" if req.prompt is None
                           else "messages")
        tokenizer = serving.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt" if req.messages is None else "messages")
        if req.messages is not None:
            chat = ChatCompletionRequest(model=req.model, messages=req.messages, tools=req.tools,
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         add_special_tokens=bool(req.add_special_tokens),
                                         chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)
            ids = await serving.tokenize_pool.run(serving._chat_prompt, chat, ToolSet.from_request(chat))
        else:
            if not req.prompt:
                raise APIError("prompt must not be an empty string", param="prompt")
            serving.tokenize_pool.check_length(len(req.prompt), "prompt")
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            encode = functools.partial(tokenizer.encode, add_special_tokens=add_special)
            ids = await serving.tokenize_pool.run(encode, req.prompt)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs)
        return JSONResponse(body.model_dump(mode="json"))

    async def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        serving = self.serving
        serving.check_model(req.model)
        if serving.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        vocab = len(serving.tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens holds {bad}, outside the vocabulary's ids [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})
