"""Verification of a step's drafts, on the runner: the sampler picks the target's token
at every draft position, and a request keeps its drafts up to the first that differs.

A request with k drafts has k + 1 sampler rows: row j samples the token that follows
its history extended by drafts[:j], with exactly the sampling state it would have
without speculation (penalties and min_tokens see drafts[:j] as outputs; a seeded
row's generator is keyed by the output position). Drafts are point masses (n-gram
lookups and greedy drafts), for which "sample y from the target, accept the draft
when y equals it, else emit y" is Leviathan's rule exactly; so greedy and seeded
requests give the same tokens with speculation on and off.
"""
from __future__ import annotations

import dataclasses

from common.engine.outputs import Logprobs, ScheduledRequest
from common.engine.spec_decode.rejection_sampler import num_accepted_point_mass


def expand_verification_rows(sample_reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """One sampler row per position each request samples at, in order."""
    rows = []
    for req in sample_reqs:
        rows.append(req)
        for j in range(1, len(req.spec_token_ids) + 1):
            rows.append(dataclasses.replace(req, output_token_ids=req.output_token_ids + req.spec_token_ids[:j]))
    return rows


def accept_drafts(sample_reqs: list[ScheduledRequest], row_token_ids: list[int],
                  row_logprobs: list[Logprobs | None] | None
                  ) -> tuple[list[list[int]], list[list[Logprobs] | None] | None]:
    """Per request: the accepted drafts and the target's token after them (and their
    logprobs), from the rows expand_verification_rows made."""
    token_id_lists: list[list[int]] = []
    logprob_lists: list[list[Logprobs] | None] | None = None if row_logprobs is None else []
    row = 0
    for req in sample_reqs:
        num_rows = len(req.spec_token_ids) + 1
        target_token_ids = row_token_ids[row:row + num_rows]
        num_emitted = num_accepted_point_mass(target_token_ids, req.spec_token_ids) + 1
        token_id_lists.append(target_token_ids[:num_emitted])
        if logprob_lists is not None:
            logprobs = row_logprobs[row:row + num_emitted]
            logprob_lists.append(None if logprobs[0] is None else list(logprobs))
        row += num_rows
    return token_id_lists, logprob_lists
