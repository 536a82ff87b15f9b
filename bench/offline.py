"""`pdserve bench offline`: our LLM.generate beside Hugging Face generate and vLLM's CPU build, one run.

Reports output tokens/s on a mixed seeded workload (HF with static batches of 32,
left padding, greedy; vLLM with its own continuous batching), single-stream decode
tokens/s for each, the time to first token of a 1024-token prompt computed in full
(ours and vLLM's) and ours with its first 1000 tokens cached, start-up time and
recompiles after warm-up of our compiled model, the memory each engine holds after its
runs (the proportional set size of its processes, with equal KV pools: `memory`), and the
machine's rooflines measured in the same run (memory copy bandwidth, fp32 matmul rate).
Every side runs the same dtype; vLLM runs in its own venv (bench/peers/vllm_peer.py), up
beside ours for the whole run, the two engines' mixed runs alternating (each pair's ratio
reported as well as the ratio of the medians), each timed step started once the other
engine's processes are quiet, and vLLM's stopped while ours run (--peer-idle); Hugging
Face runs after both have ended. The mixed workload
is greedy unless --temperature (draws) or --logprobs say otherwise, on our side and
vLLM's alike (HF then stays out).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import statistics
import time

import torch
from tqdm import tqdm

from bench.peers.proc_cpu import cpu_and_steal, tree_wakeups_per_s, wait_until_quiet
from bench.peers.proc_memory import tree_memory
from common.engine.config import KV_CACHE_DTYPE_NAMES

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5,
                           device: torch.device = torch.device("cpu")) -> float:
    """Bytes/s of a large tensor copy on the device, counting the read and the write."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def measure_matmul_flops(n: int = 2048, repeats: int = 5, device: torch.device = torch.device("cpu"),
                         dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def make_workload(num_requests: int, seed: int, vocab_size: int, min_prompt: int, max_prompt: int,
                  min_out: int, max_out: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Ordinary token ids (skip the low special ids) so nothing ends early by accident.
    return [([rng.randrange(100, vocab_size) for _ in range(rng.randint(min_prompt, max_prompt))],
             rng.randint(min_out, max_out)) for _ in range(num_requests)]


def run_ours(llm, workload, temperature: float = 0.0, logprobs: int | None = None) -> tuple[float, int]:
    """The mixed workload through our engine: greedy, or drawn at the temperature from the
    engine's generator (no per-request seeds: vLLM's CPU build 0.32.0 stops its engine on a
    seeded request, "CPU Generator does not use offset", so neither side takes them);
    each token's logprobs where asked. (seconds, output tokens)"""
    from common.engine.sampling_params import SamplingParams
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, logprobs=logprobs)
              for _, m in workload]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == sum(m for _, m in workload)
    return elapsed, num_tokens


class StepTimes:
    """The engine's step times over one run (its step observer), summed apart for steps
    whose every request computes one token (decode steps) and the rest (prompt chunks
    among them): where a run's time goes, and whether it moves from run to run of one
    process."""

    def __init__(self) -> None:
        self.decode_seconds = self.other_seconds = 0.0
        self.num_decode_steps = self.num_other_steps = 0

    def __call__(self, scheduler_output, seconds: float) -> None:
        if all(len(scheduled.token_ids) == 1 for scheduled in scheduler_output.scheduled):
            self.decode_seconds += seconds
            self.num_decode_steps += 1
        else:
            self.other_seconds += seconds
            self.num_other_steps += 1

    def as_dict(self) -> dict:
        return {"decode_seconds": self.decode_seconds, "num_decode_steps": self.num_decode_steps,
                "other_seconds": self.other_seconds, "num_other_steps": self.num_other_steps}


