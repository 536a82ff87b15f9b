"""`pdserve bench serve-peer`: pdserve and `vllm serve` under the same load, one after the other.

Each server gets the machine alone, the same model directory, dtype, context length
and KV pool; one client (`pdserve bench serve --backend openai`, a process of its
own) sends both the same seeded requests at each request rate over the same
OpenAI-compatible completions API. pdserve runs in its best configuration for a
small machine by default: one decode instance that prefills locally (`pdserve up
--prefill 0 --decode 1`). Reported: output tokens/s, p99 TPOT and TTFT (mean, p99)
per rate and side, and the throughput ratios. Each rate sends prompts of its own (bench
serve's sweep), so every prompt is prefilled. With --repeats N the two servers take turns
N times, the order alternating (ours first, then vLLM first, ...), each turn on a freshly
started server; each figure is the median of its rounds, beside every round's ratio, so a
host whose speed drifts over the minutes weighs on both sides alike. With --lora-rank R both
serve one random rank-R PEFT adapter (`--lora-modules`; vLLM with `--enable-lora`) and every
request names it. With --workload json-schema each request is constrained to a JSON schema
(bench serve's json-schema dataset: xgrammar on both sides) and ends when its JSON closes.
With --workload multi-turn the client is `pdserve bench multi-turn --backend openai`
instead: chat conversations whose turns resend the history (the answers' token ids), at
each --max-concurrency (conversations open at once; each value its own conversations), so
both servers' prefix caches and schedulers meet the load of multi-turn chat; reported beside
the above are the later turns' mean TTFT and the share of prompt tokens each server found
cached. --workload multi-turn-chat sends the same conversations as text messages to
/v1/chat/completions (`--backend openai-chat`), the path a chat client takes.

    pdserve bench serve-peer --request-rate 1,2,4 --num-prompts 64 --json docs/bench/serve_peer.json
    pdserve bench serve-peer --workload multi-turn --max-concurrency 1,4 --json docs/bench/multi_turn_peer.json
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.peers.proc_cpu import cpu_and_steal
from bench.peers.vllm_peer import cpu_env, preload_choice, vllm_python
from common.engine.config import KV_CACHE_DTYPE_NAMES, parse_memory_size


LORA_NAME = "bench-lora"  # the adapter --lora-rank serves
LOG_TAIL_LINES = 25  # of a server's log, shown when it fails to come up
# A run's load: bench serve's request rate, or bench multi-turn's conversations open at once.
LOAD_KEYS = ("request_rate", "max_concurrency")
# The workloads bench multi-turn drives (token ids over completions, text over chat), and its backend for each.
MULTI_TURN_BACKENDS = {"multi-turn": "openai", "multi-turn-chat": "openai-chat"}
# Figures only the multi-turn client gives, paired like the rest.
MULTI_TURN_FIGURES = ("later_turns_mean_ttft_ms", "cached_share")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_models(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until GET /v1/models answers 200; a server that exits first fails at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} did not serve /v1/models within {timeout_s:.0f} s")


def client_argv(base_url: str, args: argparse.Namespace, json_path: Path, model: str | None = None) -> list[str]:
    """The same `pdserve bench serve` load, against either server's OpenAI API (model: the
    name every request gives; None: the served model)."""
    if args.workload == "json-schema":
        dataset = ["--dataset-name", "json-schema", "--prompt-format", "text", "--no-ignore-eos",
                   "--output-len", str(args.random_output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(args.random_input_len),
                   "--random-output-len", str(args.random_output_len),
                   "--random-range-ratio", str(args.random_range_ratio)]
    return [sys.executable, "-m", "common.cli.main", "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--tokenizer", "bundled", *dataset, "--num-prompts", str(args.num_prompts),
            "--request-rate", args.request_rate, "--seed", str(args.seed), "--temperature", str(args.temperature),
            "--disable-tqdm", "--json", str(json_path), *(["--model", model] if model else [])]


def multi_turn_argv(base_url: str, args: argparse.Namespace, json_path: Path, max_concurrency: int, seed: int,
                    model: str | None = None) -> list[str]:
    """One `pdserve bench multi-turn` run over the OpenAI API at one concurrency."""
    return [sys.executable, "-m", "common.cli.main", "bench", "multi-turn",
            "--backend", MULTI_TURN_BACKENDS[args.workload],
            "--base-url", base_url, "--tokenizer", "bundled", "--num-conversations", str(args.num_conversations),
            "--turns", str(args.turns), "--max-concurrency", str(max_concurrency),
            "--think-time", str(args.think_time), "--seed", str(seed), "--temperature", str(args.temperature),
            "--disable-tqdm", "--json", str(json_path), *(["--model", model] if model else [])]


def multi_turn_run(record: dict, max_concurrency: int) -> dict:
    """One multi-turn run's figures under serve-peer's names: bench serve's, the later turns'
    mean TTFT and the share of prompt tokens found cached (None where the server did not say)."""
    metrics, turns = record["metrics"], [t for t in record["turns"] if not t["error"]]
    later = [row for row in record["by_turn"] if row["turn"] > 1 and row["completed"]]
    num_later = sum(row["completed"] for row in later)
    num_prompt = sum(t["prompt_len"] for t in turns)
    num_cached = sum(t["num_cached_tokens"] for t in turns)
    return {"max_concurrency": max_concurrency,
            **{key: metrics[key] for key in ("output_throughput", "p99_tpot_ms", "mean_ttft_ms", "p99_ttft_ms",
                                             "failed", "completed", "duration")},
            "later_turns_mean_ttft_ms": sum(r["mean_ttft_ms"] * r["completed"] for r in later) / num_later
            if num_later else None,
            "cached_share": num_cached / num_prompt if num_cached and num_prompt else None,
            "by_turn": record["by_turn"]}


def run_client(base_url: str, args: argparse.Namespace, json_path: Path, server_pids: Sequence[int]) -> dict:
    """The client's record of one server's load, with the host's steal over it
    (`host_steal_s`: a VM's cores taken elsewhere, which slows either side alike) and the
    CPU seconds the server's processes used meanwhile (`server_cpu_s`, every thread of
    `server_pids` and their descendants: threads that spin between steps keep their vCPUs
    busy, and only a busy vCPU gathers steal). With `args.idle_seconds`, also the cores the
    server keeps busy once the load is over and nothing arrives (`idle_cpu_cores`)."""
    with cpu_and_steal(server_pids) as load:
        record = _run_client(base_url, args, json_path)
    record["server_cpu_s"], record["host_steal_s"] = load["cpu_s"], load["steal_s"]
    if args.idle_seconds > 0:
        with cpu_and_steal(server_pids) as idle:
            time.sleep(args.idle_seconds)  # the window measured: the server left alone, as between bursts
        record["idle_cpu_cores"] = idle["cpu_s"] / idle["wall_s"]
    return record


def _run_client(base_url: str, args: argparse.Namespace, json_path: Path) -> dict:
    model = LORA_NAME if args.lora_path else None
    if args.workload not in MULTI_TURN_BACKENDS:
        subprocess.run(client_argv(base_url, args, json_path, model), check=True)
        return json.loads(json_path.read_text())
    runs = []
    for index, concurrency in enumerate(args.max_concurrency):
        # Each concurrency its own conversations, as bench serve gives each rate its own
        # prompts: the last run's conversations are still in the prefix cache.
        path = json_path.with_name(f"{json_path.stem}-c{concurrency}.json")
        # It exits 1 when a turn failed; its record still counts the failures, as bench
        # serve's runs do. No record: it stopped before measuring.
        client = subprocess.run(multi_turn_argv(base_url, args, path, concurrency, args.seed + index, model))
        if not path.is_file():
            raise RuntimeError(f"bench multi-turn at {concurrency} open exited {client.returncode} without a record")
        runs.append(multi_turn_run(json.loads(path.read_text()), concurrency))
    return {"runs": runs}


def our_flags(args: argparse.Namespace, model_dir: str) -> list[str]:
    """The flags our stack's processes get (LocalStack routes each to the commands that take it)."""
    passthrough = ["--model", model_dir, "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory,
                   "--max-model-len", str(args.max_model_len), "--kv-cache-dtype", args.kv_cache_dtype,
                   "--log-level", "WARNING"]
    if args.enforce_eager:
        passthrough.append("--enforce-eager")
    if args.num_scheduler_steps != 1:
        passthrough += ["--num-scheduler-steps", str(args.num_scheduler_steps)]
    if args.max_prefill_queue_tokens:
        passthrough += ["--max-prefill-queue-tokens", str(args.max_prefill_queue_tokens)]
    if args.speculative_config:
        passthrough += ["--speculative-config", args.speculative_config]
    if args.lora_path:
        passthrough += ["--lora-modules", f"{LORA_NAME}={args.lora_path}", "--max-lora-rank", str(args.lora_rank)]
    return passthrough


