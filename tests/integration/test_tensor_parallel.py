"""Tensor and pipeline parallelism give one process's greedy tokens and logits.

Each case starts one real process per rank (spawn, gloo on 127.0.0.1); every rank builds
a ModelRunner for its share of the model and runs the SchedulerOutputs that the parent
builds from the output rank's sampled tokens: a minimal engine loop with chunked
prefill, so steps mix decodes and prefill chunks. fp32 throughout; logits must match the
one-process run within LOGITS_ATOL, tokens exactly.
"""
from __future__ import annotations

import dataclasses
import queue
import random
import socket
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from common.engine.config import KVTransferConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from common.engine.model_files import load_hf_config
from common.engine.model_runner import ModelRunner
from common.engine.outputs import ScheduledRequest, SchedulerOutput
from common.engine.sampling_params import SamplingParams
from common.text.tokenizer import load_tokenizer

LOGITS_ATOL = 1e-4  # fp32; the ranks sum partial matmuls in another order than one process
BLOCK_SIZE = 4
BLOCKS_PER_REQUEST = 8
STEP_TIMEOUT_S = 120.0  # a rank that neither answers nor dies in this long is stuck

# heads 8 / KV heads 2: TP 2 splits the KV heads, TP 4 replicates each on two ranks;
# vocab 1002 leaves two rows of padding at TP 4; 3 layers split 2 + 1 over two stages.
TINY_SHAPE = dict(vocab_size=1002, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2)


@dataclasses.dataclass
class Request:
    req_id: str
    prompt: list[int]
    max_tokens: int
    block_table: list[int]
    num_computed: int = 0
    output: list[int] = dataclasses.field(default_factory=list)


def schedule(requests: list[Request], token_budget: int) -> list[dict]:
    """One step as plain data: each unfinished request's next chunk, within token_budget."""
    steps = []
    for r in requests:
        known = r.prompt + r.output
        if len(r.output) >= r.max_tokens or token_budget == 0:
            continue
        num_new = min(len(known) - r.num_computed, token_budget)
        token_budget -= num_new
        steps.append(dict(req_id=r.req_id, token_ids=known[r.num_computed:r.num_computed + num_new],
                          start_pos=r.num_computed, block_table=r.block_table,
                          do_sample=r.num_computed + num_new == len(known)))
    return steps


def to_scheduler_output(step: list[dict]) -> SchedulerOutput:
    greedy = SamplingParams(temperature=0.0)
    scheduled = [ScheduledRequest(sampling_params=greedy, **s) for s in step]
    return SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled))


def record_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """The logits of each step the runner samples (copied: the sampler scales them in place),
    from compute_logits or, where a one-process model's head is packed (greedy rows), from
    compute_argmax_logits: fp32 logits either way."""
    recorded: list[torch.Tensor] = []

    def recording(compute):
        def record(hidden: torch.Tensor) -> torch.Tensor | None:
            logits = compute(hidden)
            if logits is not None:
                recorded.append(logits.clone())
            return logits
        return record
    runner.compute_logits = recording(runner.compute_logits)
    runner.model.compute_argmax_logits = recording(runner.model.compute_argmax_logits)
    return recorded


def run_engine_loop(prompts: list[list[int]], max_tokens: int, token_budget: int, execute) -> tuple:
    """Drive execute(step) -> (req_ids, sampled_token_ids, logits) to completion; returns each
    request's tokens and every step's logits, in order."""
    requests = [Request(f"r{i}", p, max_tokens, list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)))
                for i, p in enumerate(prompts)]
    all_logits = []
    num_mixed_steps = 0
    while step := schedule(requests, token_budget):
        num_mixed_steps += any(len(s["token_ids"]) > 1 for s in step) and any(len(s["token_ids"]) == 1 for s in step)
        req_ids, sampled, logits = execute(step)
        assert req_ids == [s["req_id"] for s in step if s["do_sample"]]
        by_id = {r.req_id: r for r in requests}
        for s in step:
            by_id[s["req_id"]].num_computed += len(s["token_ids"])
        for req_id, token_ids in zip(req_ids, sampled):
            by_id[req_id].output.extend(token_ids)
        if logits is not None:
            all_logits.append(logits)
    assert num_mixed_steps > 0, "no step mixed decodes and prefill chunks"
    return [r.output for r in requests], all_logits


