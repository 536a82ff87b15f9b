"""KV-block transfer between a prefill pool (sender) and a decode pool (receiver).

    decode:  rx = ZmqKVReceiver(kv_caches, "tcp://127.0.0.1:*", on_done=cb)
             h = rx.register(request_id, dst_block_ids, timeout_s=30)   # h.target.to_dict() -> prefill
             result = await h                                          # or cb(result) on rx's thread
    prefill: tx = ZmqKVSender(kv_caches)
             t = tx.start(src_block_ids, target_dict)            # heads=HeadRange(...): a head slice
             per layer, right after its forward: tx.send_layer(t, layer)
             tx.finish(t); then t.result() / await t -> free the source blocks

The torch.distributed connector (TorchDistKVReceiver / TorchDistKVSender, Gloo or NCCL)
has the same interface. base.py holds the interface and states, protocol.py the wire
format and its validation.
"""
from kv_transfer import protocol
from kv_transfer.base import (
    HeadRange,
    KVReceiver,
    KVSender,
    KVTarget,
    PoolGeometry,
    RecvTransfer,
    SendTransfer,
    TransferHandle,
    TransferResult,
    TransferState,
)
from kv_transfer.torch_dist_receiver import TorchDistKVReceiver
from kv_transfer.torch_dist_sender import TorchDistKVSender
from kv_transfer.zmq_common import CurveConfig
from kv_transfer.zmq_receiver import ZmqKVReceiver
from kv_transfer.zmq_sender import ZmqKVSender

__all__ = [
    "CurveConfig", "HeadRange", "KVReceiver", "KVSender", "KVTarget", "PoolGeometry", "RecvTransfer", "SendTransfer",
    "TorchDistKVReceiver", "TorchDistKVSender", "TransferHandle", "TransferResult", "TransferState",
    "ZmqKVReceiver", "ZmqKVSender", "protocol",
]
