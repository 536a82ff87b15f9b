"""Both halves of the connector a KVTransferConfig asks for (None for role "none")."""
from __future__ import annotations

from common.engine.config import KVTransferConfig
from common.engine.kv_connector.base import KVConnectorScheduler, KVConnectorWorker


def make_scheduler_connector(config: KVTransferConfig, block_size: int) -> KVConnectorScheduler | None:
    if config.role == "none":
        return None
    from common.engine.kv_connector.transfer_scheduler import TransferConnectorScheduler
    return TransferConnectorScheduler(config.role, block_size)


def make_worker_connector(config: KVTransferConfig, tp_rank: int = 0, tp_size: int = 1,
                          num_kv_heads: int = 0) -> KVConnectorWorker | None:
    """tp_rank/tp_size/num_kv_heads: which share of the model's KV heads this rank's pool holds."""
    if config.role == "none":
        return None
    # Imports the transports.
    from common.engine.kv_connector.transfer_worker import TPShard, TransferConnectorWorker
    return TransferConnectorWorker(config, TPShard(tp_rank, tp_size, num_kv_heads))
