"""What a request constrains its output to (vLLM's `StructuredOutputsParams`), validated at construction.

Exactly one kind per request: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice`
(a list of strings), `grammar` (EBNF / GBNF, as xgrammar reads it), `json_object=True` (any JSON
object) or `structural_tag` (xgrammar's structural-tag JSON; the server's tool calls use it). The
text is parsed here, so a bad schema, regex or grammar raises ValueError naming the field before
any request is queued; compiling against the vocabulary happens in the engine (`compiler.py`),
cached by `key`. Only plain data is kept: the object pickles to the engine process.
"""
import json as _json
import re
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace: the separators ", " and ": " only
    # (kind, text): what the engine compiles, and the key of its cache of compiled grammars.
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            found = f"got {' and '.join(given)}" if given else "got none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; {found}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        kind = given[0]
        text = getattr(self, f"_{kind}_text")(getattr(self, kind))
        self.key = (kind, text)
        check_syntax(kind, text, self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        return self.key[0]

    # ---- each kind's canonical text --------------------------------------------------------
    @staticmethod
    def _json_text(schema) -> str:
        return _json_document("json", schema, "a JSON schema (a dict, or its JSON text)")

    @staticmethod
    def _structural_tag_text(tag) -> str:
        return _json_document("structural_tag", tag, "a structural tag (a dict, or its JSON text)")

    @staticmethod
    def _regex_text(regex) -> str:
        if not isinstance(regex, str) or not regex:
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {regex!r}")
        return regex

    @staticmethod
    def _grammar_text(grammar) -> str:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF string, got {grammar!r}")
        return grammar

    @staticmethod
    def _json_object_text(value) -> str:
        if value is not True:
            raise ValueError(f"structured_outputs.json_object must be true or unset, got {value!r}")
        return ""

    @staticmethod
    def _choice_text(choice) -> str:
        if (not isinstance(choice, (list, tuple)) or not choice
                or not all(isinstance(c, str) and c for c in choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {choice!r}")
        return choice_grammar(choice)


def choice_grammar(choices) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in choices)


def _json_document(name: str, value: Any, allowed: str) -> str:
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"structured_outputs.{name} must be {allowed}, got {type(value).__name__}")
    try:
        return _json.dumps(value, ensure_ascii=False)  # key order kept: it is the order of the output's keys
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{name} is not JSON-serialisable: {e}") from None


_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error text without its C++ source-location prefix."""
    return _NATIVE_PREFIX.sub("", str(error).strip()).strip()


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured outputs need the xgrammar package (pip install xgrammar): {e}") from None
    return xgrammar


def check_syntax(kind: str, text: str, disable_any_whitespace: bool = False):
    """Parse the constraint without a vocabulary (cheap); ValueError naming the field if it is invalid."""
    xgr = import_xgrammar()
    field_name = "grammar" if kind == "choice" else kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=not disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(text)
    except Exception as e:  # xgrammar raises RuntimeError, InvalidJSONError, InvalidStructuralTagError...
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
                "structural_tag": "structural tag"}[field_name]
        raise ValueError(f"structured_outputs.{kind} is not a valid {what}: {xgrammar_message(e)}") from None