def serve_ours(args: argparse.Namespace, model_dir: str, out: Path) -> dict:
    from common.cli.up import LocalStack
    (out / "pdserve-logs").mkdir()
    with LocalStack(args.prefill, args.decode, http_port=0, passthrough=our_flags(args, model_dir),
                    log_dir=out / "pdserve-logs",
                    startup_timeout_s=args.startup_timeout, reserved_cpus=args.reserved_cpus) as stack:
        server_pids = [p.process.pid for p in (*stack.gateways, *stack.instances.values())]
        return run_client(f"http://{stack.http_address}", args, out / "pdserve.json", server_pids)


def vllm_argv(args: argparse.Namespace, model_dir: str, python: Path, port: int) -> list[str]:
    """`vllm serve` with the settings our stack gets, on 127.0.0.1:port."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", Path(model_dir).name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
            "--kv-cache-dtype", args.kv_cache_dtype]
    if args.speculative_config:
        argv += ["--speculative-config", args.speculative_config]
    if args.peer_block_size:
        argv += ["--block-size", str(args.peer_block_size)]
    if args.workload in MULTI_TURN_BACKENDS:
        argv.append("--enable-prompt-tokens-details")  # usage's cached_tokens, off by default in vLLM
    if args.lora_path:
        argv += ["--enable-lora", "--lora-modules", f"{LORA_NAME}={args.lora_path}", "--max-lora-rank",
                 str(args.lora_rank), "--max-loras", "1"]
    return argv


def serve_vllm(args: argparse.Namespace, model_dir: str, out: Path, python: Path, preload: list[str]) -> dict:
    port = free_port()
    argv = vllm_argv(args, model_dir, python, port)
    kv_gib = parse_memory_size(args.kv_cache_memory) / (1 << 30)  # main checked it is a size
    with serving(argv, port, out / "vllm-serve.log", cpu_env(args.peer_threads_bind, kv_gib, preload),
                 args.startup_timeout) as (base_url, server_pid):
        return run_client(base_url, args, out / "vllm.json", [server_pid])


def parse_int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma list of integers >= 1; got {text!r}")
    return values


@contextmanager
def serving(argv: list[str], port: int, log_path: Path, env: dict[str, str], startup_timeout_s: float
            ) -> Iterator[tuple[str, int]]:
    """`vllm serve` (argv) up on 127.0.0.1:port, logging to log_path: its base URL and pid
    once it serves, and the server stopped when the block ends. A server that does not come up
    raises with the end of its log, which lives in a directory that goes with the run."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base_url = f"http://127.0.0.1:{port}"
            try:
                wait_for_models(base_url, process, startup_timeout_s)
            except (RuntimeError, TimeoutError) as e:
                log.flush()
                tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                raise type(e)(f"{e}; the end of its log:\n" + "\n".join(tail)) from None
            yield base_url, process.pid
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def load_key(run: dict) -> str:
    return next(key for key in LOAD_KEYS if key in run)


