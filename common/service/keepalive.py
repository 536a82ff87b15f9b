"""gRPC keepalive for the internal channels (gateway -> decode, decode -> prefill,
instance -> gateway registry), so that a peer that froze (SIGSTOP, a hung host, a
dropped network path) fails the calls on that channel with UNAVAILABLE within seconds
instead of holding them as long as the freeze lasts. Servers that receive these pings
allow them (KEEPALIVE_SERVER_OPTIONS), or they would answer with GOAWAY "too_many_pings".
"""
from __future__ import annotations

# A frozen peer fails the calls within 1 s + KEEPALIVE_TIMEOUT_MS (1.6 s), inside two of the
# gateway's heartbeat periods (1 s each). The 1 s is gRPC's own limit on a client: after it
# sends any ping (a keepalive or a flow-control probe), its next ping waits until a data
# frame arrives or a second has passed. A ping sent just before the freeze therefore holds
# the next one back for a second, and only that one can time out (with a 1 s timeout the
# calls ended at 2.00 s under load). The postponement of a ping while data arrives costs at
# most 2 * KEEPALIVE_TIME_MS (0.8 s), inside that second. Ping acks come from gRPC's own
# threads, not the peer's Python code, so a busy engine loop does not delay them.
KEEPALIVE_TIME_MS = 400  # ping an idle or busy connection this often
KEEPALIVE_TIMEOUT_MS = 600  # no ack within this: the connection is dead

KEEPALIVE_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Every ping, the flow-control (BDP) probes included, must be acked within the same
    # time: a probe left outstanding holds back the keepalive ping, and the default 60 s
    # limit on it let a frozen peer keep its calls for a minute.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),  # a heartbeat channel is idle between beats
    ("grpc.http2.max_pings_without_data", 0),  # a long prefill sends no data for a while
]

KEEPALIVE_SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging as agreed
]
