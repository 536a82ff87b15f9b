"""`pdserve bench transfer`: KV transfer throughput and latency between two processes.

This process is prefill (sender); a child `python -m bench.transfer --role receiver`
is decode. For the bundled model's KV geometry (SmolLM2-135M, fp32: 30 layers x K,V x
3 heads x 64 dims = 46,080 bytes per token) and each request size and transport it
alternates, rep by rep, three ways of moving the same bytes:

  connector     ZmqKVSender -> ZmqKVReceiver (headers, validation, acks, byte cap)
  pyzmq         the ceiling: per layer one message of two zero-copy frames (K, V), no
                header, no validation; the receiver copies them into its pool with the
                same memcpy (the one copy every transfer into a pool needs), then replies
                once at the end
  pyzmq-nocopy  the same without the copy into the pool (receive and drop): context only

Each is timed in this process from the first send to the receiver's final reply.
Layer-wise pipelining is measured by simulating a prefill that spends a fixed time per
layer before `send_layer`: the tail (last layer computed -> decode holds all KV, both
on CLOCK_MONOTONIC, shared by the two processes) is compared with the time to send
one layer. Control messages between the processes are msgpack over a zmq PAIR socket.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from kv_transfer.base import pool_bytes
from kv_transfer.zmq_receiver import ZmqKVReceiver
from kv_transfer.zmq_sender import ZmqKVSender

NUM_LAYERS, BLOCK_SHAPE, BLOCK_SIZE = 30, (16, 3, 64), 16  # SmolLM2-135M: block_size 16, 3 kv heads, head_dim 64
BYTES_PER_TOKEN = 2 * NUM_LAYERS * 3 * 64 * 4  # 46,080
TIMEOUT_S = 120.0


def make_pool(num_blocks: int, fill: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, 16, 3, 64] fp32; pages touched up front, as in a live pool."""
    def one():
        return torch.empty(num_blocks, *BLOCK_SHAPE).uniform_() if fill else torch.zeros(num_blocks, *BLOCK_SHAPE)
    return [(one(), one()) for _ in range(NUM_LAYERS)]


# --- receiver process -----------------------------------------------------------------

def receiver_main(control: str, max_blocks: int, workdir: str) -> None:
    kv = make_pool(max_blocks, fill=False)
    kv_bytes = pool_bytes(kv)  # per layer (K, V) flat uint8 numpy views
    done_at: dict[str, float] = {}

    def on_done(result) -> None:  # runs on the receiver's I/O thread right after the last write
        done_at[result.transfer_id] = time.monotonic()

    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.rcvtimeo = int(TIMEOUT_S * 1000)  # an orphan (parent gone) exits instead of waiting forever
    ctl.connect(control)

    def endpoint(transport: str, name: str) -> str:
        return "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{workdir}/{name}.ipc"

    receivers, raws = {}, {}
    for transport in ("tcp", "ipc"):
        # (all layers, first layer only): the latter times one layer sent alone
        receivers[transport] = (ZmqKVReceiver(kv, endpoint(transport, "kv"), on_done=on_done),
                                ZmqKVReceiver(kv[:1], endpoint(transport, "kv1"), on_done=on_done))
        raws[transport] = ctx.socket(zmq.ROUTER)
        raws[transport].rcvtimeo = int(TIMEOUT_S * 1000)
        raws[transport].bind(endpoint(transport, "raw"))
    ctl.send(msgpack.packb({t: {"connector": r[0].endpoint, "one_layer": r[1].endpoint,
                                "raw": raws[t].getsockopt_string(zmq.LAST_ENDPOINT)} for t, r in receivers.items()}))
    handles = {}
    try:
        serve(ctl, receivers, raws, kv_bytes, done_at, handles)
    except zmq.Again:
        print("kv bench receiver: no word from the sender for 120 s, exiting", file=sys.stderr)
    for pair in receivers.values():
        for rx in pair:
            rx.close()
    ctx.destroy(linger=0)