def compare(ours: dict, peer: dict) -> list[dict]:
    rows = []
    for o, v in zip(ours["runs"], peer["runs"]):
        key = load_key(o)
        row = {key: o[key],
               "pdserve_output_tokens_per_s": o["output_throughput"],
               "vllm_output_tokens_per_s": v["output_throughput"],
               "throughput_ratio": o["output_throughput"] / v["output_throughput"],
               "pdserve_p99_tpot_ms": o["p99_tpot_ms"], "vllm_p99_tpot_ms": v["p99_tpot_ms"],
               "pdserve_mean_ttft_ms": o["mean_ttft_ms"], "vllm_mean_ttft_ms": v["mean_ttft_ms"],
               "pdserve_p99_ttft_ms": o["p99_ttft_ms"], "vllm_p99_ttft_ms": v["p99_ttft_ms"],
               "pdserve_failed": o["failed"], "vllm_failed": v["failed"]}
        for figure in MULTI_TURN_FIGURES:
            if figure in o:
                row[f"pdserve_{figure}"], row[f"vllm_{figure}"] = o[figure], v.get(figure)
        rows.append(row)
    return rows


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """Each load's figures as the median of the rounds' (failed requests: their sum; a figure
    a server did not give in some round: the median of the rounds that have it), its
    throughput ratio the ratio of the medians, beside every round's own ratio."""
    rows = []
    for per_round in zip(*rounds):
        key = load_key(per_round[0])
        row = {key: per_round[0][key]}
        for figure in per_round[0]:
            if figure.endswith("_failed"):
                row[figure] = sum(r[figure] for r in per_round)
            elif figure not in (key, "throughput_ratio"):
                values = [r[figure] for r in per_round if r[figure] is not None]
                row[figure] = statistics.median(values) if values else None
        row["throughput_ratio"] = row["pdserve_output_tokens_per_s"] / row["vllm_output_tokens_per_s"]
        row["round_throughput_ratios"] = [r["throughput_ratio"] for r in per_round]
        rows.append(row)
    return rows


