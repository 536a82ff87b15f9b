"""The gateway's view of live engine instances, fed by Register/Heartbeat/Deregister.

An instance is placeable from the moment it registers (that is how `--scale` adds
capacity) until it deregisters or misses heartbeats for `heartbeat_timeout_s`.
Each heartbeat replaces the instance's load estimate (gateway.routing.load_estimate);
what the gateway dispatches and sees finish in between is charged and released
through gateway.routing.load_ledger.

Who may register: the gateway serves RegistryService on an internal port only
(gateway.server), every call there must carry the deployment's registry token when one
is set (RegistryServicer), and a registration must agree with the gateway's own model
(name, block size, a max_model_len no larger than its own). Each registration gets a
secret (Instance.secret) that its Heartbeat and Deregister calls must present, so that
one instance cannot speak for another's id; registering a live id again is allowed only
at the same address (a restart at that address).

Plain Python and single-threaded (call it from the gateway's event loop; `snapshot` alone
is safe from another thread); the clock is injectable so tests and the placement
simulation control time.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.service.errors import ServiceError
from common.service.registration import ROLES, InstanceLoad, InstanceSpec, Role, ServedLoRAs
from gateway.routing.load_estimate import LoadEstimate
from protos.pdserve.v1 import registry_pb2, registry_pb2_grpc

logger = logging.getLogger(__name__)

# A heartbeat this many intervals after the previous one is logged: the tail of these gaps
# (also pdserve_heartbeat_gap_seconds) is what --heartbeat-timeout must stay above.
LATE_HEARTBEAT_FACTOR = 1.5


class RegistrationError(ServiceError):
    """The instance cannot join this deployment (bad role, other model or block size)."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


def wrong_instance_secret(instance_id: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                        f"instance {instance_id!r} was registered by another caller: present the "
                        f"instance_secret its Register call returned")


@dataclass
class Instance:
    spec: InstanceSpec
    registered_at: float
    last_heartbeat: float
    estimate: LoadEstimate
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    last_heartbeat_gap_s: float | None = None  # between the two latest heartbeats; None before the first

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def load(self) -> InstanceLoad:
        """As last reported."""
        return self.estimate.reported

    # Effective load, what placement reads: see LoadEstimate.
    @property
    def num_requests(self) -> int:
        return self.estimate.num_requests

    @property
    def queued_prefill_tokens(self) -> int:
        return self.estimate.queued_prefill_tokens

    @property
    def free_blocks(self) -> int:
        return self.estimate.free_blocks


Listener = Callable[[Instance, str], None]  # (instance, reason)