def run_one_process(model_dir: Path, prompts, max_tokens: int, token_budget: int):
    model_config = ModelConfig.from_hf_config(load_hf_config(model_dir))
    runner = ModelRunner(model_config, model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE)
    runner.allocate_kv_cache(len(prompts) * BLOCKS_PER_REQUEST)
    recorded = record_logits(runner)

    def execute(step):
        out = runner.execute_model(to_scheduler_output(step))
        return out.req_ids, out.sampled_token_ids, recorded.pop() if out.req_ids else None
    return run_engine_loop(prompts, max_tokens, token_budget, execute), runner.kv_bytes_per_block


def worker_main(rank: int, tp: int, pp: int, port: int, model_dir: str, num_blocks: int,
                commands: mp.Queue, results: mp.Queue) -> None:
    """One rank: join the group, build its runner, run each step it is sent."""
    import torch.distributed as dist

    from common.engine.distributed import parallel_state
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * pp)
        parallel_state.initialize_model_parallel(tp, pp)
        model_config = ModelConfig.from_hf_config(load_hf_config(Path(model_dir)))
        runner = ModelRunner(model_config, Path(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                             parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                             rank=rank)
        runner.allocate_kv_cache(num_blocks)
        recorded = record_logits(runner)
        results.put({"rank": rank, "kv_bytes_per_block": runner.kv_bytes_per_block,
                     "num_layers": len(runner.kv_caches), "kv_shape": list(runner.kv_caches[0][0].shape)})
        while (step := commands.get()) is not None:
            out = runner.execute_model(to_scheduler_output(step))
            logits = recorded.pop() if recorded else None
            results.put({"rank": rank, "req_ids": out.req_ids, "sampled": out.sampled_token_ids,
                         "logits": None if logits is None else (list(logits.shape), logits.numpy().tobytes())})
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """tp * pp worker processes and the parent's end of their queues."""

    def __init__(self, model_dir: Path, tp: int, pp: int, num_blocks: int):
        ctx = mp.get_context("spawn")
        self.world_size = tp * pp
        self.output_rank = (pp - 1) * tp
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self.processes = [ctx.Process(target=worker_main, daemon=True,
                                      args=(rank, tp, pp, port, str(model_dir), num_blocks, self.commands[rank],
                                            self.results))
                          for rank in range(self.world_size)]
        for p in self.processes:
            p.start()
        self.ready = self.collect()

    def collect(self) -> list[dict]:
        """One message from every rank, by rank; fails on a rank's error, death or silence."""
        messages: dict[int, dict] = {}
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(messages) < self.world_size:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self.processes) if not p.is_alive() and i not in messages]
                assert not dead, f"ranks {dead} exited without answering"
                assert time.monotonic() < deadline, f"ranks {set(range(self.world_size)) - set(messages)} are stuck"
                continue
            assert "error" not in msg, f"rank {msg['rank']} failed:\n{msg['error']}"
            messages[msg["rank"]] = msg
        return [messages[r] for r in range(self.world_size)]

    def execute(self, step: list[dict]):
        for q in self.commands:
            q.put(step)
        messages = self.collect()
        for msg in messages:
            if msg["rank"] != self.output_rank:
                assert msg["req_ids"] == [] and msg["sampled"] == [], f"rank {msg['rank']} sampled"
        out = messages[self.output_rank]
        logits = None
        if out["logits"] is not None:
            shape, data = out["logits"]
            logits = torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape).copy())
        return out["req_ids"], out["sampled"], logits

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def run_parallel(model_dir: Path, tp: int, pp: int, prompts, max_tokens: int, token_budget: int):
    ranks = Ranks(model_dir, tp, pp, len(prompts) * BLOCKS_PER_REQUEST)
    try:
        return run_engine_loop(prompts, max_tokens, token_budget, ranks.execute), ranks.ready
    finally:
        ranks.close()


def tiny_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (7, 12, 5)]