def serve(ctl, receivers, raws, kv_bytes, done_at, handles) -> None:
    while True:
        cmd = msgpack.unpackb(ctl.recv(), max_str_len=1 << 16, max_bin_len=0, max_array_len=1 << 16, max_map_len=64)
        if cmd["op"] == "register":
            rx = receivers[cmd["transport"]][1 if cmd["one_layer"] else 0]
            handles[cmd["tid"]] = rx.register(cmd["tid"], list(range(cmd["num_blocks"])), TIMEOUT_S)
            ctl.send(msgpack.packb(handles[cmd["tid"]].target.to_dict()))
        elif cmd["op"] == "wait":
            res = handles.pop(cmd["tid"]).result(TIMEOUT_S)
            ctl.send(msgpack.packb({"state": res.state.value, "reason": res.reason, "t_done": done_at.pop(cmd["tid"])}))
        elif cmd["op"] == "raw":
            raw = raws[cmd["transport"]]
            ctl.send(b"ready")
            for layer in range(NUM_LAYERS):
                ident, k, v = raw.recv_multipart(copy=False)
                if cmd["copy"]:  # the same single memcpy into the pool as the connector
                    np.copyto(kv_bytes[layer][0][:len(k)], np.frombuffer(k.buffer, dtype=np.uint8))
                    np.copyto(kv_bytes[layer][1][:len(v)], np.frombuffer(v.buffer, dtype=np.uint8))
            raw.send_multipart([ident.bytes, b"done"])
        elif cmd["op"] == "quit":
            return


# --- sender (this) process ------------------------------------------------------------

class Bench:
    def __init__(self, max_blocks: int, workdir: str) -> None:
        self.kv = make_pool(max_blocks, fill=True)
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.PAIR)
        self.ctl.rcvtimeo = int(TIMEOUT_S * 1000)  # a dead child fails the run instead of hanging it
        control = f"ipc://{workdir}/control.ipc"
        self.ctl.bind(control)
        self.child = subprocess.Popen([sys.executable, "-m", "bench.transfer", "--role", "receiver",
                                       "--control", control, "--max-blocks", str(max_blocks), "--workdir", workdir])
        self.endpoints = msgpack.unpackb(self.ctl.recv())
        self.tx = ZmqKVSender(self.kv)
        self.tx1 = ZmqKVSender(self.kv[:1])
        self.raw = {}
        for transport, eps in self.endpoints.items():
            self.raw[transport] = self.ctx.socket(zmq.DEALER)
            self.raw[transport].connect(eps["raw"])
        self.seq = 0

    def call(self, **cmd: Any) -> Any:
        self.ctl.send(msgpack.packb(cmd))
        reply = self.ctl.recv()
        return reply if reply == b"ready" else msgpack.unpackb(reply)

    def register(self, transport: str, num_blocks: int, one_layer: bool = False) -> dict:
        self.seq += 1
        return self.call(op="register", transport=transport, num_blocks=num_blocks, one_layer=one_layer,
                         tid=f"bench-{self.seq}")

    def connector(self, transport: str, num_blocks: int) -> float:
        target = self.register(transport, num_blocks)
        t0 = time.perf_counter()
        h = self.tx.send_all(list(range(num_blocks)), target)
        res = h.result(TIMEOUT_S)
        dt = time.perf_counter() - t0
        assert res.ok and self.call(op="wait", tid=target["transfer_id"])["state"] == "done", res
        return dt

    def pyzmq(self, transport: str, num_blocks: int, copy: bool) -> float:
        self.call(op="raw", transport=transport, num_blocks=num_blocks, copy=copy)
        sock = self.raw[transport]
        t0 = time.perf_counter()
        for k, v in self.kv:
            sock.send_multipart([k[:num_blocks].numpy(), v[:num_blocks].numpy()], copy=False)
        sock.recv()
        return time.perf_counter() - t0

    def layerwise(self, transport: str, num_blocks: int, compute_s: float) -> float:
        """Tail: last layer computed -> receiver holds everything (both CLOCK_MONOTONIC)."""
        target = self.register(transport, num_blocks)
        h = self.tx.start(list(range(num_blocks)), target)
        for layer in range(NUM_LAYERS):
            time.sleep(compute_s)  # this layer's forward; the link works meanwhile
            t_last = time.monotonic()
            self.tx.send_layer(h, layer)
        self.tx.finish(h)
        reply = self.call(op="wait", tid=target["transfer_id"])
        assert reply["state"] == "done" and h.result(TIMEOUT_S).ok, reply
        return reply["t_done"] - t_last

    def one_layer(self, transport: str, num_blocks: int) -> float:
        """Latency of sending one layer alone: send_layer -> receiver holds it."""
        target = self.register(transport, num_blocks, one_layer=True)
        h = self.tx1.start(list(range(num_blocks)), target)
        t0 = time.monotonic()
        self.tx1.send_layer(h, 0)
        self.tx1.finish(h)
        reply = self.call(op="wait", tid=target["transfer_id"])
        assert reply["state"] == "done" and h.result(TIMEOUT_S).ok, reply
        return reply["t_done"] - t0

    def close(self) -> None:
        try:
            self.ctl.send(msgpack.packb({"op": "quit"}))
            self.child.wait(30)
        finally:
            if self.child.poll() is None:
                self.child.kill()
            self.tx.close()
            self.tx1.close()
            self.ctx.destroy(linger=0)


