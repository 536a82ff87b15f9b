"""torch.distributed (Gloo) KV connector: the same two-process round trip as the ZeroMQ one."""
from __future__ import annotations

import pytest

from kv_transfer.torch_dist_receiver import TorchDistKVReceiver
from tests.integration.test_kv_transfer_zmq import make_pool, run_roundtrip, spawn  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_gloo_roundtrip_bitwise_many_interleaved_transfers(spawn):  # noqa: F811
    dst_kv = make_pool(None)
    rx = TorchDistKVReceiver(dst_kv, host="127.0.0.1", backend="gloo")
    try:
        assert rx.endpoint.startswith("gloo://127.0.0.1:")
        run_roundtrip(spawn, [(rx, dst_kv)], "gloo")
    finally:
        rx.close()


@pytest.mark.timing  # a deadline's expiry measured against the clock
def test_gloo_receiver_killed_sender_gives_up_and_frees(spawn):  # noqa: F811
    import time

    from kv_transfer import TransferState
    from kv_transfer.torch_dist_sender import TorchDistKVSender

    child = spawn("recv", {"connector": "gloo"})
    with TorchDistKVSender(make_pool(2)) as tx:
        child.tell({"transfers": [{"tid": "t", "dst": list(range(40)), "timeout_s": 3.0}]})
        target = child.expect("targets")["targets"][0]
        t = tx.start(list(range(40)), target)
        assert tx.send_layer(t, 0)
        child.kill()
        for layer in range(1, 4):
            tx.send_layer(t, layer)  # must not block past the deadline
        tx.finish(t)
        res = t.result(10)
        assert res.state in (TransferState.FAILED, TransferState.EXPIRED), res
        assert time.time() - target["deadline"] <= 1.0
        assert tx.pending_bytes() == 0 and tx.num_open() == 0
