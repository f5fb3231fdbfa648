"""Request fields that constrain or bias what is generated, mapped onto SamplingParams: OpenAI's
`response_format` and `logit_bias`, vLLM's `structured_outputs` and its older `guided_*` fields
(on /v1/completions too); and the fields that would change the output but that the server does not
implement, which are refused by name instead of being ignored."""
from typing import Any

from nanovllm.entrypoints.openai.protocol import APIError
from nanovllm.structured_output import StructuredOutputsParams

# vLLM's guided_* fields and the StructuredOutputsParams field each one sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace")

# field -> the values that leave the output unchanged (None: not sent).
_NOT_IMPLEMENTED: dict[str, tuple] = {
    "use_beam_search": (None, False), "length_penalty": (None, 1.0), "allowed_token_ids": (None,),
    "bad_words": (None, []), "logits_processors": (None, []), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True), "vllm_xargs": (None,), "guided_whitespace_pattern": (None,),
    "prompt_embeds": (None,), "functions": (None,), "function_call": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "verbosity": (None,),
    "web_search_options": (None,), "mm_processor_kwargs": (None, {}),
}
_INSTEAD = {"functions": "use tools", "function_call": "use tool_choice"}


def check_not_implemented(req) -> None:
    for name, neutral in _NOT_IMPLEMENTED.items():
        value = getattr(req, name, None)
        if not any(value == v and type(value) is type(v) or value is v for v in neutral):
            if isinstance(value, int) and not isinstance(value, bool) and float(value) in neutral:
                continue  # length_penalty=1
            instead = f" ({_INSTEAD[name]})" if name in _INSTEAD else ""
            raise APIError(f"{name} is not supported by this server{instead}", param=name)
    backend = getattr(req, "guided_decoding_backend", None)
    if backend not in (None, "auto", "xgrammar"):
        raise APIError(f"guided_decoding_backend must be 'xgrammar' (or unset), got {backend!r}",
                       param="guided_decoding_backend")


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's token-id strings -> ints; SamplingParams checks the values."""
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        out[token] = value
    return out


def structured_outputs(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from, or (None, None). At most one field may
    constrain the output; a bad schema, regex or grammar is a 400 naming that field."""
    found: list[tuple[str, dict[str, Any]]] = []  # (field, StructuredOutputsParams kwargs)
    if req.response_format is not None:
        kwargs = _response_format(req.response_format)
        if kwargs is not None:
            found.append(("response_format", kwargs))
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(_STRUCTURED_FIELDS))
        if unknown:
            raise APIError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; allowed: "
                           f"{', '.join(_STRUCTURED_FIELDS)}", param="structured_outputs")
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(f"only one field may constrain the output, got {found[0][0]} and {found[1][0]}",
                       param=found[1][0])
    name, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), name
    except (ValueError, TypeError) as e:
        message = str(e)
        if name != "structured_outputs":  # name the field the client sent
            shown = "response_format.json_schema.schema" if name == "response_format" else name
            for kind in _STRUCTURED_FIELDS:
                message = message.replace(f"structured_outputs.{kind}", shown)
        raise APIError(message, param=name) from None


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object with 'name' and 'schema'",
                           param="response_format")
        schema = spec.get("schema")
        if schema is None:  # a schema is optional in OpenAI's API: any JSON object then
            return {"json_object": True}
        return {"json": schema}
    raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")
