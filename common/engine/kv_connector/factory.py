"""Both halves of the connector a KVTransferConfig asks for (None for role "none")."""
from __future__ import annotations

from common.engine.config import KVTransferConfig
from common.engine.kv_connector.base import KVConnectorScheduler, KVConnectorWorker


def make_scheduler_connector(config: KVTransferConfig, block_size: int) -> KVConnectorScheduler | None:
    if config.role == "none":
        return None
    from common.engine.kv_connector.transfer_scheduler import TransferConnectorScheduler
    return TransferConnectorScheduler(config.role, block_size)


def make_worker_connector(config: KVTransferConfig) -> KVConnectorWorker | None:
    if config.role == "none":
        return None
    from common.engine.kv_connector.transfer_worker import TransferConnectorWorker  # imports the transports
    return TransferConnectorWorker(config)
