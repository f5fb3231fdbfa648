"""A chat request to prompt text: its messages (tool calls and tool results included), its tools and
the chat template's options (`chat_template`, `chat_template_kwargs`, `documents`,
`continue_final_message`).

Templates that know tools (they use the `tools` argument) get the tools, assistant `tool_calls`
(arguments as objects, as HF templates expect) and `tool` messages as they are. Others get the
Hermes convention spelled out in the messages: the default tool prompt in the system message, each
call as a `<tool_call>` block in the assistant's text, tool results as a user turn of
`<tool_response>` blocks, so that any template renders them.
"""
import json

from nanovllm.entrypoints.openai.protocol import APIError
from nanovllm.entrypoints.openai.tool_parsers import END_TAG, START_TAG, ToolSet, format_tool_call

_RESERVED_KWARGS = {"tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
                    "tokenize", "messages", "conversation"}
_PROBE_TOOL = {"type": "function", "function": {"name": "nanovllm_probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_takes_tools: dict[str, bool] = {}  # template text -> whether it renders `tools`


def default_tool_prompt(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{START_TAG}{END_TAG} XML tags:\n{START_TAG}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' f"{END_TAG}")


def template_takes_tools(tokenizer, chat_template: str | None) -> bool:
    """Whether the template renders a `tools` argument at all (found once per template, by rendering
    a probe conversation with and without a tool)."""
    key = chat_template or tokenizer.chat_template
    if key not in _takes_tools:
        probe = [{"role": "user", "content": "hi"}]
        try:
            with_tools = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], chat_template=chat_template,
                                                       tokenize=False, add_generation_prompt=True)
            without = tokenizer.apply_chat_template(probe, chat_template=chat_template, tokenize=False,
                                                    add_generation_prompt=True)
            _takes_tools[key] = with_tools != without
        except Exception:  # a template that cannot even render the probe: leave the failure to the request
            return False
    return _takes_tools[key]


def chat_prompt_text(tokenizer, req, tools: ToolSet | None, check_length=None) -> str:
    """check_length(chars, field), if given, refuses messages too long to fit before they are rendered."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(set(kwargs) & _RESERVED_KWARGS)
    if clash:
        raise APIError(f"chat_template_kwargs must not set {', '.join(clash)}: use the request's own fields",
                       param="chat_template_kwargs")
    messages = _messages(req)
    if check_length is not None:
        check_length(sum(len(m["content"]) for m in messages), "messages")
    native = template_takes_tools(tokenizer, req.chat_template)
    if tools is not None and native:
        kwargs["tools"] = tools.tools
    if not native:
        messages = _spelled_out(messages, tools)
    if req.documents is not None:
        kwargs["documents"] = req.documents
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message,
                                             chat_template=req.chat_template, **kwargs)
    except Exception as e:  # jinja's TemplateError, raise_exception() in the template...
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None


def _messages(req) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "\n".join(part["text"] for part in content)
        message = {**(m.model_extra or {}), "role": m.role, "content": content or ""}
        if message.get("tool_calls"):
            message["tool_calls"] = _tool_calls(i, message["tool_calls"])
        elif "tool_calls" in message:
            del message["tool_calls"]
        messages.append(message)
    return messages


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls, their arguments as objects (JSON text in OpenAI's API)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(f"{where} must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"{where}[{j}] must have a function with a name", param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise APIError(f"{where}[{j}].function.arguments is not valid JSON", param="messages") from None
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def _spelled_out(messages: list[dict], tools: ToolSet | None) -> list[dict]:
    """The Hermes convention written into the messages, for a template without tool support."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if tools is not None:
        prompt = default_tool_prompt(tools.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