def run_hf(hf_model, workload, batch_size: int, pad_token_id: int) -> tuple[float, int]:
    """Static batches, left padding, greedy; only each request's own max_tokens count."""
    t0 = time.perf_counter()
    num_tokens = 0
    for start in tqdm(range(0, len(workload), batch_size), desc="hf generate"):
        batch = workload[start:start + batch_size]
        max_len = max(len(p) for p, _ in batch)
        input_ids = torch.tensor([[pad_token_id] * (max_len - len(p)) + p for p, _ in batch], device=hf_model.device)
        mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p, _ in batch], device=hf_model.device)
        max_new = max(m for _, m in batch)
        with torch.inference_mode():
            # min_new_tokens == max_new_tokens: EOS is never produced (ignore_eos).
            hf_model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                              min_new_tokens=max_new, pad_token_id=pad_token_id, temperature=None,
                              top_p=None, top_k=None)
        num_tokens += sum(m for _, m in batch)
    _sync(hf_model.device)
    return time.perf_counter() - t0, num_tokens


def single_stream(llm, prompt: list[int], num_new: int) -> tuple[float, list[int]]:
    """Our decode tokens/s for one request alone (after a short warm-up request), and its
    greedy tokens."""
    from common.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params.clone(max_tokens=4))
    t0 = time.perf_counter()
    output = llm.generate({"prompt_token_ids": prompt}, params)
    return num_new / (time.perf_counter() - t0), list(output[0].outputs[0].token_ids)


def num_leading_equal(token_ids: list[int], other_token_ids: list[int]) -> int:
    """How many greedy tokens two engines agree on before they first differ: a check that
    both computed the model (in fp32 they agree for dozens of tokens; an engine computing
    garbage, as one loading code compiled for another CPU capability did, agrees on none)."""
    return next((i for i, (a, b) in enumerate(zip(token_ids, other_token_ids)) if a != b),
                min(len(token_ids), len(other_token_ids)))


def hf_single_stream(hf_model, prompt: list[int], num_new: int, pad_token_id: int) -> float:
    ids = torch.tensor([prompt], device=hf_model.device)
    with torch.inference_mode():
        hf_model.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=pad_token_id)
        t0 = time.perf_counter()
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_new,
                          min_new_tokens=num_new, pad_token_id=pad_token_id, temperature=None,
                          top_p=None, top_k=None)
        _sync(hf_model.device)
    return num_new / (time.perf_counter() - t0)


def ttft_prompts(vocab_size: int, seed: int, prefix_len: int = 1000,
                 suffix_len: int = 24) -> tuple[list[int], list[int]]:
    """Two prefix_len + suffix_len prompts sharing their first prefix_len tokens: the one
    timed cold (on every side) and the one timed after it, with the prefix cached (ours)."""
    rng = random.Random(seed + 1)
    prefix = [rng.randrange(100, vocab_size) for _ in range(prefix_len)]
    cold_prompt = prefix + [rng.randrange(100, vocab_size) for _ in range(suffix_len)]
    return cold_prompt, prefix + [rng.randrange(100, vocab_size) for _ in range(suffix_len)]


def ttft(llm, prompt: list[int], cold: bool) -> float:
    """Seconds to the first token of prompt, from an emptied prefix cache where cold."""
    from common.engine.sampling_params import SamplingParams
    if cold:
        llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - t0


