"""The engine's side of speculative decoding: one object, `Speculator`, that the loop calls the same
way whether or not speculation is configured (each call returns at once when it is not).

Per step: `wants_drafts` says whether this step should verify drafts (batch small enough, some
sequence able to take drafts; with a step in flight, the proposer's forecast), then the engine
takes in the step in flight, `propose` gives each eligible sequence its drafts, the scheduler
schedules them as more tokens, and after the step `verify` turns each sequence's drawn rows into
the tokens it gains.

Exactness: the verification draws every position exactly as plain decoding would
----------------------------------------------------------------------------------
The sampler's draw at output position t is a function D(p_t, E_t) of the processed distribution
p_t (bans, logit_bias, penalties, temperature, top-k/p, min-p, the grammar's mask: the whole
pipeline) and of noise E_t that depends only on (seed, t, token id): argmax_v p_t(v) / E_t(v),
E_t(v) ~ Exp(1) (layers/sampler.py). A sequence with tokens x_<t and drafts d_1..d_k gets k + 1
rows: row j draws z_j = D(p(. | x_<t, d_1..d_j), E_{t+j}). It gains d_1..d_a and z_a, where a is
the number of leading rows with z_j == d_{j+1}.

Claim: those are the tokens y_t..y_{t+a} plain decoding produces, for every noise draw. By
induction on j <= a: the prefix of row j is x_<t, d_1..d_j = x_<t, y_t..y_{t+j-1} (d_i = z_{i-1} =
y_{t+i-1} for i <= j), the prefix plain decoding has at t + j, so z_j = y_{t+j}. Hence accepted
drafts are plain decoding's tokens and z_a is its next one. Nothing in the argument depends on how
the drafts were made, so:

- seeds are reproducible: a seeded request gives the same tokens with and without speculation,
  whatever the batch (up to float rounding between a one-token and a several-token forward pass:
  genuine near-ties only), and the per-step batch-size switch cannot change a request's tokens;
- n-gram drafts (deterministic) follow exactly the standard rule for a deterministic proposal: d
  is accepted with probability P(argmax p/E = d) = p(d), and on rejection z ~ p restricted to the
  other tokens, renormalised: the residual distribution (p - q)+ / (1 - p(d)) with q = the point
  mass on d;
- a draft model draws its drafts with the same noise E_{t+j} from its own distribution q
  (draft_model.py): the Gumbel-max coupling of q and p (Daliri, Musco, Suresh 2024, "Coupling
  without communication and drafter-invariant speculative decoding"). The output is the target's
  exactly (it is plain decoding's, pathwise); the draft is accepted with probability
  P(argmax q/E = argmax p/E) >= (1 - TV(p, q)) / (1 + TV(p, q)), against 1 - TV for classic
  rejection sampling, the same at temperature 0. tests/spec_decode measures both.
"""
from dataclasses import dataclass, field

from nanovllm.engine.sequence import Sequence


@dataclass
class SpecDecodeStats:
    """Counters since the engine started, vLLM's meanings: drafts verified (one per sequence and
    step), draft tokens proposed, of them accepted, and accepted by position in the draft (kept as
    drafts_by_accepted[a]: the drafts of which exactly a were accepted, one count per draft
    instead of one per accepted position)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafts_by_accepted: list[int] = field(default_factory=list)

    @property
    def accepted_per_position(self) -> list[int]:
        """[p]: the drafts whose token at position p was accepted (those with more than p accepted)."""
        per_position, accepted_beyond = [], 0
        for count in reversed(self.drafts_by_accepted[1:]):
            accepted_beyond += count
            per_position.append(accepted_beyond)
        return per_position[::-1]

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": self.accepted_per_position}


class Speculator:
    def __init__(self, spec_config=None, proposer=None, max_model_len: int = 0):
        """spec_config: a validated SpeculativeConfig, or None (speculation off)."""
        self.config = spec_config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.k = spec_config.num_speculative_tokens if spec_config is not None else 0
        self.max_batch = spec_config.disable_by_batch_size if spec_config is not None else 0
        self.stats = SpecDecodeStats(drafts_by_accepted=[0] * (self.k + 1))

    @property
    def enabled(self) -> bool:
        return self.config is not None

    # ---- per step ------------------------------------------------------------------------------
    def _cap(self, seq: Sequence, in_flight_ok: bool = False) -> int:
        """How many drafts seq can take now: k, fewer near its max_tokens or max_model_len (a step
        gains at most drafts + 1 tokens), 0 while it prefills, is under a grammar (not speculated)
        or (unless in_flight_ok: the number once the step in flight is in) has a token in flight."""
        num_tokens = len(seq.token_ids)  # once: the properties were a third of this check's cost
        if seq.grammar is not None or seq.num_computed_tokens != num_tokens - 1:
            return 0
        if seq.num_pending_tokens and not in_flight_ok:
            return 0
        left = min(seq.sampling_params.max_tokens - (num_tokens - seq.num_prompt_tokens), self.max_model_len - num_tokens)
        return max(0, min(self.k, left - 1))

    def wants_drafts(self, running: list[Sequence], in_flight: bool) -> bool:
        """Whether this step should verify drafts (the engine then takes in the step in flight
        first: the drafts continue the tokens it computes)."""
        if self.config is None or not running or len(running) > self.max_batch:
            return False
        if not in_flight:
            return any(self._cap(seq) for seq in running)
        likely = self.proposer.likely
        return any(self._cap(seq, in_flight_ok=True) and likely(seq) for seq in running)

    def propose(self, running: list[Sequence], block_manager) -> dict[Sequence, list[int]] | None:
        """Drafts for the running sequences that can take some (see _cap), or None."""
        seqs, caps = [], []
        for seq in running:
            cap = self._cap(seq)
            if cap:
                seqs.append(seq)
                caps.append(cap)
        if not seqs:
            return None
        drafts = {seq: draft for seq, draft in zip(seqs, self.proposer.propose(seqs, caps, block_manager)) if draft}
        return drafts or None

    def verify(self, rows: list[int], draft: list[int]) -> list[int]:
        """The tokens a sequence gains from its verification rows (rows[j] drawn after draft[:j]):
        the drafts up to the first that differs from its row's draw, then that row's draw."""
        proposed = len(draft)
        if rows[:proposed] == draft:  # all accepted: one list compare in C, not a loop per token
            accepted = proposed
        else:
            accepted = 0
            for drawn, token in zip(rows, draft):
                if drawn != token:
                    break
                accepted += 1
        if proposed:
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += proposed
            stats.num_accepted_tokens += accepted
            stats.drafts_by_accepted[accepted] += 1
        return rows[:accepted + 1]

    # ---- lifecycle -----------------------------------------------------------------------------
    def release(self, seq: Sequence):
        if self.proposer is not None:
            self.proposer.release(seq)

    def shutdown(self):
        if self.proposer is not None:
            self.proposer.shutdown()
            self.proposer = None


def build_speculator(config, target_runner) -> Speculator:
    """The Speculator that config.speculative_config asks for (off when None)."""
    spec = config.speculative_config
    if spec is None:
        return Speculator()
    if spec.method == "ngram":
        from nanovllm.spec_decode.ngram import NgramProposer
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from nanovllm.spec_decode.draft_model import DraftModelProposer
        proposer = DraftModelProposer(config, target_runner)
    return Speculator(spec, proposer, config.max_model_len)
