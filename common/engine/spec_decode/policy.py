"""When a request's drafts run, and what speculation has achieved. No torch.

Verifying k drafts costs a step k extra query rows; on a CPU that is cheap for one
stream (the step is bound by reading the weights) and not for a large batch (the
step is bound by compute). So, as vLLM's `disable_by_batch_size`, no request
speculates in a step where more than that many requests run, except one whose drafts
have been holding (`large_batch_min_acceptance_rate`, 0.8: text it copies, where the
accepted tokens outweigh the extra rows even there); and a request whose
drafts keep being rejected (an EMA of its acceptance rate below
`min_acceptance_rate`) pauses for `num_backoff_steps` steps and then probes again;
each failed probe doubles the pause (up to 2^MAX_BACKOFF_DOUBLINGS times), and a probe
drafts one token, not k, so a request a proposer cannot help (random text, an untrained
early exit) costs a cheap probe every few hundred steps. A request's first verification
starts from the engine's recent acceptance rate rather than a clean slate, so when the
proposer has been failing everyone a new request pauses after one failure, not three.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.config import SpeculativeConfig
from common.engine.request import Request

# Weight of the newest verification in a request's acceptance-rate EMA.
ACCEPTANCE_EMA_WEIGHT = 0.5
ENGINE_EMA_WEIGHT = 0.1
MAX_BACKOFF_DOUBLINGS = 5


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications of a request's drafts (one per request-step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how many drafts were accepted at each draft position 0..k-1
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_steps_disabled_by_batch_size: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification emits on average: the accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "spec_num_steps_disabled_by_batch_size": self.num_steps_disabled_by_batch_size,
                "spec_acceptance_rate": self.acceptance_rate,
                "spec_mean_acceptance_length": self.mean_acceptance_length}


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        # EMA of every verification's acceptance rate: the prior of a new request's own.
        self.engine_acceptance_rate = 1.0

    def step_allows_drafts(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            self.stats.num_steps_disabled_by_batch_size += 1
            return False
        return True

    def max_num_drafts(self, request: Request) -> int:
        """The most drafts the request may verify in its next step: k, less what would
        pass max_tokens or max_model_len once all are accepted (they bring one more)."""
        if request.grammar is not None or request.num_spec_backoff_steps > 0:
            return 0
        params = request.sampling_params
        num_drafts = self.config.num_speculative_tokens
        if params.max_tokens is not None:
            num_drafts = min(num_drafts, params.max_tokens - request.num_output_tokens - 1)
        num_drafts = min(num_drafts, self.max_model_len - request.num_tokens - 1)
        return max(num_drafts, 0)

    def num_drafts_to_propose(self, request: Request, step_allows_drafts: bool) -> int:
        """Drafts to ask the proposer for after this step; counts down a backoff."""
        if request.num_spec_backoff_steps > 0:
            request.num_spec_backoff_steps -= 1
            return 0
        if not step_allows_drafts and not self.holds_in_large_batches(request):
            return 0
        num_drafts = self.max_num_drafts(request)
        return min(num_drafts, 1) if request.num_spec_backoffs else num_drafts  # a probe: one draft

    def holds_in_large_batches(self, request: Request) -> bool:
        """Whether the request drafts in a step of more than disable_by_batch_size requests:
        its acceptance rate (before its first verification, the engine's recent one) is at
        least large_batch_min_acceptance_rate."""
        min_rate = self.config.large_batch_min_acceptance_rate
        if min_rate is None:
            return False
        rate = request.spec_acceptance_rate
        return (self.engine_acceptance_rate if rate is None else rate) >= min_rate

    def record(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1
        rate = num_accepted / num_draft_tokens
        min_rate = self.config.min_acceptance_rate
        if request.spec_acceptance_rate is None:
            request.spec_acceptance_rate = self.engine_acceptance_rate
        self.engine_acceptance_rate += ENGINE_EMA_WEIGHT * (rate - self.engine_acceptance_rate)
        request.spec_acceptance_rate += ACCEPTANCE_EMA_WEIGHT * (rate - request.spec_acceptance_rate)
        if request.spec_acceptance_rate < min_rate:
            doublings = min(request.num_spec_backoffs, MAX_BACKOFF_DOUBLINGS)
            request.num_spec_backoff_steps = self.config.num_backoff_steps << doublings
            request.num_spec_backoffs += 1
            # At the threshold, the probe after the pause alone decides: one more bad
            # verification and it pauses again, for twice as long.
            request.spec_acceptance_rate = min_rate
        elif rate >= min_rate:
            request.num_spec_backoffs = 0
