"""Request bodies: strict JSON into the request models, or a 400 that names the field.

Python's json module (what FastAPI parses with) takes more than JSON allows: NaN and Infinity, and
strings that are not text, lone UTF-16 surrogates, from an escape (`"\\ud800"`) or from their
CESU-8 bytes (ED A0 80, decoded with 'surrogatepass'). pydantic hands those on, and a lone
surrogate then fails deep inside: in the tokenizer, or in an error message that echoes it. Here a
body is UTF-8, its strings are text and its numbers are numbers; the usual body costs one strict
decode, one substring test and json.loads.
"""
import json
import re

from pydantic import BaseModel, ValidationError

from nanovllm.entrypoints.openai.protocol import APIError

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # in the JSON text (pairs too)
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a decoded string: never paired there


class _NonFinite:
    """What json.loads makes of NaN, Infinity and -Infinity here, so they can be found and named."""

    def __init__(self, literal: str):
        self.literal = literal


def parse_request(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The body as `model`, or APIError(400) naming what is wrong."""
    data = parse_json(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def parse_json(body: bytes):
    non_finite = []

    def constant(literal: str):
        non_finite.append(literal)
        return _NonFinite(literal)

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        # Name the field the bad bytes are in: undecodable bytes become lone surrogates here.
        text = body.decode("utf-8", "surrogateescape")
        data = _loads(text, constant)
        path = _find(data, _not_text)
        raise APIError(f"{path}: not valid UTF-8 text" if path else "the body is not valid UTF-8",
                       param=_field(path)) from None
    data = _loads(text, constant)
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        path = _find(data, _not_text)
        if path is not None:
            raise APIError(f"{path}: the string holds a lone UTF-16 surrogate, which is not text", param=_field(path))
    if non_finite:
        path = _find(data, lambda v: isinstance(v, _NonFinite))
        raise APIError(f"{path}: {non_finite[0]} is not a JSON number (JSON has no NaN or infinities)",
                       param=_field(path))
    return data


def _loads(text: str, constant):
    try:
        return json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise APIError(f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise APIError("the body is not valid JSON: nested too deeply") from None


def _not_text(value) -> bool:
    return isinstance(value, str) and not value.isascii() and _SURROGATE.search(value) is not None


def _find(data, bad) -> str | None:
    """Where in data a value (or key) with bad(value) is, as `messages[0].content`."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            items = ((f"{path}.{key}" if path else str(key), key, item) for key, item in value.items())
        elif isinstance(value, list):
            items = ((f"{path}[{i}]", None, item) for i, item in enumerate(value))
        else:
            if bad(value):
                return path or "the body"
            continue
        nested = []
        for where, key, item in items:
            if isinstance(item, (dict, list)):
                nested.append((where, item))
            elif bad(item) or (key is not None and bad(key)):
                return where
        stack.extend(reversed(nested))
    return None


def _field(path: str | None) -> str | None:
    """The top-level field of a path (OpenAI's `param`)."""
    if not path or path == "the body":
        return None
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's (or FastAPI's) validation errors as one 400, naming the first field."""
    problems, param = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return APIError("; ".join(problems) or "invalid request", 400, param=param)
