"""Turns one step's logits into token ids (and logprobs), like vLLM's V1 sampler.

Order per row: allowed_token_ids -> logit_bias -> bad words -> penalties -> min_tokens mask ->
logprobs -> temperature -> top_k -> top_p -> min_p -> draw (vLLM's order up to the
logprobs). Logprobs are taken from the log_softmax of the biased, penalised,
min_tokens-masked logits BEFORE temperature and truncation (vLLM's default
"raw_logprobs" also ignores temperature; unlike it, ours include what changed the logits).

The draw inverts each row's softmax CDF at one uniform number (exact, like
torch.multinomial; kernels.cpu_sampling.draw_rows).
Unseeded rows share one generator seeded from the engine seed. A seeded row draws
only from its own generator, re-seeded each step from (seed, index of the token
being sampled), so its tokens depend neither on the rest of the batch nor on which
instance samples which position (prefill samples token 0 on P and decode the rest on
D; a request prefilled locally on D gets the same tokens).

A structured-output bitmask, when given, comes first: the tokens a constrained row's
grammar forbids are -inf before anything else, so greedy and random draws both obey it.

Greedy rows (temperature < 1e-5 or top_k == 1) take the argmax of the penalised,
masked logits. A batch of greedy rows without penalties, logprobs or pending
min_tokens is a single argmax.

Rows with no grammar, logit_bias, allowed_token_ids or bad words can be sampled inside the CPU's native
decode loop (token_sampling):
the sampler draws their uniform numbers as it would step after step, and the loop
penalizes and holds back stop tokens (token_history), truncates and draws with
the same arithmetic and native passes, so the tokens are the ones this sampler gives; the
loop reports their logprobs too (token_logprobs, loop_logprobs), from the same logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import torch

from common.engine.outputs import Logprobs, ScheduledRequest
from common.engine.structured_output.bitmask import apply_token_bitmask
from kernels.cpu_decode import TokenLogprobs, TokenHistory, TokenSampling
from kernels.cpu_sampling import argmax_rows, draw_rows, logprobs_rows, native_argmax_available, native_rows

_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # one per logits row
    logprobs: list[Logprobs | None] | None  # per row; None when no row asked for logprobs


def _step_seed(seed: int, position: int) -> int:
    # splitmix64 of (seed, position): well-mixed in all 64 bits, because torch's CPU
    # generator (mt19937) only uses the low 32 bits of its seed.
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0):
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._request_generators: dict[str, torch.Generator] = {}
        # Unique prompt token ids per request, for repetition penalties; a prompt never
        # changes, so it is turned into a tensor once rather than every step.
        self._prompt_id_tensors: dict[str, torch.Tensor] = {}
        # A request's logit_bias as (token ids, biases) and allowed_token_ids, turned into
        # tensors once for the same reason. [num_biased], [num_biased]; [num_allowed]
        self._logit_bias_tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._allowed_id_tensors: dict[str, torch.Tensor] = {}
        # Whether the native loop samples every row it can (rows_in_loop; False: only those
        # that take their argmax and nothing more, the others sampled here from the logits its
        # head leaves; benchmarks compare the two).
        self.samples_in_loop = True

    def prepare(self, device: torch.device) -> None:
        """Load what greedy steps on this device take before the first request: on the CPU the
        native argmax, whose library is otherwise built (a compiler run of seconds after an
        install or a change of the kernels' sources) inside the first request's step."""
        if device.type == "cpu":
            native_argmax_available()

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        """Drop per-request state of finished/aborted requests."""
        for req_id in req_ids:
            self._request_generators.pop(req_id, None)
            self._prompt_id_tensors.pop(req_id, None)
            self._logit_bias_tensors.pop(req_id, None)
            self._allowed_id_tensors.pop(req_id, None)

    @staticmethod
    def only_argmax(requests: Sequence[ScheduledRequest]) -> bool:
        """Whether these rows, unmasked, sample as each row's argmax and nothing more (greedy, no
        logprobs, penalties or stop tokens held back): then any logits with the same argmax
        serve, such as the head's bf16 output before its fp32 copy."""
        return all(request.sampling_params.samples_argmax(len(request.output_token_ids)) for request in requests)

    def rows_in_loop(self, requests: Sequence[ScheduledRequest]) -> list[bool]:
        """Per row, whether the native loop's token head can take its next token
        (token_sampling), with its history (token_history) and logprobs (token_logprobs):
        it takes its argmax and nothing more (samples_argmax), or, while samples_in_loop is on,
        it is greedy, or drawn while the native sampling ops are on (not PDSERVE_CPU_ARGMAX=0),
        its penalties and stop tokens held back by min_tokens too (token_history). The others
        (a logit_bias, allowed_token_ids or bad words among them) this sampler samples, from the logits
        the loop's head leaves."""
        draws = native_argmax_available()
        in_loop = []
        for request in requests:
            params, num_output_tokens = request.sampling_params, len(request.output_token_ids)
            in_loop.append(params.samples_argmax(num_output_tokens)
                           or (self.samples_in_loop and not params.adjusts_logits and (params.is_greedy or draws)))
        return in_loop

    def token_sampling(self, requests: Sequence[ScheduledRequest], num_steps: int,
                       in_loop: Sequence[bool] | None = None) -> TokenSampling | None:
        """How the native loop takes the next num_steps tokens of the rows in_loop marks (None:
        every row; rows_in_loop says which it may): None where each of them takes its argmax;
        else each row's temperature (0: its argmax; a row left to this sampler too),
        truncations, and the uniform numbers this sampler would draw for it step after step
        from the same generators, so the loop's draws are this sampler's tokens."""
        params = [r.sampling_params for r in requests]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy and (in_loop is None or in_loop[i])]
        if not random_rows:
            return None
        random_requests = [requests[i] for i in random_rows]
        uniforms = torch.zeros(num_steps, len(requests), dtype=torch.float64)  # [num_steps, num_rows]
        for step in range(num_steps):
            uniforms[step, random_rows] = self._uniforms(random_requests, torch.device("cpu"), step)
        drawn = set(random_rows)
        temperatures = [p.temperature if i in drawn else 0.0 for i, p in enumerate(params)]
        return TokenSampling(
            torch.tensor(temperatures, dtype=torch.float32), uniforms,
            top_k=torch.tensor([p.top_k for p in params]) if any(p.top_k > 0 for p in params) else None,
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32) if any(p.top_p < 1.0 for p in params)
            else None,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32) if any(p.min_p > 0.0 for p in params)
            else None)

    def token_history(self, requests: Sequence[ScheduledRequest], vocab_size: int,
                      in_loop: Sequence[bool] | None = None) -> TokenHistory | None:
        """What the tokens so far of the rows in_loop marks (None: every row) do to their
        logits, for the native loop: penalties, with the tokens they count (the prompt's
        distinct tokens for a repetition penalty, the output's), and the stop tokens a row
        holds back (min_tokens) for as many steps as it has tokens to go; None where no row
        has any."""
        rows = [i for i, r in enumerate(requests)
                if (in_loop is None or in_loop[i]) and (r.sampling_params.has_penalties
                                                        or r.sampling_params.holds_back_stop_tokens(
                                                            len(r.output_token_ids)))]
        if not rows:
            return None
        penalties = [[1.0, 0.0, 0.0] for _ in requests]  # [num_rows, 3]
        offsets = [[0, 0, 0, 0] for _ in requests]  # [num_rows, 4]
        held_back_steps = [0] * len(requests)  # [num_rows]
        no_ids = torch.empty(0, dtype=torch.int64)
        parts: list[torch.Tensor] = []
        num_ids = 0
        for i in rows:
            request, params = requests[i], requests[i].sampling_params
            penalties[i] = [params.repetition_penalty, params.frequency_penalty, params.presence_penalty]
            prompt_ids = (self._prompt_ids(request, torch.device("cpu")) if params.repetition_penalty != 1.0
                          else no_ids)
            output_ids = torch.tensor(request.output_token_ids, dtype=torch.int64) if params.has_penalties else no_ids
            held_back_steps[i] = max(0, params.min_tokens - len(request.output_token_ids))
            held_back_ids = (torch.tensor(self._stop_ids(params, vocab_size), dtype=torch.int64)
                             if held_back_steps[i] > 0 else no_ids)
            prompt_end = num_ids + len(prompt_ids)
            output_end = prompt_end + len(output_ids)
            offsets[i] = [num_ids, prompt_end, output_end, output_end + len(held_back_ids)]
            num_ids = offsets[i][3]
            parts += [prompt_ids, output_ids, held_back_ids]
        return TokenHistory(torch.tensor(penalties, dtype=torch.float32), torch.cat(parts),
                            torch.tensor(offsets, dtype=torch.int64), torch.tensor(held_back_steps, dtype=torch.int64))

    @staticmethod
    def token_logprobs(requests: Sequence[ScheduledRequest], num_steps: int,
                       in_loop: Sequence[bool] | None = None) -> TokenLogprobs | None:
        """Room for the logprobs the native loop reports over num_steps steps for the rows
        in_loop marks (None: every row) that ask for them; None where none does."""
        num_logprobs = [-1 if p is None or (in_loop is not None and not in_loop[i]) else p
                        for i, p in enumerate(r.sampling_params.logprobs for r in requests)]
        if max(num_logprobs) < 0:
            return None
        return TokenLogprobs.empty(num_logprobs, num_steps)

    @staticmethod
    def loop_logprobs(token_logprobs: TokenLogprobs, num_steps: int) -> list[list[Logprobs] | None]:
        """Per row, the Logprobs of its first num_steps tokens as the loop wrote them into
        token_logprobs (None for a row that reports none)."""
        counts = token_logprobs.num_logprobs.tolist()
        values = token_logprobs.logprobs[:num_steps].transpose(0, 1).tolist()  # [num_rows, num_steps, 1 + top]
        token_ids = token_logprobs.token_ids[:num_steps].transpose(0, 1).tolist()  # [num_rows, num_steps, top]
        return [None if n < 0 else [Logprobs(step[0], ids[:n], step[1:1 + n]) for step, ids in zip(rows, id_rows)]
                for n, rows, id_rows in zip(counts, values, token_ids)]

    def __call__(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest],
                 token_bitmask: torch.Tensor | None = None,
                 bitmask_rows: Sequence[int] = ()) -> SamplerOutput:
        """token_bitmask: [len(bitmask_rows), ceil(vocab_size / 32)] int32, its row i
        masking logits row bitmask_rows[i] (structured outputs)."""
        num_seqs, vocab_size = logits.shape  # logits: [num_seqs, vocab_size]
        assert num_seqs == len(requests), (num_seqs, len(requests))
        params = [r.sampling_params for r in requests]
        copied = token_bitmask is not None
        if copied:
            logits = logits.to(torch.float32, copy=True)  # mutated; the caller's is left alone
            apply_token_bitmask(logits, token_bitmask, list(bitmask_rows))
        if self.only_argmax(requests):
            return SamplerOutput(argmax_rows(logits).tolist(), None)  # fast path

        if not copied:
            logits = logits.to(torch.float32, copy=True)  # mutated below; the caller's is left alone
        self._apply_allowed_token_ids_and_logit_bias(logits, requests)
        _mask_bad_words(logits, requests)
        penalty_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if penalty_rows:
            self._apply_penalties(logits, penalty_rows, requests)
        self._mask_stop_tokens_below_min_tokens(logits, requests, set(bitmask_rows))

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # [num_logprob_rows, vocab_size]: a copy, kept from the draws' temperature and truncations
        logprob_logits = logits[logprob_rows] if logprob_rows else None

        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(random_rows) == num_seqs:
            sampled = self._sample_random(logits, requests)  # [num_seqs]
        else:
            sampled = argmax_rows(logits)  # [num_seqs]
            if random_rows:
                sampled[random_rows] = self._sample_random(
                    logits[random_rows], [requests[i] for i in random_rows])
        sampled_token_ids = sampled.tolist()
        logprobs = (self._gather_logprobs(logprob_logits, logprob_rows, sampled, params, num_seqs)
                    if logprob_rows else None)
        return SamplerOutput(sampled_token_ids, logprobs)

    def _apply_allowed_token_ids_and_logit_bias(self, logits: torch.Tensor,
                                                requests: Sequence[ScheduledRequest]) -> None:
        """Every token but a row's allowed_token_ids to -inf, then its logit_bias added.
        logits: [num_seqs, vocab_size] float32, mutated."""
        for i, request in enumerate(requests):
            params = request.sampling_params
            if params.allowed_token_ids is not None:
                allowed_ids = self._allowed_id_tensors.get(request.req_id)
                if allowed_ids is None:
                    allowed_ids = torch.tensor(params.allowed_token_ids, dtype=torch.long)
                    self._allowed_id_tensors[request.req_id] = allowed_ids
                allowed_ids = allowed_ids.to(logits.device)
                kept = logits[i, allowed_ids]  # [num_allowed], a copy
                logits[i].fill_(float("-inf"))
                logits[i, allowed_ids] = kept
            if params.logit_bias is not None:
                biased = self._logit_bias_tensors.get(request.req_id)
                if biased is None:
                    biased = (torch.tensor(list(params.logit_bias), dtype=torch.long),
                              torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))
                    self._logit_bias_tensors[request.req_id] = biased
                token_ids, biases = (t.to(logits.device) for t in biased)
                logits[i, token_ids] += biases  # the ids are distinct (a dict's keys)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[int],
                         requests: Sequence[ScheduledRequest]) -> None:
        """vLLM semantics: repetition over prompt+output tokens (divide positive logits,
        multiply negative ones), then frequency (per occurrence) and presence (once)
        over output tokens. Only the touched entries are read and written: O(tokens),
        not O(rows * vocab). logits: [num_seqs, vocab_size], mutated."""
        num_seqs, vocab_size = logits.shape
        device = logits.device
        repetition, frequency, presence = [1.0] * num_seqs, [0.0] * num_seqs, [0.0] * num_seqs
        for i in rows:
            p = requests[i].sampling_params
            repetition[i], frequency[i], presence[i] = (
                p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        output_lists = [requests[i].output_token_ids for i in rows]
        # One entry per output token: its logits row and token id. [num_output_tokens]
        output_rows = torch.repeat_interleave(
            torch.tensor(rows, device=device),
            torch.tensor([len(ids) for ids in output_lists], device=device))
        output_ids = torch.tensor(list(chain.from_iterable(output_lists)), dtype=torch.long,
                                  device=device)
        # Distinct (row, token) pairs as row * vocab_size + token. [num_distinct]
        output_keys = torch.unique(output_rows * vocab_size + output_ids)

        repetition_rows = [i for i in rows if repetition[i] != 1.0]
        if repetition_rows:
            seen_keys = torch.unique(torch.cat(
                [output_keys] + [i * vocab_size + self._prompt_ids(requests[i], device)
                                 for i in repetition_rows]))
            seen_rows, seen_ids = seen_keys // vocab_size, seen_keys % vocab_size
            factor = torch.tensor(repetition, device=device)[seen_rows]  # [num_seen]
            values = logits[seen_rows, seen_ids]  # [num_seen]
            logits[seen_rows, seen_ids] = torch.where(values > 0, values / factor, values * factor)
        if any(frequency[i] != 0.0 for i in rows):
            logits.index_put_((output_rows, output_ids),
                              -torch.tensor(frequency, device=device)[output_rows], accumulate=True)
        if any(presence[i] != 0.0 for i in rows):
            distinct_rows, distinct_ids = output_keys // vocab_size, output_keys % vocab_size
            presence_t = torch.tensor(presence, device=device)  # [num_seqs]
            logits[distinct_rows, distinct_ids] -= presence_t[distinct_rows]

    def _prompt_ids(self, request: ScheduledRequest, device: torch.device) -> torch.Tensor:
        ids = self._prompt_id_tensors.get(request.req_id)
        if ids is None or ids.device != device:
            ids = torch.tensor(sorted(set(request.prompt_token_ids)), dtype=torch.long,
                               device=device)
            self._prompt_id_tensors[request.req_id] = ids
        return ids

    def _stop_ids(self, params, vocab_size: int) -> list[int]:
        """The tokens min_tokens holds back: the request's stop tokens and, unless ignore_eos,
        EOS (vLLM's), those within the vocabulary."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return sorted(t for t in stop_ids if t < vocab_size)

    def _mask_stop_tokens_below_min_tokens(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest],
                                           constrained_rows: set[int]) -> None:
        vocab_size = logits.shape[1]
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            # A constrained row's grammar decides where it ends: once complete it allows
            # only EOS, and masking that too would leave nothing to sample.
            if len(r.output_token_ids) >= p.min_tokens or i in constrained_rows:
                continue
            stop_ids = self._stop_ids(p, vocab_size)
            if p.allowed_token_ids is not None:
                stop_set = set(stop_ids)
                if all(t in stop_set for t in p.allowed_token_ids):  # stops at the first other id
                    continue  # the same for an allowed set of stop tokens alone
            mask_rows += [i] * len(stop_ids)
            mask_ids += stop_ids
        if mask_rows:
            logits[mask_rows, mask_ids] = float("-inf")

    def _sample_random(self, logits: torch.Tensor,
                       requests: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Sample one token per row; logits: [num_rows, vocab_size], mutated. -> [num_rows]"""
        device = logits.device
        params = [r.sampling_params for r in requests]
        logits.div_(torch.tensor([p.temperature for p in params], device=device).unsqueeze(1))
        _apply_top_k(logits, [p.top_k for p in params])
        _apply_top_p(logits, [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            _apply_min_p(logits, [p.min_p for p in params])
        return self._draw(logits, requests)

    def _draw(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Inverse-CDF draw, one uniform per row (what torch.multinomial does for one
        sample, but with per-row generators): ~15x cheaper on CPU than drawing
        vocab-sized noise for an exponential race. logits: [num_rows, vocab_size]."""
        return draw_rows(logits, self._uniforms(requests, logits.device))

    def _uniforms(self, requests: Sequence[ScheduledRequest], device: torch.device, offset: int = 0) -> torch.Tensor:
        """One uniform number in [0, 1) per row [num_rows] float64, for the token `offset` past
        each row's next one: the unseeded rows' from the shared generator in row order, a
        seeded row's from its own generator, seeded at that token's index."""
        uniforms = torch.empty(len(requests), dtype=torch.float64, device=device)  # [num_rows]
        seeded_rows = [j for j, r in enumerate(requests) if r.sampling_params.seed is not None]
        if len(seeded_rows) < len(requests):
            uniforms.uniform_(generator=self._shared_generator(device))
        for j in seeded_rows:  # a seeded row consumes its own generator only
            uniforms[j].uniform_(generator=self._request_generator(requests[j], device, offset))
        return uniforms

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._shared_generators[device] = generator
        return generator

    def _request_generator(self, request: ScheduledRequest, device: torch.device, offset: int = 0) -> torch.Generator:
        generator = self._request_generators.get(request.req_id)
        if generator is None or generator.device != device:
            generator = torch.Generator(device=device)
            self._request_generators[request.req_id] = generator
        generator.manual_seed(_step_seed(request.sampling_params.seed, len(request.output_token_ids) + offset))
        return generator

    @staticmethod
    def _gather_logprobs(row_logits: torch.Tensor, rows: list[int], sampled: torch.Tensor,
                         params: list, num_seqs: int) -> list[Logprobs | None]:
        # row_logits: [num_rows, vocab_size] for the rows listed in `rows`
        max_top_n = max(params[i].logprobs for i in rows)
        values, top_ids = (t.tolist() for t in logprobs_rows(row_logits, sampled[rows], max_top_n))
        out: list[Logprobs | None] = [None] * num_seqs
        for row, i in enumerate(rows):
            n = params[i].logprobs
            out[i] = Logprobs(values[row][0], top_ids[row][:n], values[row][1:1 + n])
        return out


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    # All rows: the tensor itself (no copy, no write-back needed).
    return logits if len(rows) == logits.shape[0] else logits[rows]


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> None:
    """Drop tokens less likely than min_p times the most likely one: p < min_p * p_max is
    logit < max logit + log(min_p), the same tokens without a softmax.
    logits: [num_rows, vocab_size] (already top_k / top_p-masked), mutated."""
    if native_rows(logits):
        torch.ops.pdserve_sampling.min_p_mask_rows_(logits, torch.tensor(min_p, dtype=torch.float32))
        return
    log_min_p = torch.tensor(min_p, device=logits.device).log().unsqueeze(1)  # [num_rows, 1]
    logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + log_min_p, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """Keep each row's top_k largest logits (-1: all); ties with the k-th are kept (vLLM).
    logits: [num_rows, vocab_size], mutated."""
    vocab_size = logits.shape[1]
    rows = [i for i, k in enumerate(top_k) if 0 < k < vocab_size]
    if not rows:
        return
    if native_rows(logits):
        torch.ops.pdserve_sampling.top_k_mask_rows_(logits, torch.tensor(top_k, dtype=torch.long))
        return
    selected = _rows_of(logits, rows)  # [num_selected, vocab_size]
    ks = torch.tensor([top_k[i] for i in rows], device=logits.device)  # [num_selected]
    # A topk of the largest k is much cheaper than sorting the vocab.
    top_values = selected.topk(int(ks.max()), dim=-1).values  # [num_selected, max_k]
    kth_values = top_values.gather(1, (ks - 1).unsqueeze(1))  # [num_selected, 1]
    selected.masked_fill_(selected < kth_values, float("-inf"))
    if selected is not logits:
        logits[rows] = selected


# top_p first looks at this many most likely tokens, then 16x more, and sorts the
# whole vocab only when their mass still does not reach p: on CPU a sort of a 50k
# vocab costs ~20 topk(256)s or ~6 topk(4096)s, and LLM distributions are peaked.
_TOP_P_CANDIDATES = 256


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> None:
    """Keep the most likely tokens until their mass reaches p: a token stays while the
    mass ranked above it is < p, so the one that crosses p stays, and so does the top
    token. logits: [num_rows, vocab_size] (already top_k-masked), mutated."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return
    if native_rows(logits):
        torch.ops.pdserve_sampling.top_p_mask_rows_(logits, torch.tensor(top_p, dtype=torch.float32))
        return
    selected = _rows_of(logits, rows)  # [num_selected, vocab_size]
    p = torch.tensor([top_p[i] for i in rows], device=logits.device).unsqueeze(1)  # [num_sel, 1]
    probs = selected.softmax(dim=-1)  # [num_selected, vocab_size]
    num_candidates = _TOP_P_CANDIDATES
    while True:  # 256, 4096 candidates, then the whole vocab
        if num_candidates >= probs.shape[1]:
            ranked_probs, ranked_ids = probs.sort(dim=-1, descending=True)
            break
        ranked_probs, ranked_ids = probs.topk(num_candidates, dim=-1)  # [num_sel, num_candidates]
        if bool((ranked_probs.sum(dim=-1, keepdim=True) >= p).all()):
            break
        num_candidates *= 16
    # Tokens outside the candidates have the candidates' whole mass (>= p) above them.
    mass_above = ranked_probs.cumsum(dim=-1) - ranked_probs  # [num_selected, num_ranked]
    keep = torch.zeros_like(selected, dtype=torch.bool).scatter_(1, ranked_ids, mass_above < p)
    selected.masked_fill_(~keep, float("-inf"))
    if selected is not logits:
        logits[rows] = selected


def _mask_bad_words(logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> None:
    """A bad word's last token to -inf in each row whose output ends with the rest of the
    word (a one-token word always). logits: [num_seqs, vocab_size] float32, mutated."""
    for i, request in enumerate(requests):
        sequences = request.sampling_params.bad_words_token_ids
        if not sequences:
            continue
        output = request.output_token_ids
        # seq[:-1] is what the output must end with ([] for a one-token word: always)
        banned = [seq[-1] for seq in sequences
                  if len(output) >= len(seq) - 1 and output[len(output) - len(seq) + 1:] == seq[:-1]]
        if banned:
            logits[i, banned] = float("-inf")
