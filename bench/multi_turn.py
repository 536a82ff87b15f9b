"""`pdserve bench multi-turn`: chat conversations whose prompts grow turn by turn.

Each conversation is one of --num-system-prompts system prompts and --turns user turns.
Turn k's prompt is the conversation so far (the system prompt, the earlier user turns and
the answers the server gave, as token ids: a chat client resends the history) plus the new
user turn. A conversation sends its next turn once the answer to the last one has finished
(after --think-time); --max-concurrency conversations are open at once, and the next opens
when one closes. Every turn after the first can find the conversation so far in the prefix
cache of the instance that served the turn before, if placement sends it there: the
workload of multi-turn chat (vLLM's benchmarks/multi_turn) and of colocated prefix-aware
placement (Dynamo's KV router).

--backend openai needs a server whose /v1/completions returns the answers' token ids
(`return_token_ids`: pdserve's gateway, vllm serve). Over the chat API (--backend
openai-chat) the conversation is text: the system prompt and user turns are the same
draws written as words (one common English word per id), and the history is the messages
so far with the answers' text, as a chat client keeps it; the server's chat template and
tokenizer then decide how much of it its prefix cache finds.

Reported over every turn: TTFT, TPOT, ITL, E2E latency and throughput (vLLM's
definitions, bench.serve.metrics); per turn index: TTFT and the share of prompt tokens the
server found cached (usage.cached_prompt_tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from bench.serve.client import (
    Backend, GrpcGenerateBackend, OpenAIChatBackend, OpenAICompletionsBackend, describe_error, send_one)
from bench.serve.datasets import WORDS, BenchRequest, Vocabulary, parse_length_range
from bench.serve.main import add_server_flags, json_safe, load_vocabulary, make_backend
from bench.serve.metrics import RequestOutcome, compute_metrics, format_report, summarize


# The backends a conversation can go through (OpenAIChatBackend is an OpenAICompletionsBackend).
ChatBackend = GrpcGenerateBackend | OpenAICompletionsBackend


@dataclass
class Conversation:
    conversation_id: int
    system_prompt: list[int]
    user_turns: list[list[int]]  # the user's part of each turn
    output_lens: list[int]  # max_tokens of each turn


@dataclass
class TurnResult:
    conversation_id: int
    turn: int  # 0 for the first
    outcome: RequestOutcome
    num_cached_tokens: int  # prompt tokens the server found in a prefix cache
    decode_instance_id: str = ""  # the instance that answered (placement moved the conversation when it changes)


def make_conversations(num: int, vocab: Vocabulary, rng: np.random.Generator, num_turns: int = 4,
                       system_prompt_len: int = 256, num_system_prompts: int = 4,
                       user_len_range: tuple[int, int] = (32, 96), output_len_range: tuple[int, int] = (32, 64),
                       max_model_len: int | None = None) -> list[Conversation]:
    """Token-id conversations, deterministic in rng; each draws one of the system prompts."""
    if num < 1 or num_turns < 1 or num_system_prompts < 1 or system_prompt_len < 0:
        raise ValueError("need >= 1 conversation, turn and system prompt, and a system prompt length >= 0")
    (user_low, user_high), (out_low, out_high) = user_len_range, output_len_range
    if not 1 <= user_low <= user_high or not 1 <= out_low <= out_high:
        raise ValueError(f"user and output lengths must be ranges of >= 1 tokens; got {user_len_range}, "
                         f"{output_len_range}")
    longest = system_prompt_len + num_turns * (user_high + out_high)
    if max_model_len and longest > max_model_len:
        raise ValueError(f"a conversation may reach {longest} tokens, past max_model_len {max_model_len}: "
                         f"fewer turns or shorter parts")
    ordinary = vocab.ordinary_ids()
    system_prompts = [rng.choice(ordinary, size=system_prompt_len).tolist() for _ in range(num_system_prompts)]
    conversations = []
    for conversation_id in range(num):
        user_turns = [rng.choice(ordinary, size=int(rng.integers(user_low, user_high + 1))).tolist()
                      for _ in range(num_turns)]
        output_lens = rng.integers(out_low, out_high + 1, size=num_turns).tolist()
        conversations.append(Conversation(conversation_id, system_prompts[int(rng.integers(num_system_prompts))],
                                          user_turns, output_lens))
    return conversations


class AnswerReader(Backend):
    """One turn as send_one sees a backend (its timing and failures are the serve benchmark's),
    keeping what the conversation needs from the messages: the answer (token ids; text over
    the chat API), the prompt tokens the server counted and found cached, and the decode
    instance that answered (gRPC only: the OpenAI API does not say).

    Over /v1/completions the answer's ids come from `return_token_ids` (vLLM's extension,
    which pdserve's gateway serves too); over either OpenAI API the cached tokens come from
    usage.prompt_tokens_details (vLLM reports it under --enable-prompt-tokens-details)."""

    def __init__(self, backend: ChatBackend):
        if (isinstance(backend, OpenAICompletionsBackend) and not isinstance(backend, OpenAIChatBackend)
                and not backend.return_token_ids):
            raise ValueError("a conversation over the OpenAI API needs return_token_ids: the answers' token ids")
        self.backend = backend
        self.answer: list[int] = []
        self.answer_text = ""
        self.num_prompt_tokens = 0  # as the server counted them; 0: it did not say
        self.num_cached_tokens = 0
        self.decode_instance_id = ""

    async def stream(self, request: BenchRequest):
        if isinstance(self.backend, OpenAIChatBackend):
            async for item in self.backend.stream(request, observe=self._read_chat_chunk):
                yield item
            return
        if isinstance(self.backend, OpenAICompletionsBackend):
            async for arrival, chunk in self.backend.stream_chunks(request):
                self._read_usage(chunk)
                token_ids = [i for choice in chunk.get("choices") or () for i in choice.get("token_ids") or ()]
                self.answer += token_ids
                yield arrival, len(token_ids)
            return
        async for arrival, message in self.backend.stream_messages(request):
            self.answer += message.token_ids
            if message.HasField("usage"):
                self.num_prompt_tokens = message.usage.prompt_tokens
                self.num_cached_tokens = message.usage.cached_prompt_tokens
            self.decode_instance_id = message.decode_instance_id or self.decode_instance_id
            yield arrival, len(message.token_ids)

    def _read_chat_chunk(self, chunk: dict) -> None:
        self._read_usage(chunk)
        self.answer_text += "".join(OpenAIChatBackend.choice_text(c) for c in chunk.get("choices") or ())

    def _read_usage(self, chunk: dict) -> None:
        usage = chunk.get("usage") or {}
        self.num_prompt_tokens = usage.get("prompt_tokens") or self.num_prompt_tokens
        details = usage.get("prompt_tokens_details") or {}
        self.num_cached_tokens = details.get("cached_tokens") or self.num_cached_tokens


def words(token_ids: list[int]) -> str:
    """Token ids written as text for the chat API: one common English word per id."""
    return " ".join(WORDS[i % len(WORDS)] for i in token_ids)


async def run_conversation(backend: ChatBackend, conversation: Conversation, benchmark_start: float,
                           think_time_s: float = 0.0) -> list[TurnResult]:
    """Its turns one after another, each prompt the history plus the new user turn; a failed
    turn ends the conversation (there is no answer to carry on from)."""
    chat = isinstance(backend, OpenAIChatBackend)
    history = list(conversation.system_prompt)
    messages = [{"role": "system", "content": words(conversation.system_prompt)}]
    results = []
    for turn, (user, output_len) in enumerate(zip(conversation.user_turns, conversation.output_lens)):
        if turn and think_time_s:
            await asyncio.sleep(think_time_s)
        prompt = history + user
        messages.append({"role": "user", "content": words(user)})
        reader = AnswerReader(backend)
        # Over the chat API the messages are the request; the prompt's ids give its length
        # until the server counts it.
        request = (BenchRequest("", len(prompt), output_len, messages=list(messages)) if chat
                   else BenchRequest(prompt, len(prompt), output_len))
        outcome = await send_one(reader, request, benchmark_start)
        # The server's count where it gave one: over the chat API the template adds tokens
        # and the words are not one token each.
        outcome.prompt_len = reader.num_prompt_tokens or outcome.prompt_len
        results.append(TurnResult(conversation.conversation_id, turn, outcome, reader.num_cached_tokens,
                                  reader.decode_instance_id))
        if outcome.error:
            break
        history = prompt + reader.answer
        messages.append({"role": "assistant", "content": reader.answer_text})
    return results


async def run_conversations(backend: ChatBackend, conversations: list[Conversation],
                            max_concurrency: int, think_time_s: float = 0.0,
                            progress: bool = False) -> tuple[list[TurnResult], float]:
    """Every conversation, at most max_concurrency open at once; (turn results, wall seconds)."""
    from tqdm import tqdm

    slots = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=sum(len(c.user_turns) for c in conversations), disable=not progress, unit="turn")

    async def one(conversation: Conversation) -> list[TurnResult]:
        async with slots:
            results = await run_conversation(backend, conversation, start, think_time_s)
        bar.update(len(conversation.user_turns))
        return results

    start = time.perf_counter()
    try:
        per_conversation = await asyncio.gather(*(one(c) for c in conversations))
    finally:
        bar.close()
    return [r for results in per_conversation for r in results], time.perf_counter() - start


def by_turn(results: list[TurnResult], percentiles: list[float]) -> list[dict]:
    """Per turn index: how many completed, their TTFT, the share of prompt tokens cached, and
    how many went to another instance than their conversation's turn before."""
    served_by = {(r.conversation_id, r.turn): r.decode_instance_id for r in results if r.outcome.success}
    rows = []
    for turn in sorted({r.turn for r in results}):
        done = [r for r in results if r.turn == turn and r.outcome.success]
        num_prompt = sum(r.outcome.prompt_len for r in done)
        moved = [r for r in done
                 if turn and served_by.get((r.conversation_id, turn - 1)) not in (None, r.decode_instance_id)]
        rows.append({"turn": turn + 1, "completed": len(done), "num_moved": len(moved),
                     "mean_prompt_len": num_prompt / len(done) if done else None,
                     "cached_share": sum(r.num_cached_tokens for r in done) / num_prompt if num_prompt else None,
                     **summarize("ttft", [r.outcome.ttft_s for r in done], percentiles)})
    return rows


def format_by_turn(rows: list[dict]) -> str:
    lines = [f"{'turn':>4} {'done':>5} {'moved':>6} {'prompt':>7} {'cached':>7} {'mean TTFT':>10} {'p99 TTFT':>9}"]
    for row in rows:
        cached = "-" if row["cached_share"] is None else f"{row['cached_share']:.3f}"
        mean, p99 = row["mean_ttft_ms"], row.get("p99_ttft_ms")
        lines.append(f"{row['turn']:>4} {row['completed']:>5} {row['num_moved']:>6} "
                     f"{row['mean_prompt_len'] or 0:>7.0f} {cached:>7} {mean or 0:>8.0f}ms {p99 or 0:>7.0f}ms")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench multi-turn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(parser)
    parser.add_argument("--tokenizer", default=None,
                        help="'bundled' or a local HF directory: excludes all its special ids from prompts; "
                             "default: vocab size and EOS ids from the gateway's ModelInfo")
    parser.add_argument("--num-conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument("--system-prompt-len", type=int, default=256)
    parser.add_argument("--num-system-prompts", type=int, default=4, help="conversations draw one of these")
    parser.add_argument("--user-len", type=parse_length_range, default=(32, 96), help="LOW-HIGH tokens per turn")
    parser.add_argument("--output-len", type=parse_length_range, default=(32, 64), help="LOW-HIGH tokens per answer")
    parser.add_argument("--max-concurrency", type=int, default=4, help="conversations open at once")
    parser.add_argument("--think-time", type=float, default=0.0, help="seconds between an answer and the next turn")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--request-timeout", type=float, default=None, help="per-turn deadline, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metric-percentiles", default="50,99", help="percentiles to report")
    parser.add_argument("--json", default=None, metavar="FILE", help="write every figure and the config")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return parser


async def benchmark(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    async with make_backend(args, ignore_eos=True, return_token_ids=True, request_id_prefix="multi-turn") as backend:
        try:
            server_info = await backend.server_info() or {}
        except Exception as e:  # noqa: BLE001 -- nothing to measure
            where = args.gateway if args.backend == "grpc" else args.base_url
            print(f"pdserve bench multi-turn: cannot reach the server at {where}: {describe_error(e)}",
                  file=sys.stderr)
            return 1
        vocab = load_vocabulary(argparse.Namespace(tokenizer=args.tokenizer, prompt_format="ids"), server_info)
        max_model_len = int(server_info.get("max_model_len") or 0) or None
        conversations = make_conversations(
            args.num_conversations, vocab, np.random.default_rng(args.seed), args.turns, args.system_prompt_len,
            args.num_system_prompts, args.user_len, args.output_len, max_model_len)
        print(f"{len(conversations)} conversations x {args.turns} turns, {args.max_concurrency} open at once")
        results, duration = await run_conversations(backend, conversations, args.max_concurrency, args.think_time,
                                                    not args.disable_tqdm)
    metrics = compute_metrics([r.outcome for r in results], duration, None, percentiles)
    turns = by_turn(results, percentiles)
    print(format_report(metrics, percentiles, "Multi-turn Benchmark Result"))
    print(format_by_turn(turns))
    if args.json:
        import json
        config = {**vars(args), "server_info": server_info, "max_model_len_used": max_model_len,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        record = {"config": config, "metrics": metrics, "by_turn": turns,
                  "turns": [{"conversation_id": r.conversation_id, "turn": r.turn + 1,
                             "num_cached_tokens": r.num_cached_tokens, "decode_instance_id": r.decode_instance_id,
                             **asdict(r.outcome)} for r in results]}
        with open(args.json, "w") as f:
            json.dump(json_safe(record), f, indent=1)
        print(f"wrote {args.json}")
    num_turns = sum(len(c.user_turns) for c in conversations)
    return 0 if metrics["completed"] == num_turns else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(benchmark(args))
    except ValueError as e:
        print(f"pdserve bench multi-turn: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