@pytest.fixture(scope="module")
def tiny_models(tiny_model_factory):
    return {"tied": tiny_model_factory("tp-tied", **TINY_SHAPE, tie_word_embeddings=True),
            "untied": tiny_model_factory("tp-untied", **TINY_SHAPE, tie_word_embeddings=False)}


@pytest.mark.parametrize("model_name, tp, pp", [("tied", 2, 1), ("tied", 4, 1), ("tied", 1, 2), ("untied", 2, 2)],
                         ids=["tp2", "tp4-kv-replicated", "pp2", "tp2xpp2"])
def test_tiny_llama_matches_one_process(tiny_models, model_name, tp, pp):
    model_dir = tiny_models[model_name]
    prompts = tiny_prompts(TINY_SHAPE["vocab_size"])
    (expected_tokens, expected_logits), single_kv_bytes = run_one_process(model_dir, prompts, 6, 8)
    (tokens, logits), ready = run_parallel(model_dir, tp, pp, prompts, 6, 8)
    assert tokens == expected_tokens
    assert len(logits) == len(expected_logits)
    for step, (ours, ref) in enumerate(zip(logits, expected_logits)):
        torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
    # Each rank's KV pool holds its stage's layers (2 + 1 over two stages) and its KV
    # heads (2 / tp, or one replicated head when tp > 2).
    num_kv_heads = max(1, TINY_SHAPE["num_key_value_heads"] // tp)
    for msg in ready:
        stage = msg["rank"] // tp
        num_layers = 3 if pp == 1 else (2, 1)[stage]
        assert msg["num_layers"] == num_layers
        assert msg["kv_shape"][2] == num_kv_heads
        assert msg["kv_bytes_per_block"] == single_kv_bytes * num_layers * num_kv_heads // (3 * 2)


BUNDLED_PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


def test_bundled_model_refuses_tp2_at_start_naming_the_head_counts(bundled_model_dir):
    model_config = ModelConfig.from_hf_config(load_hf_config(bundled_model_dir))
    with pytest.raises(ValueError, match=r"^Total number of attention heads \(9\) must be divisible by tensor "
                                         r"parallel size \(2\)\.$"):
        ModelRunner(model_config, bundled_model_dir, device="cpu", dtype="float32",
                    parallel_config=ParallelConfig(tensor_parallel_size=2), rank=0)


@pytest.mark.parametrize("option, message", [
    (dict(speculative_config=SpeculativeConfig(method="early_exit")),
     r"speculative method early_exit is not supported with pipeline parallelism \(pipeline_parallel_size 2\)"),
    (dict(kv_transfer_config=KVTransferConfig(role="producer")),
     r"KV transfer \(role producer\) is not supported with pipeline parallelism"),
    (dict(), r"rank 1 of tensor_parallel_size 2 x pipeline_parallel_size 1 needs "
             r"parallel_state.initialize_model_parallel first"),
])
def test_parallel_runner_refuses_what_it_cannot_run_before_loading(tiny_models, option, message):
    model_dir = tiny_models["tied"]
    model_config = ModelConfig.from_hf_config(load_hf_config(model_dir))
    # KV transfer and early-exit drafts are refused for pipeline stages; tensor parallel ranks
    # move their own shard and run their share of the draft.
    parallel = (ParallelConfig(pipeline_parallel_size=2) if "kv_transfer_config" in option
                or "speculative_config" in option else ParallelConfig(tensor_parallel_size=2))
    with pytest.raises((ValueError, RuntimeError), match=message):
        ModelRunner(model_config, model_dir, device="cpu", dtype="float32",
                    parallel_config=parallel, rank=1, **option)


def test_bundled_model_tp3_matches_tp1(bundled_model_dir):
    """SmolLM2-135M: 9 query heads and 3 KV heads, so three ranks of 3 and 1 each."""
    tokenizer = load_tokenizer(bundled_model_dir)
    prompts = [tokenizer.encode(p) for p in BUNDLED_PROMPTS]
    (expected_tokens, _), _ = run_one_process(bundled_model_dir, prompts, 4, 8)
    (tokens, _), _ = run_parallel(bundled_model_dir, 3, 1, prompts, 4, 8)
    assert tokens == expected_tokens
