"""The KV connector interface, in the shape of vLLM's KVConnectorBase_V1.

Scheduler half (engine process, next to the Scheduler; plain Python, no torch):
  get_num_new_matched_tokens  how many of a request's tokens come from outside
  update_state_after_alloc    the scheduler gave a request blocks
  build_connector_meta        this step's work for the worker half (plain data)
  request_finished            a finished request's blocks must outlive its transfer?
  request_aborted             stop a request's open transfer
  update_connector_output     the worker half reported transfers that ended

Worker half (next to the model runner, made by it from config, so it can live in a
worker process):
  register_kv_caches, start_load_kv(metadata), wait_for_layer_load(layer_idx),
  save_kv_layer(layer_idx), wait_for_save(), abort_saves(reason), get_finished().
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from common.engine.kv_connector.metadata import KVConnectorMetadata, KVTransferOutcome

if TYPE_CHECKING:
    from common.engine.outputs import SchedulerOutput
    from common.engine.request import Request


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens past num_computed_tokens whose KV this request will get from outside."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The scheduler allocated block_ids (every block of the request, in order; past
        the prompt's may come blocks taken ahead for its output); the last
        num_external_tokens of the prompt are to be loaded from outside."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's connector work; resets what it hands over."""

    @abstractmethod
    def request_finished(self, request: "Request") -> bool:
        """The request finished (or was aborted): True when its blocks must be held until
        its transfer is reported in update_connector_output."""

    @abstractmethod
    def request_aborted(self, req_id: str, reason: str) -> None:
        """Stop req_id's open transfer (it still ends through update_connector_output)."""

    @abstractmethod
    def update_connector_output(self, outcomes: list[KVTransferOutcome]) -> None:
        """The worker half reported these transfers as ended."""

    @abstractmethod
    def has_open_transfers(self) -> bool:
        """True while some transfer has not been reported ended, or some work is not yet
        handed to the worker half: the engine must keep stepping to hear about it."""

    def stats(self) -> dict[str, int]:
        return {}


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, kv_caches: list) -> None:
        """The pool: per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: apply this step's metadata (start receives and sends,
        abort transfers)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer_idx's incoming KV of this step is in the pool."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int) -> None:
        """layer_idx's KV of this step is in the pool: it may be sent."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward pass: every layer has been handed to the transport."""

    @abstractmethod
    def abort_saves(self, reason: str) -> None:
        """The forward pass failed: this step's sends must not finish."""

    @abstractmethod
    def get_finished(self) -> list[KVTransferOutcome]:
        """Transfers that ended since the last call; their blocks are no longer touched."""

    @property
    @abstractmethod
    def needs_layer_hook(self) -> bool:
        """This step has per-layer work (layer-wise saves or loads)."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """Plain data the services need: the pool's geometry, the receiving endpoint."""

    def close(self) -> None:
        pass
