"""After each step: append sampled tokens and decide which sequences are done."""
from nanovllm.engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, tokenizer=None):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def append(self, seq: Sequence, token_id: int) -> str | None:
        """Append token_id to seq; return a finish reason ("stop" or "length") or None."""
        seq.append_token(token_id)
        sp = seq.sampling_params
        n_out = seq.num_completion_tokens
        if n_out > sp.min_tokens:  # the sampler keeps eos and stop ids out before min_tokens
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                seq.stop_reason = None
                return "stop"
            if token_id in sp.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
        if n_out >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.completion_token_ids,
                                     skip_special_tokens=seq.sampling_params.skip_special_tokens)
