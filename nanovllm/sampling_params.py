"""Per-request sampling parameters, with vLLM's names, meanings and ranges."""
import math
from dataclasses import dataclass, field

from nanovllm.structured_output.params import StructuredOutputsParams

_INT32_MAX = 2**31 - 1
GREEDY_BELOW = 1e-5  # temperatures below this draw greedily (the argmax)
# Upper bounds vLLM does not set (it checks finiteness only). Past a temperature of 100 the logit
# gaps of any real model shrink below one nat: the draw is near-uniform noise, so a larger value is
# a mistake more likely than a wish. A repetition penalty divides or multiplies logits: outside
# [0.01, 100] it overflows fp32 logits for no purpose.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    # OpenAI's: token id -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        _number("temperature", self.temperature, lo=0.0, hi=MAX_TEMPERATURE,
                allowed=f"a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        _integer("max_tokens", self.max_tokens, lo=1, allowed="an integer >= 1")
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, allowed="a number in (0, 1]")
        _integer("top_k", self.top_k, lo=-1, allowed="-1 or 0 (disabled) or a positive integer")
        _number("min_p", self.min_p, lo=0.0, hi=1.0, allowed="a number in [0, 1]")
        _number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0, allowed="a number in [-2, 2]")
        _number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0, allowed="a number in [-2, 2]")
        lo, hi = REPETITION_PENALTY_RANGE
        _number("repetition_penalty", self.repetition_penalty, lo=lo, hi=hi,
                allowed=f"a number in [{lo:g}, {hi:g}] (1 means no penalty)")
        _integer("min_tokens", self.min_tokens, lo=0, allowed="an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _integer("n", self.n, lo=1, allowed="an integer >= 1")
        if self.seed is not None:
            _integer("seed", self.seed, lo=-(2**63), hi=2**63 - 1, allowed="an integer in [-2**63, 2**63-1] or None")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS,
                     allowed=f"an integer in [0, {MAX_LOGPROBS}] or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop_list = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop_list):
            raise ValueError("stop must not contain empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not (isinstance(self.stop_token_ids, (list, tuple))
                  and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT32_MAX
                          for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative token ids, got {self.stop_token_ids!r}")
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _INT32_MAX:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
                if not (_is_number(bias) and -100 <= bias <= 100):
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_filters(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """Temperature (or greedy) alone, maybe under a grammar's mask: the sampler's default draw,
        which CUDA graphs capture."""
        return not (self.uses_filters or self.uses_penalties or self.logprobs is not None or self.min_tokens > 0
                    or self.logit_bias is not None)


def _is_number(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)  # no NaN, no infinities (ints may exceed a float)


def _number(name, value, lo=None, hi=None, lo_open=False, allowed=""):
    ok = _is_number(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _integer(name, value, lo=None, hi=None, allowed=""):
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and lo is not None:
        ok = value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
