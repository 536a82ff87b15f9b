"""ZeroMQ KV connector between two real processes on loopback.

The other process of each test is this file run as
`python -m tests.integration.test_kv_transfer_zmq ROLE`: it reads a JSON spec line,
prints {"event": "ready"}, reads a JSON "go" line (the targets, registered only once
the child is up so deadlines do not include its start-up), acts, and reports JSON
lines. Tests wait on reported events and on connector state, each with a deadline.
"""
from __future__ import annotations

import json
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

from kv_transfer import CurveConfig, TransferState, ZmqKVReceiver, ZmqKVSender, protocol
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 4, 96, (16, 3, 64)  # 12 KiB per block: above zmq's zero-copy floor
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def make_pool(seed: int | None, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [NUM_BLOCKS, *BLOCK_SHAPE]; the same seed gives the same bits in any process."""
    if seed is None:
        return [(torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE, dtype=dtype), torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE, dtype=dtype))
                for _ in range(NUM_LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(NUM_BLOCKS, *BLOCK_SHAPE, generator=g).to(dtype) for _ in range(2))
            for _ in range(NUM_LAYERS)]


def clone_pool(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


def apply_transfer(expected, src_kv, src_ids, dst_ids, layers=range(NUM_LAYERS)):
    for layer in layers:
        for i in (0, 1):
            expected[layer][i][list(dst_ids)] = src_kv[layer][i][list(src_ids)]


def assert_pool_equal(actual, expected):
    for layer, ((ka, va), (ke, ve)) in enumerate(zip(actual, expected)):
        assert torch.equal(ka, ke) and torch.equal(va, ve), f"pool differs in layer {layer}"


def random_transfers(rng: random.Random, sizes: list[int]) -> list[tuple[list[int], list[int]]]:
    """(src ids, dst ids) pairs: sources mix consecutive runs and scattered blocks and may overlap
    between transfers (shared prefix blocks); destinations are disjoint, as a pool allocator gives."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    out = []
    for n in sizes:
        run = rng.randrange(1, n + 1)
        start = rng.randrange(0, NUM_BLOCKS - run)
        src = list(range(start, start + run)) + rng.sample(range(NUM_BLOCKS), n - run)
        dst = sorted(free[:n]) if rng.random() < 0.5 else free[:n]  # contiguous-ish and scattered
        free = free[n:]
        out.append((src, dst))
    return out


class Child:
    def __init__(self, role: str, spec: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.test_kv_transfer_zmq", role],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.tell(spec)
        self.expect("ready", timeout_s=30)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def tell(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"child sent no {event!r} within {timeout_s}s") from None
            if msg is None:
                raise AssertionError(f"child exited (rc={self.proc.wait()}) before {event!r}")
            if msg.get("event") == event:
                return msg

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


@pytest.fixture
def spawn():
    children: list[Child] = []

    def _spawn(role: str, spec: dict) -> Child:
        children.append(Child(role, spec))
        return children[-1]

    yield _spawn
    for c in children:
        c.close()


def run_roundtrip(spawn, receivers: list, connector: str, seed: int = 3) -> None:
    """Many transfers to each receiver, layer-wise ones interleaved layer by layer on one
    socket per receiver and whole-request ones in between; every byte must land exactly."""
    src_kv = make_pool(seed)
    expected = [clone_pool(rx_kv) for _, rx_kv in receivers]
    rng = random.Random(seed)
    child = spawn("send", {"seed": seed, "senders": {"s": {"connector": connector,
                                                              "opts": {"max_message_bytes": 100_000}}}})
    transfers, handles = [], []
    for r, (rx, _) in enumerate(receivers):
        for j, (src, dst) in enumerate(random_transfers(rng, [1, 3, 7, 10, 13, 25])):
            h = rx.register(f"rx{r}-t{j}", dst, timeout_s=30)
            handles.append(h)
            transfers.append({"sender": "s", "src": src, "target": h.target.to_dict(),
                              "mode": "whole" if j % 3 == 2 else "layerwise"})
            apply_transfer(expected[r], src_kv, src, dst)
    child.tell({"transfers": transfers})
    results = child.expect("results", timeout_s=60)["results"]
    assert [r["state"] for r in results] == ["done"] * len(transfers), results
    for h in handles:
        assert h.result(10).state is TransferState.DONE
    for (rx, rx_kv), exp in zip(receivers, expected):
        assert_pool_equal(rx_kv, exp)  # also proves no block outside the reservations was touched
        assert rx.stats()["active"] == 0 and rx.stats().get("rejected", 0) == 0


def test_roundtrip_bitwise_many_interleaved_transfers_tcp_and_ipc(spawn, tmp_path):
    kv_tcp, kv_ipc = make_pool(None), make_pool(None)
    with ZmqKVReceiver(kv_tcp) as rx_tcp, ZmqKVReceiver(kv_ipc, f"ipc://{tmp_path}/kv.ipc") as rx_ipc:
        assert rx_tcp.endpoint.startswith("tcp://127.0.0.1:")
        run_roundtrip(spawn, [(rx_tcp, kv_tcp), (rx_ipc, kv_ipc)], "zmq")


# (case, reason fragment) for messages that name one of our transfers: each must fail it.
ATTRIBUTABLE = [
    ("layer_oob", "out of range"), ("dtype", "dtype"), ("shape", "block shape"), ("overflow", "overflow"),
    ("truncated", "truncated or extra bytes"), ("missing_frame", "truncated or extra frame"),
    ("extra_frame", "truncated or extra frame"), ("duplicate_layer", "duplicate layer"),
    ("seq_gap", "sequence number"), ("bad_types", "malformed header"), ("bool_int", "malformed header"),
    ("ack_op", "unexpected ack"),
]
UNATTRIBUTABLE = ["garbage_header", "array_bomb", "string_bomb", "unknown_tid", "late"]


def test_malformed_messages_rejected_pool_untouched(spawn):
    dst_kv = make_pool(7)  # non-zero contents, so any stray write would show
    snapshot = clone_pool(dst_kv)
    with ZmqKVReceiver(dst_kv) as rx:
        late = rx.register("late", [90, 91], timeout_s=0.05)
        assert late.result(5).state is TransferState.EXPIRED
        child = spawn("raw", {"seed": 11})
        handles = {case: rx.register(case, [4 * i, 4 * i + 1, 4 * i + 2], timeout_s=30)
                   for i, (case, _) in enumerate(ATTRIBUTABLE)}
        good_src, good_dst = [5, 6, 7, 30, 2], [60, 61, 62, 70, 80]
        good = rx.register("good", good_dst, timeout_s=30)
        child.tell({"cases": {c: h.target.to_dict() for c, h in handles.items()}, "late": late.target.to_dict(),
                    "unattributable": UNATTRIBUTABLE, "good": {"src": good_src, "target": good.target.to_dict()}})
        assert child.expect("results")["results"] == [{"transfer_id": "good", "state": "done", "reason": ""}]
        for case, fragment in ATTRIBUTABLE:
            res = handles[case].result(10)
            assert res.state is TransferState.FAILED and fragment in res.reason, (case, res)
        wait_for(lambda: rx.stats().get("dropped_bad_header", 0) >= 3 and rx.stats().get("dropped_unknown", 0) >= 1
                 and rx.stats().get("dropped_late", 0) >= 1, 10, f"drops counted: {rx.stats()}")
        assert good.result(10).state is TransferState.DONE
        child_kv = make_pool(11)
        expected = clone_pool(snapshot)
        apply_transfer(expected, child_kv, good_src, good_dst)
        # The first copy of the duplicated layer was valid and landed; the duplicate did not.
        apply_transfer(expected, child_kv, [0, 1, 2], handles["duplicate_layer"].target.dst_block_ids, layers=[0])
        assert_pool_equal(dst_kv, expected)
        assert rx.stats()["active"] == 0


class ToyAllocator:
    """Stands in for the decode scheduler: frees a reservation when the receiver reports failure."""

    def __init__(self) -> None:
        self.free = set(range(NUM_BLOCKS))
        self.owned: dict[str, list[int]] = {}

    def reserve(self, tid: str, n: int) -> list[int]:
        ids = sorted(self.free)[:n]
        self.free -= set(ids)
        self.owned[tid] = ids
        return ids

    def on_done(self, result) -> None:
        if not result.ok:
            self.free |= set(self.owned.pop(result.transfer_id))


@pytest.mark.timing  # a deadline's expiry measured against the clock
def test_sender_killed_mid_transfer_receiver_expires_and_frees(spawn):
    alloc = ToyAllocator()
    with ZmqKVReceiver(make_pool(None), on_done=alloc.on_done) as rx:
        child = spawn("send", {"seed": 1, "stop_after_layers": 2, "senders": {"s": {"connector": "zmq"}}})
        dst = alloc.reserve("t", 20)
        t0 = time.monotonic()
        h = rx.register("t", dst, timeout_s=2.0)
        child.tell({"transfers": [{"sender": "s", "src": list(range(20)), "target": h.target.to_dict(),
                                   "mode": "layerwise"}]})
        child.expect("paused")
        wait_for(lambda: h.state is TransferState.TRANSFERRING, 5, "first layers to land")
        child.kill()
        res = h.result(10)
        elapsed = time.monotonic() - t0
        assert res.state is TransferState.EXPIRED and 1.9 <= elapsed <= 3.0, (res, elapsed)
        assert alloc.free == set(range(NUM_BLOCKS)) and rx.stats()["active"] == 0


@pytest.mark.timing  # a deadline's expiry measured against the clock
def test_receiver_killed_sender_gives_up_at_deadline(spawn):
    child = spawn("recv", {})
    src_kv = make_pool(2)
    with ZmqKVSender(src_kv) as tx:
        child.tell({"transfers": [{"tid": "t", "dst": list(range(40)), "timeout_s": 2.0}]})
        target = child.expect("targets")["targets"][0]
        t = tx.start(list(range(40)), target)
        assert tx.send_layer(t, 0) and tx.send_layer(t, 1)
        wait_for(lambda: t.state is TransferState.TRANSFERRING, 5, "first layers handed to zmq")
        child.kill()
        for layer in (2, 3):
            tx.send_layer(t, layer)  # may queue or refuse; must not block past the deadline
        tx.finish(t)
        res = t.result(10)
        late_by = time.time() - target["deadline"]
        assert res.state in (TransferState.EXPIRED, TransferState.FAILED) and late_by <= 1.0, (res, late_by)
        assert tx.pending_bytes() == 0 and tx.num_open() == 0


def test_curve_only_key_holders_can_deliver(spawn):
    server = CurveConfig.generate()
    stranger = CurveConfig.generate()
    dst_kv = make_pool(None)
    with ZmqKVReceiver(dst_kv, curve=server) as rx:
        child = spawn("send", {"seed": 5, "senders": {
            "plain": {"connector": "zmq"},
            "stranger": {"connector": "zmq", "curve": {"public_key": stranger.public_key,
                                                       "secret_key": stranger.secret_key,
                                                       "server_public_key": server.public_key}},
            "holder": {"connector": "zmq", "curve": {"public_key": server.public_key,
                                                     "secret_key": server.secret_key}}}})
        hs = {name: rx.register(name, [3 * i, 3 * i + 1, 3 * i + 2], timeout_s=1.5 if name != "holder" else 20)
              for i, name in enumerate(["plain", "stranger", "holder"])}
        child.tell({"transfers": [{"sender": n, "src": [10, 11, 12], "target": h.target.to_dict(), "mode": "layerwise"}
                                  for n, h in hs.items()]})
        states = {r["transfer_id"]: r["state"] for r in child.expect("results")["results"]}
        assert states == {"plain": "expired", "stranger": "expired", "holder": "done"}
        assert [hs[n].result(5).state.value for n in ("plain", "stranger", "holder")] == ["expired", "expired", "done"]
        expected = make_pool(None)
        apply_transfer(expected, make_pool(5), [10, 11, 12], [6, 7, 8])
        assert_pool_equal(dst_kv, expected)
        block_bytes = 16 * 3 * 64 * 4
        assert rx.stats()["bytes_written"] == 2 * NUM_LAYERS * 3 * block_bytes  # only the key holder's bytes


# --- the child process ------------------------------------------------------------------

def _emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _make_sender(cfg: dict, kv):
    if cfg["connector"] == "gloo":
        from kv_transfer.torch_dist_sender import TorchDistKVSender
        return TorchDistKVSender(kv, **cfg.get("opts", {}))
    curve = CurveConfig(**cfg["curve"]) if cfg.get("curve") else None
    return ZmqKVSender(kv, curve=curve, **cfg.get("opts", {}))


def _child_send(spec: dict) -> None:
    kv = make_pool(spec["seed"])
    senders = {name: _make_sender(cfg, kv) for name, cfg in spec["senders"].items()}
    _emit(event="ready")
    go = json.loads(sys.stdin.readline())
    layerwise = [(senders[t["sender"]], senders[t["sender"]].start(t["src"], t["target"]))
                 for t in go["transfers"] if t["mode"] == "layerwise"]
    whole = [t for t in go["transfers"] if t["mode"] == "whole"]
    handles = [h for _, h in layerwise]
    for layer in range(NUM_LAYERS):
        for tx, h in layerwise:  # interleave: layer l of every transfer before layer l + 1
            tx.send_layer(h, layer)
        if layer == 1:
            handles += [senders[t["sender"]].send_all(t["src"], t["target"]) for t in whole]
        if spec.get("stop_after_layers") == layer + 1:
            _emit(event="paused")
            sys.stdin.readline()  # until killed
    for tx, h in layerwise:
        tx.finish(h)
    results = [h.result(60) for h in handles]
    _emit(event="results", results=[{"transfer_id": r.transfer_id, "state": r.state.value, "reason": r.reason}
                                    for r in results])
    for tx in senders.values():
        tx.close()


def _child_recv(spec: dict) -> None:
    if spec.get("connector") == "gloo":
        from kv_transfer.torch_dist_receiver import TorchDistKVReceiver
        rx = TorchDistKVReceiver(make_pool(None))
    else:
        rx = ZmqKVReceiver(make_pool(None))
    with rx:
        _emit(event="ready")
        go = json.loads(sys.stdin.readline())
        hs = [rx.register(t["tid"], t["dst"], t["timeout_s"]) for t in go["transfers"]]
        _emit(event="targets", targets=[h.target.to_dict() for h in hs])
        sys.stdin.readline()


def _raw_messages(case: str, target: dict, kv) -> list[list[bytes]]:
    """The multipart messages (header, frames...) a misbehaving sender sends for one case."""
    tid, n = target["transfer_id"], len(target["dst_block_ids"])

    def frames(count=n, layer=0, src=0, dtype=torch.float32, shape=BLOCK_SHAPE):
        k, v = kv[layer]
        blocks = [x[src:src + count].to(dtype) if shape == BLOCK_SHAPE else torch.zeros(count, *shape, dtype=dtype)
                  for x in (k, v)]
        return [b.numpy().tobytes() for b in blocks]  # a test peer may copy; the connector does not

    def kv_msg(seq=0, layer=0, first=0, nblk=n, dtype="float32", shape=BLOCK_SHAPE, data=None):
        return [protocol.encode_kv(tid, seq, layer, first, nblk, dtype, shape, [nblk])] + (data or frames())

    def raw_header(**changes):
        d = {"v": protocol.VERSION, "op": "kv", "tid": tid, "seq": 0, "layer": 0, "nlay": 1, "first": 0, "nblk": n,
             "h0": 0, "nh": BLOCK_SHAPE[1], "dtype": "float32", "shape": list(BLOCK_SHAPE), "splits": [n]} | changes
        return [msgpack.packb(d)] + frames()

    good_frames = frames()
    return {
        "garbage_header": [[b"\xc1 this is not msgpack", b"x" * 64]],
        "array_bomb": [raw_header(splits=[1] * 5000)],
        "string_bomb": [raw_header(dtype="f" * 10_000)],
        "unknown_tid": [[protocol.encode_kv("no-such-transfer", 0, 0, 0, n, "float32", BLOCK_SHAPE, [n])]
                        + good_frames],
        "late": [kv_msg()],
        "layer_oob": [kv_msg(layer=NUM_LAYERS)],
        "dtype": [kv_msg(dtype="float16", data=frames(dtype=torch.float16))],
        "shape": [kv_msg(shape=(16, 3, 32), data=frames(shape=(16, 3, 32)))],
        "overflow": [kv_msg(nblk=n + 1, data=frames(count=n + 1))],
        "truncated": [kv_msg(data=[good_frames[0], good_frames[1][:-4]])],
        "missing_frame": [kv_msg(data=[good_frames[0]])],
        "extra_frame": [kv_msg(data=good_frames + [good_frames[0]])],
        "duplicate_layer": [kv_msg(), kv_msg(seq=1, data=frames(src=40))],
        "seq_gap": [kv_msg(seq=1)],
        "bad_types": [raw_header(layer="0")],
        "bool_int": [raw_header(layer=True)],
        "ack_op": [[protocol.encode_ack(tid, "done", "")]],
    }[case]


def _child_raw(spec: dict) -> None:
    import zmq
    kv = make_pool(spec["seed"])
    _emit(event="ready")
    go = json.loads(sys.stdin.readline())
    endpoint = go["good"]["target"]["endpoint"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    for case in go["unattributable"]:
        target = go["late"] if case == "late" else dict(go["good"]["target"], transfer_id="x")
        for msg in _raw_messages(case, target, kv):
            sock.send_multipart(msg)
    for case, target in go["cases"].items():
        for msg in _raw_messages(case, target, kv):
            sock.send_multipart(msg)
    with ZmqKVSender(kv) as tx:  # then a well-behaved transfer from the same process
        r = tx.send_all(go["good"]["src"], go["good"]["target"]).result(30)
    _emit(event="results", results=[{"transfer_id": r.transfer_id, "state": r.state.value, "reason": r.reason}])
    sys.stdin.readline()
    sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    role = sys.argv[1]
    {"send": _child_send, "recv": _child_recv, "raw": _child_raw}[role](json.loads(sys.stdin.readline()))