def format_row(row: dict, repeats: int) -> str:
    load = (f"{row['request_rate']:>6} req/s" if "request_rate" in row
            else f"{row['max_concurrency']:>3} open")
    line = (f"{load}  pdserve {row['pdserve_output_tokens_per_s']:7.1f} tok/s "
            f"p99 TPOT {row['pdserve_p99_tpot_ms']:7.1f} ms mean TTFT {row['pdserve_mean_ttft_ms']:7.1f} ms | "
            f"vLLM {row['vllm_output_tokens_per_s']:7.1f} tok/s p99 TPOT {row['vllm_p99_tpot_ms']:7.1f} ms "
            f"mean TTFT {row['vllm_mean_ttft_ms']:7.1f} ms | ratio {row['throughput_ratio']:.2f}")
    if repeats > 1:
        line += f" (rounds {' / '.join(f'{r:.2f}' for r in row['round_throughput_ratios'])})"
    if "pdserve_later_turns_mean_ttft_ms" in row:
        def fmt(value, spec):
            return "-" if value is None else format(value, spec)
        line += (f"\n{'':>11}later turns' mean TTFT {fmt(row['pdserve_later_turns_mean_ttft_ms'], '.1f')} vs "
                 f"{fmt(row['vllm_later_turns_mean_ttft_ms'], '.1f')} ms; prompt tokens cached "
                 f"{fmt(row['pdserve_cached_share'], '.3f')} vs {fmt(row['vllm_cached_share'], '.3f')}")
    return line


def format_cpu_and_steal(result: dict) -> str:
    """Each server's CPU seconds and the host's steal over its load, round by round."""
    def per_side(key: str, spec: str = ".1f") -> str:
        return " | ".join(f"{side} {' / '.join(format(v, spec) for v in result[key][side])}"
                          for side in ("pdserve", "vllm"))
    line = f"server CPU s: {per_side('server_cpu_s')}; host steal s: {per_side('host_steal_s')}"
    if "idle_cpu_cores" in result:
        line += f"; idle, cores busy: {per_side('idle_cpu_cores', '.2f')}"
    return line


