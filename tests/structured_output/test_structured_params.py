"""StructuredOutputsParams and the SamplingParams fields of this feature: every bad input is a
ValueError naming the field, raised at construction (before any request is queued)."""
import pickle

import pytest

from nanovllm import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs, expected_key", [
    (dict(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}),
     ("json", '{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}')),
    (dict(json='{"type": "integer"}'), ("json", '{"type": "integer"}')),
    (dict(regex=r"\d+"), ("regex", r"\d+")),
    (dict(choice=["yes", 'say "no"']), ("choice", 'root ::= "yes" | "say \\"no\\""')),
    (dict(grammar='root ::= "a" | "b"'), ("grammar", 'root ::= "a" | "b"')),
    (dict(json_object=True), ("json_object", "")),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}),
     ("structural_tag", '{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}')),
])
def test_each_kind_has_its_key_and_pickles(kwargs, expected_key):
    params = StructuredOutputsParams(**kwargs)
    assert params.key == expected_key  # key order of a schema is kept: it is the output's key order
    assert pickle.loads(pickle.dumps(params)).key == expected_key  # it travels to the engine process


@pytest.mark.parametrize("kwargs, words", [
    (dict(), "exactly one of"),
    (dict(json={"type": "object"}, regex="a"), "got json and regex"),
    (dict(json_object=False), "exactly one of"),
    (dict(json={"type": "objekt"}), "structured_outputs.json is not a valid JSON schema"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1, 2]), "structured_outputs.json must be a JSON schema"),
    (dict(json={"type": "object", "x": {1, 2}}), "not JSON-serialisable"),
    (dict(regex="(ab"), "structured_outputs.regex is not a valid regular expression"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar is not a valid EBNF grammar"),
    (dict(grammar="   "), "structured_outputs.grammar must be a non-empty"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice=["a", ""]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice="ab"), "structured_outputs.choice must be a non-empty list"),
    (dict(json_object="yes"), "structured_outputs.json_object must be true"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}),
     "structured_outputs.structural_tag is not a valid structural tag"),
    (dict(json={"type": "object"}, disable_any_whitespace=1), "disable_any_whitespace must be a bool"),
])
def test_bad_constraints_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        StructuredOutputsParams(**kwargs)
    assert words in str(e.value)
    assert "/project/cpp" not in str(e.value)  # xgrammar's source location is not the user's business


@pytest.mark.parametrize("bias, words", [
    ({"1": 5.0}, "logit_bias keys must be non-negative token ids"),
    ({-1: 5.0}, "logit_bias keys must be non-negative token ids"),
    ({True: 5.0}, "logit_bias keys must be non-negative token ids"),
    ({1: 101}, "logit_bias values must be numbers in [-100, 100]"),
    ({1: float("nan")}, "logit_bias values must be numbers in [-100, 100]"),
    ({1: "5"}, "logit_bias values must be numbers in [-100, 100]"),
    ([1, 2], "logit_bias must be a dict"),
])
def test_bad_logit_bias(bias, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=bias)
    assert words in str(e.value)


def test_sampling_params_fields():
    sp = SamplingParams(logit_bias={3: 1, 5: -100.0}, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert sp.logit_bias == {3: 1.0, 5: -100.0}
    assert not sp.plain  # logit_bias goes through the eager sampler
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")).plain  # masks: still the graphs' draw
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
