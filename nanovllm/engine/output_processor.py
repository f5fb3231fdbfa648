"""After each step: append sampled tokens (and their logprobs) and decide which sequences are done.

Text: a sequence gets an IncrementalDetokenizer (`seq.detokenizer`) only when it needs text while
it runs: it has stop strings, or it is streamed (`watch(seq)`, or `stream_all`). Otherwise its
text is decoded once, when asked for (`text(seq)`), and the offline path pays nothing per token.

As in vLLM, the eos or stop token that ends a sequence is not part of its text unless
include_stop_str_in_output is set, and stop strings only count after min_tokens outputs.
"""
from nanovllm.engine.detokenizer import IncrementalDetokenizer, decode_completion
from nanovllm.engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, tokenizer=None, stream_all: bool = False):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.stream_all = stream_all  # detokenize every sequence as it goes (a streaming server)

    def watch(self, seq: Sequence) -> IncrementalDetokenizer | None:
        """Detokenize seq incrementally, so take_delta(seq) can stream it. Call it before seq's
        first token is appended. None without a tokenizer."""
        detok = seq.detokenizer
        if detok is None and self.tokenizer is not None:
            detok = seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                             seq.sampling_params)
        return detok

    def append(self, seq: Sequence, token_id: int, logprobs: tuple | None = None) -> str | None:
        """Append token_id to seq, then check it (see check)."""
        seq.append_token(token_id)
        return self.check(seq, token_id, logprobs)

    def append_run(self, seq: Sequence, token_ids: list[int], logprobs: list | None = None) -> str | None:
        """Append token_ids (at least one) to seq one by one as `append` would, stopping after the
        first that finishes it; returns that finish reason or None (a verification step's accepted run).
        logprobs: each token's row, or None. Without text to follow (no stop strings, not
        streamed) or logprobs to record, a stop is only a token id or a length: the run's are
        found without the per-token bookkeeping."""
        sp = seq.sampling_params
        if (seq.detokenizer is not None or sp.stop_list or self.stream_all
                or (logprobs is not None and seq.logprobs is not None)):
            for j, token in enumerate(token_ids):
                reason = self.append(seq, token, None if logprobs is None else logprobs[j])
                if reason is not None:
                    return reason
            return None
        known = len(seq.token_ids) - seq.num_pending_tokens  # before the run
        n_out = known - seq.num_prompt_tokens
        # The tokens up to the first that reaches max_tokens or max_model_len (all, if none does).
        take = max(1, min(len(token_ids), sp.max_tokens - n_out, self.max_model_len - known))
        reason = "length" if n_out + take >= sp.max_tokens or known + take >= self.max_model_len else None
        stops = sp.stop_token_ids
        eos = () if sp.ignore_eos else self.eos_token_ids
        first_checked = max(0, sp.min_tokens - n_out)  # n_out + j + 1 > min_tokens
        # Without stop ids, one set operation in C says whether the run holds an eos at all.
        if stops or (eos and not eos.isdisjoint(token_ids[first_checked:take])):
            for j in range(first_checked, take):
                token = token_ids[j]
                if token in eos:
                    reason, seq.stop_reason, take = "stop", None, j + 1
                    break
                if token in stops:
                    reason, seq.stop_reason, take = "stop", token, j + 1
                    break
        seq.token_ids.extend(token_ids[:take])
        return reason

    def check(self, seq: Sequence, token_id: int, logprobs: tuple | None = None) -> str | None:
        """token_id is seq's newest known token (already in seq.token_ids; tokens of a step still
        in flight may follow it as placeholders). Records its logprobs and text; returns a finish
        reason ("stop" or "length") or None. logprobs: this row's `LogprobsLists.row(i)` from the
        sampler, when the batch asked for any."""
        sp = seq.sampling_params
        detok = seq.detokenizer
        if detok is None and (sp.stop_list or self.stream_all):
            detok = self.watch(seq)
        if logprobs is not None and seq.logprobs is not None:
            seq.logprobs.append(logprobs_entry(logprobs, sp.logprobs))
        in_flight = seq.num_pending_tokens
        n_out = seq.num_completion_tokens - in_flight
        reason = None
        if n_out > sp.min_tokens:  # the sampler keeps eos and stop ids out before min_tokens
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                reason, seq.stop_reason = "stop", None
            elif token_id in sp.stop_token_ids:
                reason, seq.stop_reason = "stop", token_id
        if detok is not None and (reason is None or sp.include_stop_str_in_output):
            delta, stop = detok.add(token_id, check_stop=reason is None and n_out > sp.min_tokens)
            detok.unread += delta
            if stop is not None:
                reason, seq.stop_reason = "stop", stop
        if reason is None and (n_out >= sp.max_tokens or seq.num_tokens - in_flight >= self.max_model_len):
            reason = "length"
        if reason is not None and detok is not None:
            detok.unread += detok.flush()
        return reason

    def take_delta(self, seq: Sequence) -> str:
        """Text of seq not yet taken, safe to stream: never text a stop string will cut. Once seq
        is finished, the last call returns the rest of its final text."""
        detok = seq.detokenizer
        if detok is None:
            return ""
        delta, detok.unread = detok.unread, ""
        return delta

    def text(self, seq: Sequence) -> str:
        detok = seq.detokenizer
        if detok is not None:
            return detok.text
        if self.tokenizer is None:
            return ""
        sp = seq.sampling_params
        ids = seq.completion_token_ids
        in_flight = seq.num_pending_tokens
        if in_flight:
            ids = ids[:-in_flight]
        if (ids and seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
                and not sp.include_stop_str_in_output):
            ids = ids[:-1]  # the eos or stop token
        return decode_completion(self.tokenizer, seq.prompt_token_ids, ids, sp.skip_special_tokens)


def logprobs_entry(row: tuple[list[int], list[float], int], num_top: int) -> dict:
    """One generated token's logprobs, from the sampler's row: the sampled token first, then
    the batch's top k, of which this request keeps its own num_top."""
    ids, values, rank = row
    return {"token_id": ids[0], "logprob": values[0], "rank": rank,
            "top_logprobs": [{"token_id": t, "logprob": v} for t, v in zip(ids[1:1 + num_top], values[1:1 + num_top])]}