def resolve_dtype(dtype: str) -> str:
    """The dtype both servers are given: `auto` is our engine's choice on this CPU (bf16 where
    it computes bf16 natively, else fp32), named, since vLLM's `auto` takes the checkpoint's
    (bf16 for the bundled model, emulated and slow on a CPU without it)."""
    if dtype != "auto":
        return dtype
    import torch

    from common.engine.device import select_dtype
    return str(select_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench serve-peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write both runs and the comparison here")
    parser.add_argument("--model", default=None, help="default: the bundled model (its converted directory)")
    parser.add_argument("--dtype", default="auto",
                        help="both servers' (auto: bf16 where the CPU computes it natively, else float32)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2GiB", help="both sides' KV pool, whole GiB")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto",
                        help="both sides' KV cache: the model's dtype, or 8-bit float codes (vLLM's flag)")
    parser.add_argument("--prefill", type=int, default=0, help="our prefill instances (0: decode prefills)")
    parser.add_argument("--decode", type=int, default=1, help="our decode instances")
    parser.add_argument("--max-prefill-queue-tokens", type=int, default=0,
                        help="with --prefill N: the gateway's limit past which decode instances prefill "
                             "(conditional disaggregation by load); 0: every prompt to the prefill pool")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--reserved-cpus", type=int, default=None,
                        help="`pdserve up --reserved-cpus` for our stack: cores left out of the engines' share "
                             "(default: up's, 1 on hosts of 8 CPUs or more, else 0)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="our instances' --num-scheduler-steps (greedy decode steps back to back)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="both servers speculate with this config (keys both take: method ngram, "
                             "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)")
    parser.add_argument("--peer-venv", default=None)
    parser.add_argument("--peer-threads-bind", default="auto")
    parser.add_argument("--peer-block-size", type=int, default=None,
                        help="vLLM's --block-size, a multiple of 32 on its CPU attention (default 128 there; "
                             "ours is 16, and a prefix cache hits in whole blocks)")
    parser.add_argument("--peer-preload", choices=["auto", "none"], default="auto",
                        help="vLLM's LD_PRELOAD: auto (its CPU guide's tcmalloc and Intel OpenMP, where found) "
                             "or none")
    parser.add_argument("--workload", choices=["random", "json-schema", *MULTI_TURN_BACKENDS], default="random",
                        help="random: bench serve's random prompts at each --request-rate; json-schema: its "
                             "JSON-schema constrained requests (up to --random-output-len tokens, ending when "
                             "the JSON closes) at each rate; multi-turn: bench multi-turn's conversations at "
                             "each --max-concurrency, token ids over /v1/completions; multi-turn-chat: the same "
                             "as text messages over /v1/chat/completions")
    parser.add_argument("--request-rate", default="1,2,4")
    parser.add_argument("--max-concurrency", type=parse_int_list, default=[1, 4],
                        help="multi-turn: conversations open at once, a comma list")
    parser.add_argument("--num-conversations", type=int, default=16, help="multi-turn: per concurrency")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="multi-turn: seconds between an answer and the next turn")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's (0: greedy); above 0 each server samples with its own sampler")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--idle-seconds", type=float, default=0.0,
                        help="after each server's load, measure the cores it keeps busy with nothing "
                             "arriving over this many seconds (0: not measured)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of both servers, the order alternating; medians reported")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="> 0: both servers serve one random PEFT adapter of this rank over all seven "
                             "linears (bench lora's), and every request names it")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    try:
        args.dtype = resolve_dtype(args.dtype)
    except ValueError as e:
        parser.error(str(e))
    if args.idle_seconds < 0:
        parser.error(f"--idle-seconds must be 0 or more; got {args.idle_seconds}")
    try:
        kv_bytes = parse_memory_size(args.kv_cache_memory)
    except ValueError as e:
        parser.error(str(e))
    if args.speculative_config:  # ours checks it the same way before anything starts
        from common.engine.config import SpeculativeConfig
        try:
            SpeculativeConfig.parse(args.speculative_config)
        except ValueError as e:
            parser.error(str(e))
    if isinstance(kv_bytes, float):
        parser.error("--kv-cache-memory must be a size here (e.g. 2GiB): vLLM's pool is set in GiB, not as a "
                     "fraction")

    from bench.profile import cpu_model_name
    from common.engine.model_files import resolve_model
    model_dir = str(resolve_model(args.model))
    peer_python = vllm_python(args.peer_venv)  # missing peer: say how to install it before our run
    preload = preload_choice(args.peer_preload, peer_python)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        args.lora_path = None
        if args.lora_rank > 0:
            from bench.lora import write_adapter
            from common.engine.config import ModelConfig
            from common.engine.model_files import load_hf_config
            cfg = ModelConfig.from_hf_config(load_hf_config(Path(model_dir)))
            args.lora_path = write_adapter(Path(tmp) / LORA_NAME, cfg, args.lora_rank, args.seed)
        for index in range(args.repeats):
            out = Path(tmp) / f"round-{index}"
            out.mkdir()
            if index % 2 == 0:
                ours = serve_ours(args, model_dir, out)
                peer = serve_vllm(args, model_dir, out, peer_python, preload)
            else:
                peer = serve_vllm(args, model_dir, out, peer_python, preload)
                ours = serve_ours(args, model_dir, out)
            rounds.append({"first": "pdserve" if index % 2 == 0 else "vllm", "comparison": compare(ours, peer),
                           "pdserve": ours, "vllm": peer})
    rows = median_rows([r["comparison"] for r in rounds])
    result = {"cpu": cpu_model_name(), "config": vars(args), "comparison": rows, "rounds": rounds,
              "vllm_preload": preload}
    # Each side's readings round by round, beside the rounds themselves.
    for key in ("host_steal_s", "server_cpu_s", *(("idle_cpu_cores",) if args.idle_seconds > 0 else ())):
        result[key] = {side: [r[side][key] for r in rounds] for side in ("pdserve", "vllm")}
    for row in rows:
        print(format_row(row, args.repeats))
    print(format_cpu_and_steal(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