def summarize(times: list[float], nbytes: int) -> dict[str, Any]:
    gbps = [nbytes / t / 1e9 for t in times]
    return {"median_gbps": round(statistics.median(gbps), 3), "best_gbps": round(max(gbps), 3),
            "runs_gbps": [round(g, 3) for g in gbps]}


def paired(num: list[float], den: list[float]) -> float:
    """Median of per-rep ratios. Runs of a rep are adjacent in time, so pairing them cancels
    the slow swings of background load that make a ratio of two medians drift."""
    return round(statistics.median(a / b for a, b in zip(num, den)), 3)


def throughput(b: Bench, transport: str, n_tok: int, reps: int) -> tuple[dict[str, Any], list[float]]:
    n, nbytes = n_tok // BLOCK_SIZE, n_tok * BYTES_PER_TOKEN
    b.connector(transport, n), b.pyzmq(transport, n, True)  # warm-up: connections, page faults
    runs: dict[str, list[float]] = {"connector": [], "pyzmq": [], "pyzmq_nocopy": []}
    for _ in range(reps):  # alternate, so load from other processes hits all three alike
        runs["connector"].append(b.connector(transport, n))
        runs["pyzmq"].append(b.pyzmq(transport, n, True))
        runs["pyzmq_nocopy"].append(b.pyzmq(transport, n, False))
    row = {"transport": transport, "tokens": n_tok, "bytes": nbytes}
    row |= {k: summarize(v, nbytes) for k, v in runs.items()}
    row["ratio_paired_median"] = paired(runs["pyzmq"], runs["connector"])  # connector GB/s over pyzmq GB/s
    row["ratio_of_medians"] = round(row["connector"]["median_gbps"] / row["pyzmq"]["median_gbps"], 3)
    row["ratio_of_bests"] = round(row["connector"]["best_gbps"] / row["pyzmq"]["best_gbps"], 3)
    row["ratio_vs_nocopy_paired_median"] = paired(runs["pyzmq_nocopy"], runs["connector"])
    return row, runs["connector"]