def peer_spec(model_dir, dtype: str, args, workload, single_prompt: list[int], ttft_prompt: list[int],
              max_model_len: int) -> dict:
    return {"model_dir": str(model_dir), "dtype": dtype, "seed": args.seed, "max_model_len": max_model_len,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "workload": [[p, m] for p, m in workload], "single_prompt": single_prompt,
            "single_stream_tokens": args.single_stream_tokens, "ttft_prompt": ttft_prompt,
            "repeats": args.repeats, "temperature": args.temperature, "logprobs": args.logprobs,
            "kv_cache_dtype": args.kv_cache_dtype, "speculative_config": args.speculative_config}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__)
    parser.add_argument("--json", dest="json_path", default=None, help="write every figure here")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", help="both sides run in this dtype (auto: see --dtype of "
                                                        "the engine); the peers get the one it resolves to")
    parser.add_argument("--enforce-eager", action="store_true", help="our engine uncompiled")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto",
                        help="both sides' KV cache: the model's dtype, or 8-bit float codes (vLLM's flag)")
    parser.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                        help="both sides speculate with this config (keys both take: method ngram, "
                             "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)")
    parser.add_argument("--single-weight-copy", action="store_true",
                        help="our engine keeps each bf16 linear's weight once (the engine's --single-weight-copy)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="our engine's --num-scheduler-steps (greedy decode steps back to back; vLLM's CPU "
                             "build has no such option)")
    parser.add_argument("--peer", choices=["hf", "vllm", "all", "none"], default="hf",
                        help="what to run the same workload through beside ours: Hugging Face generate, "
                             "vLLM's CPU build (its own venv, scripts/setup_vllm_peer.sh), both, or nothing")
    parser.add_argument("--peer-venv", default=None, help="vLLM's venv (default .venv-vllm, $PDSERVE_VLLM_VENV)")
    parser.add_argument("--peer-threads-bind", default="auto",
                        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (its default: reserves a core for its "
                             "engine process on small machines) or all")
    parser.add_argument("--peer-idle", choices=["paused", "running"], default="paused",
                        help="vLLM's processes while our side runs: stopped (SIGSTOP; idle, its engine wakes "
                             "~1,300 times a second, each wakeup a core taken from our run's threads) or left "
                             "running (the ratio moved within the host's noise either way on the Zen 5)")
    parser.add_argument("--peer-preload", choices=["auto", "none"], default="auto",
                        help="vLLM's LD_PRELOAD: auto (what its CPU guide recommends, where found: tcmalloc, "
                             "and Intel OpenMP from its venv) or none (glibc's malloc and torch's libgomp)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs on each side (ours and vLLM's, alternating) of the mixed workload and "
                             "of the single stream (the medians count) and of the long prompt's cold time to "
                             "first token (the best counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--single-stream-tokens", type=int, default=128)
    # Continuous batching wants every request of the workload in flight at once.
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf", action="store_true", help="same as --peer none (quick checks)")
    parser.add_argument("--step-times", action="store_true",
                        help="time each of our mixed runs' steps, decode steps apart from the rest "
                             "(mixed.ours_step_times in the JSON)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the mixed workload's sampling on our side and vLLM's (0: greedy; else draws)")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="the mixed workload's requests ask for each token's logprobs and this many top ones")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    peers = {"hf": {"hf"}, "vllm": {"vllm"}, "all": {"hf", "vllm"}, "none": set()}[args.peer]
    if args.skip_hf:
        peers.discard("hf")
    if "hf" in peers and (args.temperature > 0 or args.logprobs is not None):
        parser.error("--temperature and --logprobs are for our engine and vLLM: "
                     "add --skip-hf (HF's batches are greedy)")

    from common.engine.compilation import num_compiled_graphs
    from common.engine.llm import LLM
    from common.engine.models.prepacked_linear import model_weight_bytes

    vllm_python = None
    if "vllm" in peers:  # fail before minutes of our own run, not after
        from bench.peers.vllm_peer import vllm_python as find_vllm
        vllm_python = find_vllm(args.peer_venv)

    from bench.profile import cpu_family_model, cpu_model_name, now_iso, versions
    results: dict = {"when": now_iso(), "versions": versions().model_dump(), "config": vars(args),
                     "machine": {"platform": platform.platform(), "cpu": cpu_model_name(),
                                 "cpu_family_model": cpu_family_model(), "torch_threads": torch.get_num_threads()}}
    from common.engine.device import select_device
    device = select_device("auto")  # the engine's own choice below
    results["machine"]["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":  # the GPU's rooflines: its memory, its matrix rate in the run's dtype
        from common.engine.device import select_dtype
        matmul_dtype = select_dtype(args.dtype, device)
        bandwidth = measure_copy_bandwidth(1 << 31, device=device)
        flops = measure_matmul_flops(8192, device=device, dtype=matmul_dtype)
    else:
        matmul_dtype = torch.float32
        bandwidth, flops = measure_copy_bandwidth(), measure_matmul_flops()
    results["roofline"] = {"copy_bandwidth_GBps": bandwidth / 1e9, "matmul_GFLOPs": flops / 1e9,
                           "matmul_dtype": str(matmul_dtype).removeprefix("torch.")}
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              single_weight_copy=args.single_weight_copy, num_scheduler_steps=args.num_scheduler_steps,
              kv_cache_dtype=args.kv_cache_dtype, speculative_config=args.speculative_config)
    runner = llm.engine.executor.runner
    dtype = str(runner.dtype).removeprefix("torch.")
    results["startup"] = {"seconds": time.perf_counter() - started, "compiled": runner.forward is not runner.model,
                          "dtype": dtype}
    # The timed runs start once the KV pool's pages are faulted in, as vLLM's start-up zeroes
    # its pool before its first request; the wait is reported, not counted in the start-up.
    waited_from = time.perf_counter()
    results["startup"]["kv_pool_resident"] = llm.wait_kv_cache_resident()
    results["startup"]["kv_pool_resident_wait_s"] = time.perf_counter() - waited_from
    graphs_after_warm_up = num_compiled_graphs()
    cfg = llm.engine.model_config
    weight_bytes = model_weight_bytes(runner.model)
    num_params = cfg.num_params()
    workload = make_workload(args.num_requests, args.seed, cfg.vocab_size, args.min_prompt, args.max_prompt,
                             args.min_output, args.max_output)
    pad = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    single_prompt = workload[0][0][:16]

    cold_prompt, warm_prompt = ttft_prompts(cfg.vocab_size, args.seed)
    model_dir = llm.engine.model_dir
    kv_cache_gib = llm.engine.config.cache.num_blocks * llm.engine.executor.kv_bytes_per_block() / (1 << 30)

    with contextlib.ExitStack() as stack:
        peer = None
        if vllm_python is not None:  # up beside ours, so that the two sides' runs alternate
            from pathlib import Path

            from bench.peers.vllm_peer import OfflinePeer, preload_choice
            preload = preload_choice(args.peer_preload, vllm_python)
            max_model_len = max(max(len(p) + m for p, m in workload), len(single_prompt) + args.single_stream_tokens,
                                len(cold_prompt)) + 16
            log_path = Path(args.json_path or "bench-offline").with_suffix(".vllm.log")
            peer = stack.enter_context(OfflinePeer(
                vllm_python, peer_spec(model_dir, dtype, args, workload, single_prompt, cold_prompt, max_model_len),
                args.peer_threads_bind, kv_cache_gib, log_path, start_timeout_s=1800, preload=preload))
            wait_until_quiet(peer.pid)
            results["vllm"] = {"vllm_version": peer.ready["vllm_version"], "threads_bind": args.peer_threads_bind,
                               "preload": preload, "log": str(log_path), "idle": args.peer_idle,
                               "idle_wakeups_per_s": tree_wakeups_per_s(peer.pid),
                               "ours_idle_wakeups_per_s": tree_wakeups_per_s(os.getpid(), (peer.pid,))}

        # The median of --repeats runs a side, each of ours from an emptied prefix cache
        # (vLLM's side runs without one). With vLLM up the sides alternate, each pair in
        # the other order from the last, so a host that drifts by several percent over
        # minutes moves both sides alike; each pair's ratio is kept too.
        num_tokens = sum(m for _, m in workload)
        ours_seconds, vllm_seconds, quiet_waits = [], [], []
        # The host's steal over each timed run (a VM's cores taken elsewhere): the runs'
        # spread between minutes is mostly the host's, and it need not fall on both sides alike.
        # Beside it each side's own CPU seconds (every thread of its processes).
        ours_steal_s, vllm_steal_s = [], []
        ours_cpu_s, vllm_cpu_s = [], []
        ours_exclude_pids = (peer.pid,) if peer is not None else ()
        ours_step_times: list[dict] = []

        def let_settle(before: str) -> None:
            """With both engines up, a timed step starts once the other side is quiet (vLLM
            keeps a core busy for about a second after each run: bench/peers/proc_cpu.py)."""
            if peer is not None:
                other, exclude = (peer.pid, ()) if before == "ours" else (os.getpid(), (peer.pid,))
                waited, quiet = wait_until_quiet(other, exclude)
                quiet_waits.append({"before": before, "seconds": waited, "quiet": quiet})

        def ours_side():
            """While our side runs: vLLM stopped (--peer-idle paused), else as it is."""
            if peer is None or args.peer_idle == "running":
                return contextlib.nullcontext()
            return peer.paused()

        def ours_run():
            llm.reset_prefix_cache()
            let_settle("ours")
            step_times = StepTimes()
            if args.step_times:
                llm.engine.step_observer = step_times
            try:
                with ours_side(), cpu_and_steal([os.getpid()], ours_exclude_pids) as reading:
                    ours_seconds.append(run_ours(llm, workload, args.temperature, args.logprobs)[0])
                ours_cpu_s.append(reading["cpu_s"])
                ours_steal_s.append(reading["steal_s"])
            finally:
                llm.engine.step_observer = None
            if args.step_times:
                ours_step_times.append(step_times.as_dict())

        def vllm_run():
            let_settle("vllm")
            with cpu_and_steal([peer.pid]) as reading:
                answer = peer.call("mixed", timeout_s=1800)
            vllm_cpu_s.append(reading["cpu_s"])
            vllm_steal_s.append(reading["steal_s"])
            assert answer["num_output_tokens"] == num_tokens, answer
            vllm_seconds.append(answer["seconds"])

        for i in range(args.repeats):
            sides = [ours_run] if peer is None else [ours_run, vllm_run] if i % 2 == 0 else [vllm_run, ours_run]
            for side in sides:
                side()
        elapsed = statistics.median(ours_seconds)
        ours_tps = num_tokens / elapsed
        results["mixed"] = {"ours_seconds": elapsed, "ours_output_tokens_per_s": ours_tps,
                            "ours_run_seconds": ours_seconds, "ours_run_steal_s": ours_steal_s,
                            "ours_run_cpu_s": ours_cpu_s,
                            "num_output_tokens": num_tokens,
                            "ours_step_times": ours_step_times,
                            "num_prompt_tokens": sum(len(p) for p, _ in workload)}
        # The long prompt's cold time to first token and the single stream, each side's runs
        # alternating like the mixed ones (this host's speed can move 2x in a minute): the
        # best time to first token of each side, the median single stream.
        cold_runs, single_runs, vllm_cold_runs, vllm_single_runs = [], [], [], []
        single_token_ids = []

        def ours_short_runs():
            let_settle("ours")
            with ours_side():
                cold_runs.append(ttft(llm, cold_prompt, cold=True))
                tokens_per_s, single_token_ids[:] = single_stream(llm, single_prompt, args.single_stream_tokens)
            single_runs.append(tokens_per_s)

        def vllm_short_runs():
            let_settle("vllm")
            vllm_cold_runs.append(peer.call("cold_ttft", timeout_s=600, repeats=1)["seconds"])
            vllm_single_runs.append(peer.call("single_stream", timeout_s=600))

        for i in range(args.repeats):
            sides = ([ours_short_runs] if peer is None
                     else [ours_short_runs, vllm_short_runs] if i % 2 == 0 else [vllm_short_runs, ours_short_runs])
            for side in sides:
                side()
        cold = min(cold_runs)
        let_settle("ours")
        with ours_side():
            warm = ttft(llm, warm_prompt, cold=False)  # its first 1,000 tokens cached by the last cold run
        results["prefix_cache"] = {"cold_ttft_s": cold, "cold_ttft_runs_s": cold_runs, "cached_1000_ttft_s": warm,
                                   "ratio": warm / cold, "prompt_tokens": len(cold_prompt)}
        ours_single = statistics.median(single_runs)
        results["recompiles_after_warm_up"] = num_compiled_graphs() - graphs_after_warm_up
        if runner.decode_graphs is not None:
            results["cuda_graphs"] = {"buckets": runner.decode_graphs.buckets,
                                      "decode_steps_replayed": runner.decode_graphs.num_replays}
        decode_roofline_tps = bandwidth / weight_bytes
        batched_roofline_tps = flops / (2 * num_params)
        results["single_stream"] = {"ours_tokens_per_s": ours_single, "ours_runs_tokens_per_s": single_runs,
                                    "ours_token_ids": single_token_ids,
                                    "roofline_tokens_per_s": decode_roofline_tps,
                                    "ours_pct_of_roofline": 100 * ours_single / decode_roofline_tps}
        results["mixed"]["batched_roofline_tokens_per_s"] = batched_roofline_tps
        results["mixed"]["ours_pct_of_batched_roofline"] = 100 * ours_tps / batched_roofline_tps
        results["model"] = {"num_params": num_params, "weight_bytes": weight_bytes}
        # What the engine holds after the runs (this process and any it started), beside the
        # KV pool both sides were given; vLLM's runner measures its processes the same way.
        results["memory"] = {"kv_cache_gib": kv_cache_gib, "ours": tree_memory(exclude_pids=[peer.pid] if peer else [])}
        if peer is not None:
            vllm_tps = num_tokens / statistics.median(vllm_seconds)
            pair_speedups = [v / o for o, v in zip(ours_seconds, vllm_seconds)]
            vllm_single = {"tokens_per_s": statistics.median([r["tokens_per_s"] for r in vllm_single_runs]),
                           "token_ids": vllm_single_runs[-1]["token_ids"]}
            vllm_cold = min(vllm_cold_runs)
            results["vllm"].update(mixed_seconds=statistics.median(vllm_seconds), mixed_run_seconds=vllm_seconds,
                                   num_output_tokens=num_tokens, output_tokens_per_s=vllm_tps, cold_ttft_s=vllm_cold,
                                   single_stream_tokens_per_s=vllm_single["tokens_per_s"],
                                   single_stream_token_ids=vllm_single["token_ids"], quiet_waits=quiet_waits)
            results["mixed"].update(vllm_output_tokens_per_s=vllm_tps, vllm_run_seconds=vllm_seconds,
                                    vllm_run_steal_s=vllm_steal_s, vllm_run_cpu_s=vllm_cpu_s,
                                    speedup_vs_vllm=ours_tps / vllm_tps, pair_speedups_vs_vllm=pair_speedups,
                                    median_pair_speedup_vs_vllm=statistics.median(pair_speedups))
            results["prefix_cache"].update(vllm_cold_ttft_s=vllm_cold, vllm_cold_ttft_runs_s=vllm_cold_runs,
                                           cold_ttft_vs_vllm=cold / vllm_cold)
            results["single_stream"].update(vllm_tokens_per_s=vllm_single["tokens_per_s"],
                                            vllm_runs_tokens_per_s=[r["tokens_per_s"] for r in vllm_single_runs],
                                            speedup_vs_vllm=ours_single / vllm_single["tokens_per_s"],
                                            leading_tokens_equal_to_vllm=num_leading_equal(
                                                single_token_ids, vllm_single["token_ids"]))
            if results["single_stream"]["leading_tokens_equal_to_vllm"] == 0:
                logger.warning("our single stream's greedy tokens differ from vLLM's from the first one: one of "
                               "the two engines is not computing the model (ours: %s; vLLM's: %s)",
                               single_token_ids[:8], vllm_single["token_ids"][:8])
            results["memory"]["vllm"] = peer.call("memory", timeout_s=60)
    if args.speculative_config is not None:  # ours: what the drafts did over every run
        results["speculation"] = {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}
    llm.engine.shutdown()  # Hugging Face gets the machine to itself
    del llm, runner
    if "hf" in peers:
        from transformers import AutoModelForCausalLM
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        hf_elapsed, hf_tokens = run_hf(hf_model, workload, args.hf_batch_size, pad)
        hf_tps = hf_tokens / hf_elapsed
        results["mixed"].update(hf_seconds=hf_elapsed, hf_output_tokens_per_s=hf_tps,
                                speedup_vs_hf=ours_tps / hf_tps)
        hf_single = hf_single_stream(hf_model, single_prompt, args.single_stream_tokens, pad)
        results["single_stream"].update(hf_tokens_per_s=hf_single, speedup_vs_hf=ours_single / hf_single)
        del hf_model
    text = json.dumps(results, indent=2)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    return 0
