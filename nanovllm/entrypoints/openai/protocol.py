"""OpenAI API request and response shapes (pydantic), and their mapping onto SamplingParams.

Requests check types only; value ranges are SamplingParams' job (one place, with messages that
name the field), whose ValueError the server turns into a 400.
"""
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from nanovllm.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        message = _printable(message)  # it may echo the input: never fail to encode it
        param = _printable(param) if param is not None else None
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _printable(text: str) -> str:
    """text, with lone surrogates (which UTF-8 cannot encode) written as escapes."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIModel(BaseModel):
    # Clients send fields we have no use for (user, metadata, store...): ignore them. No float
    # field takes NaN or an infinity (JSON has neither; Python's parser and pydantic accept both).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


# Request fields copied onto SamplingParams as they are, when given.
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "seed",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                "include_stop_str_in_output", "skip_special_tokens")


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extensions included)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured outputs (structured_requests.py): OpenAI's, and vLLM's two spellings.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM fields that would change the output and that this server does not implement: a 400 when
    # set to anything but their no-op value (structured_requests.check_not_implemented), never ignored.
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    vllm_xargs: Any = None

    def check_common(self):
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None, **extra) -> SamplingParams:
        """extra: SamplingParams fields the endpoint derives (logit_bias, structured_outputs)."""
        kwargs = {name: getattr(self, name) for name in _PASSTHROUGH if getattr(self, name) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs, **extra)
        except (ValueError, TypeError) as e:
            message = str(e)
            field = message.split(" ", 1)[0]
            raise APIError(message, param=field if field in SamplingParams.__dataclass_fields__ else None) from None


class CompletionRequest(SamplingRequest):
    # A string, token ids, a list of strings, or a list of token-id lists. Strict ints, tried before
    # strings: validating a million token ids as strings first took pydantic 0.8 s (on the event loop).
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens around a text prompt
    prompt_embeds: Any = None        # not implemented: a 400 when set


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: handed to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; omitted: no parameters
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the template already holds the special tokens
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # OpenAI fields that would change the output and that this server does not implement (400 when set).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    mm_processor_kwargs: Any = None


class TokenizeRequest(OpenAIModel):
    """vLLM's POST /tokenize: a completion `prompt`, or chat `messages` through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with a reasoning parser (nanovllm.reasoning)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {"index", then "id", "type", "function": {...}} pieces


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanovllm"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