def layerwise(b: Bench, transport: str, n_tok: int, reps: int, whole_s: list[float]) -> dict[str, Any]:
    """Prefill spends 1.5x the link's per-layer time on each layer, so the link keeps up and
    only the last layer should remain once compute ends."""
    n, layer_s = n_tok // BLOCK_SIZE, statistics.median(whole_s) / NUM_LAYERS
    alone, tails = [], []
    for _ in range(reps):  # interleaved, like the throughput runs
        alone.append(b.one_layer(transport, n))
        tails.append(b.layerwise(transport, n, 1.5 * layer_s))
    lw = {"transport": transport, "tokens": n_tok, "compute_per_layer_ms": round(1.5e3 * layer_s, 2),
          "whole_transfer_ms_median": round(1e3 * statistics.median(whole_s), 2),
          "tail_ms_median": round(1e3 * statistics.median(tails), 2), "tail_ms_best": round(1e3 * min(tails), 2),
          "tail_ms_runs": [round(1e3 * t, 2) for t in tails],
          "one_layer_alone_ms_median": round(1e3 * statistics.median(alone), 2),
          "one_layer_alone_ms_best": round(1e3 * min(alone), 2),
          "one_layer_amortized_ms": round(1e3 * layer_s, 2),
          "tail_over_one_layer_paired_median": paired(tails, alone)}
    lw["tail_le_one_layer"] = lw["tail_over_one_layer_paired_median"] <= 1.0
    return lw


def run(tokens: list[int], transports: list[str], reps: int, workdir: str) -> dict[str, Any]:
    b = Bench(max(tokens) // BLOCK_SIZE, workdir)
    out: dict[str, Any] = {"throughput": [], "layerwise": [], "single_block": []}
    try:
        for transport in transports:
            for n_tok in tokens:
                row, whole_s = throughput(b, transport, n_tok, reps)
                out["throughput"].append(row)
                print(json.dumps(row), flush=True)
                out["layerwise"].append(layerwise(b, transport, n_tok, reps, whole_s))
                print(json.dumps(out["layerwise"][-1]), flush=True)
            block: dict[str, list[float]] = {"connector": [], "pyzmq": []}
            for _ in range(max(10, reps * 2)):
                block["connector"].append(b.connector(transport, 1))
                block["pyzmq"].append(b.pyzmq(transport, 1, True))
            sb = {"transport": transport, "bytes": BLOCK_SIZE * BYTES_PER_TOKEN} | {
                f"{k}_ms_median": round(1e3 * statistics.median(v), 3) for k, v in block.items()}
            out["single_block"].append(sb)
            print(json.dumps(sb), flush=True)
    finally:
        b.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--tokens", default="1024,4096,16384", help="request sizes in tokens (multiples of 16)")
    p.add_argument("--transports", default="tcp,ipc")
    p.add_argument("--reps", type=int, default=11, help="timed runs per variant, interleaved")
    p.add_argument("--role", choices=["receiver"], help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    p.add_argument("--max-blocks", type=int, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "receiver":
        receiver_main(args.control, args.max_blocks, args.workdir)
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    if any(t <= 0 or t % BLOCK_SIZE for t in tokens):
        p.error("--tokens must be positive multiples of 16")
    started, load_before = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pdserve-kvbench-") as workdir:
        results = run(tokens, args.transports.split(","), args.reps, workdir)
    big = [r for r in results["throughput"] if r["tokens"] >= 4096]
    lws = results["layerwise"]
    results |= {
        "command": "python -m bench.transfer " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {"name": "SmolLM2-135M", "num_layers": NUM_LAYERS, "block_shape": list(BLOCK_SHAPE),
                  "dtype": "float32", "bytes_per_token": BYTES_PER_TOKEN},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "reps": args.reps, "wall_s": round(time.time() - started, 1),
        "targets": {  # judged on the paired medians; see docs/kv_transfer_bench.md
            "throughput_ge_90pct_of_pyzmq_4k_16k": bool(big) and all(r["ratio_paired_median"] >= 0.9 for r in big),
            "layerwise_tail_le_one_layer": bool(lws) and all(r["tail_le_one_layer"] for r in lws),
        },
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
