"""Two gateways dispatching to the same instances: each keeps its own registry and ledger,
and the other gateway's work reaches its load estimate through the instances' heartbeats
(which report what the instance really holds, whoever sent it). A gateway's own charges
and releases never add or take off the other gateway's work."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.service.registration import InstanceLoad
from gateway.routing.kv_index import KvIndex
from gateway.routing.load_ledger import LoadLedger
from gateway.routing.policies import LeastLoaded
from tests.unit.gateway.routing.instances import make_registry

PROMPT_TOKENS = 600


@dataclass
class PrefillInstance:
    """The truth a heartbeat reports: the prompts queued on one prefill instance, by request."""

    queued: dict[str, int] = field(default_factory=dict)  # request -> prompt tokens still to compute

    def accept(self, request: str, tokens: int = PROMPT_TOKENS) -> None:
        self.queued[request] = tokens

    def finish(self, request: str) -> None:
        del self.queued[request]

    def load(self) -> InstanceLoad:
        return InstanceLoad(num_running_requests=len(self.queued),
                            num_queued_prefill_tokens=sum(self.queued.values()))


class Gateway:
    """One gateway's view: its registry of the two prefill instances, its ledger."""

    def __init__(self):
        self.registry = make_registry("prefill", {"p0": InstanceLoad(), "p1": InstanceLoad()})
        self.ledger = LoadLedger(KvIndex())

    def estimate(self, instance_id: str) -> tuple[int, int]:
        instance = self.registry.get(instance_id)
        return instance.num_requests, instance.queued_prefill_tokens

    def place(self) -> str:
        return LeastLoaded().choose_prefill((), self.registry.instances("prefill")).instance_id

    def dispatch(self, instance_id: str, instances: dict[str, PrefillInstance], request: str):
        charge = self.ledger.charge(PROMPT_TOKENS, prefill=self.registry.get(instance_id))
        instances[instance_id].accept(request)
        return charge

    def heartbeat_from(self, instances: dict[str, PrefillInstance]) -> None:
        for instance_id, instance in instances.items():
            self.registry.heartbeat(instance_id, instance.load())


def test_another_gateways_dispatches_reach_the_estimate_with_the_next_heartbeat():
    instances = {"p0": PrefillInstance(), "p1": PrefillInstance()}
    a, b = Gateway(), Gateway()
    for i in range(3):  # gateway B sends three prompts to p0
        b.dispatch("p0", instances, f"b{i}")
    assert b.estimate("p0") == (3, 3 * PROMPT_TOKENS)
    assert a.estimate("p0") == (0, 0)  # invisible to A for at most one heartbeat interval
    a.heartbeat_from(instances)
    assert a.estimate("p0") == (3, 3 * PROMPT_TOKENS)
    assert a.place() == "p1"  # so A spreads instead of piling onto B's instance


def test_a_gateways_own_release_never_takes_off_the_other_gateways_work():
    instances = {"p0": PrefillInstance(), "p1": PrefillInstance()}
    a, b = Gateway(), Gateway()
    own = a.dispatch("p0", instances, "a0")
    for i in range(2):
        b.dispatch("p0", instances, f"b{i}")
    a.heartbeat_from(instances)  # counts A's request and B's two
    assert a.estimate("p0") == (3, 3 * PROMPT_TOKENS)
    instances["p0"].finish("a0")
    own.release()  # A sees its request's first token: off the reported numbers, once
    own.release()
    assert a.estimate("p0") == (2, 2 * PROMPT_TOKENS)  # B's work stays
    a.heartbeat_from(instances)
    assert a.estimate("p0") == (2, 2 * PROMPT_TOKENS)


def test_the_other_gateways_finished_work_leaves_with_the_next_heartbeat():
    instances = {"p0": PrefillInstance(), "p1": PrefillInstance()}
    a, b = Gateway(), Gateway()
    b_charges = [b.dispatch("p0", instances, f"b{i}") for i in range(2)]
    a.heartbeat_from(instances)
    since = a.dispatch("p0", instances, "a0")  # after the heartbeat: A adds it itself
    assert a.estimate("p0") == (3, 3 * PROMPT_TOKENS)
    for i, charge in enumerate(b_charges):
        instances["p0"].finish(f"b{i}")
        charge.release()
    assert b.estimate("p0") == (0, 0)  # B never heartbeated: its charges net to nothing
    a.heartbeat_from(instances)  # the truth: only A's request is left
    assert a.estimate("p0") == (1, PROMPT_TOKENS)
    instances["p0"].finish("a0")
    since.release()
    assert a.estimate("p0") == (0, 0)
    b.heartbeat_from(instances)
    assert b.estimate("p0") == (0, 0) and b.estimate("p1") == (0, 0)