@dataclass
class InstanceRegistry:
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0  # a few missed heartbeats, not one slow one
    clock: Callable[[], float] = time.monotonic
    block_size: int | None = None  # None: take the first instance's
    model_name: str | None = None  # None: take the first instance's
    max_model_len: int | None = None  # the most an instance may claim; None: no cap
    _instances: dict[str, Instance] = field(default_factory=dict)
    _on_added: list[Listener] = field(default_factory=list)
    _on_removed: list[Listener] = field(default_factory=list)
    _on_heartbeat: list[Listener] = field(default_factory=list)

    def subscribe(self, on_added: Listener | None = None, on_removed: Listener | None = None,
                  on_heartbeat: Listener | None = None) -> None:
        """Be told when instances join (reason "registered"), leave ("deregistered",
        "expired", "unresponsive" when a probe failed, or "replaced" when the same id
        registers again after a restart)
        or report load ("heartbeat")."""
        for listeners, listener in ((self._on_added, on_added), (self._on_removed, on_removed),
                                    (self._on_heartbeat, on_heartbeat)):
            if listener:
                listeners.append(listener)

    def register(self, spec: InstanceSpec) -> Instance:
        """Add an instance, or replace the one of its id at the same address (a restart)."""
        if not spec.instance_id or spec.role not in ROLES or not spec.grpc_address:
            raise RegistrationError(f"need an instance id, a role in {ROLES} and a gRPC address: {spec}")
        if spec.block_size <= 0:
            raise RegistrationError(f"{spec.instance_id}: block_size must be > 0")
        # Prefix hashes are per block size and model, so every instance must agree.
        for name, expected in (("block_size", self.block_size), ("model_name", self.model_name)):
            if expected is not None and getattr(spec, name) != expected:
                raise RegistrationError(f"{spec.instance_id}: {name} {getattr(spec, name)!r} "
                                        f"differs from the deployment's {expected!r}")
        # A larger limit than the gateway's would let requests through that its tokenizer's
        # model cannot hold; a smaller one is fine (the gateway caps requests to the smallest).
        if self.max_model_len is not None and spec.max_model_len > self.max_model_len:
            raise RegistrationError(f"{spec.instance_id}: max_model_len {spec.max_model_len} exceeds the "
                                    f"gateway's {self.max_model_len}")
        previous = self._instances.get(spec.instance_id)
        if previous is not None and previous.spec.grpc_address != spec.grpc_address:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"instance id {spec.instance_id!r} is registered at {previous.spec.grpc_address}; "
                               f"pick another id, or wait until that instance expires")
        self.block_size = spec.block_size
        self.model_name = spec.model_name
        if previous is not None:
            self._remove(spec.instance_id, "replaced")
        now = self.clock()
        full_pool = InstanceLoad(num_free_blocks=spec.num_total_blocks, num_total_blocks=spec.num_total_blocks)
        instance = Instance(spec, registered_at=now, last_heartbeat=now, estimate=LoadEstimate(full_pool))
        self._instances[spec.instance_id] = instance
        logger.info("registered %s %s at %s", spec.role, spec.instance_id, spec.grpc_address)
        self._notify(self._on_added, instance, "registered")
        return instance

    def heartbeat(self, instance_id: str, load: InstanceLoad, loras: ServedLoRAs | None = None) -> bool:
        """Record liveness, load and the LoRA adapters served (`update_loras`); False when the
        id is unknown (must re-register)."""
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        if loras is not None:
            self.update_loras(instance_id, loras)
        now = self.clock()
        instance.last_heartbeat_gap_s = now - instance.last_heartbeat
        instance.last_heartbeat = now
        if instance.last_heartbeat_gap_s > LATE_HEARTBEAT_FACTOR * self.heartbeat_interval_s:
            logger.warning("late heartbeat from %s %s: %.2fs since the previous one (interval %.2fs, "
                           "timeout %.2fs)", instance.role, instance_id, instance.last_heartbeat_gap_s,
                           self.heartbeat_interval_s, self.heartbeat_timeout_s)
        instance.estimate.replace_report(load)
        self._notify(self._on_heartbeat, instance, "heartbeat")
        return True

    def update_loras(self, instance_id: str, loras: ServedLoRAs) -> None:
        """The LoRA adapters an instance serves, from a heartbeat or a load's answer: kept
        only when newer than what the registry holds (a heartbeat sent before a load may
        arrive after the load's answer)."""
        instance = self._instances.get(instance_id)
        if instance is not None and loras.version > instance.spec.lora_names_version:
            instance.spec = instance.spec.with_loras(loras)

    def deregister(self, instance_id: str) -> bool:
        return self._remove(instance_id, "deregistered") is not None

    def drop_unresponsive(self, instance_id: str) -> bool:
        """The gateway found the instance dead (a failed probe): like expiry, not a clean leave."""
        return self._remove(instance_id, "unresponsive") is not None

    def check_secret(self, instance_id: str, secret: str) -> None:
        """Raise PERMISSION_DENIED unless `secret` is the registration's (unknown ids pass:
        there is nothing to protect, and a heartbeat for one asks to re-register)."""
        instance = self._instances.get(instance_id)
        if instance is not None and not hmac.compare_digest(instance.secret, secret):
            raise wrong_instance_secret(instance_id)

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def snapshot(self) -> list[Instance]:
        """Every registered instance, taken in one step: the one call that is safe from
        another thread (the metrics scrape), since list() of a dict view copies it without
        yielding to the event loop's thread mid-way."""
        return list(self._instances.values())

    def instances(self, role: Role) -> list[Instance]:
        """Live instances of a role, by id; ones past the timeout are left out even
        before `expire` drops them."""
        deadline = self.clock() - self.heartbeat_timeout_s
        return sorted((i for i in self._instances.values() if i.role == role and i.last_heartbeat >= deadline),
                      key=lambda i: i.instance_id)

    def live_instances(self) -> list[Instance]:
        """Live instances of every role, role by role."""
        return [i for role in ROLES for i in self.instances(role)]

    def lora_names(self) -> list[str]:
        """The LoRA adapters some live instance serves, sorted: the model names beside the base."""
        return sorted({name for i in self.live_instances() for name in i.spec.lora_names})

    def expire(self) -> list[Instance]:
        """Drop instances that missed heartbeats past the timeout; return them."""
        deadline = self.clock() - self.heartbeat_timeout_s
        dead = [i.instance_id for i in self._instances.values() if i.last_heartbeat < deadline]
        return [self._remove(instance_id, "expired") for instance_id in dead]

    async def run_expiry(self, interval_s: float | None = None) -> None:
        """Call `expire` forever (run as a task; cancel to stop)."""
        while True:
            await asyncio.sleep(interval_s or self.heartbeat_interval_s)
            self.expire()

    def _remove(self, instance_id: str, reason: str) -> Instance | None:
        instance = self._instances.pop(instance_id, None)
        if instance is not None:
            log = logger.warning if reason in ("expired", "unresponsive") else logger.info
            log("%s %s %s (last heartbeat %.1fs ago)", instance.role, instance_id, reason,
                self.clock() - instance.last_heartbeat)
            self._notify(self._on_removed, instance, reason)
        return instance

    @staticmethod
    def _notify(listeners: list[Listener], instance: Instance, reason: str) -> None:
        for listener in listeners:
            try:
                listener(instance, reason)
            except Exception:  # one broken listener must not corrupt the registry
                logger.exception("registry listener failed for %s", instance.instance_id)


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """pdserve.v1.RegistryService over an InstanceRegistry (grpc.aio). With a token, every
    call must carry `authorization: Bearer <token>` (UNAUTHENTICATED otherwise)."""

    def __init__(self, registry: InstanceRegistry, token: str | None = None):
        self.registry = registry
        self._expected_authorization = f"Bearer {token}".encode() if token else None

    def _authenticate(self, context) -> None:
        if self._expected_authorization is None:
            return
        presented = dict(context.invocation_metadata() or ()).get("authorization", "")
        presented = presented.encode() if isinstance(presented, str) else presented
        if not hmac.compare_digest(presented, self._expected_authorization):
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED,
                               "registry calls need the deployment's registry token "
                               "(--registry-token / PDSERVE_REGISTRY_TOKEN)")

    async def Register(self, request, context):
        self._authenticate(context)
        spec = InstanceSpec.from_pb(request)
        instance = self.registry.register(spec)  # a RegistrationError is INVALID_ARGUMENT
        return registry_pb2.RegisterResponse(
            heartbeat_interval_ms=round(self.registry.heartbeat_interval_s * 1000), instance_secret=instance.secret)

    async def Heartbeat(self, request, context):
        self._authenticate(context)
        self.registry.check_secret(request.instance_id, request.instance_secret)
        known = self.registry.heartbeat(request.instance_id, InstanceLoad.from_pb(request.load),
                                        ServedLoRAs(tuple(request.lora_names), request.lora_names_version,
                                                    dict(request.runtime_lora_paths)))
        return registry_pb2.HeartbeatResponse(reregister=not known)

    async def Deregister(self, request, context):
        self._authenticate(context)
        self.registry.check_secret(request.instance_id, request.instance_secret)
        self.registry.deregister(request.instance_id)
        return registry_pb2.DeregisterResponse()
