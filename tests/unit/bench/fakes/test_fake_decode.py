"""The synthetic decode instance behind a real in-process gateway."""
from __future__ import annotations

from gateway.client import Client
from tests.support.background_gateway import BackgroundGateway

# Longer than three of the gateway's keepalive pings (one a second at most while no data
# arrives): a server on gRPC's default policy answers the third with GOAWAY
# "too_many_pings", which fails the calls on the channel.
SILENT_S = 3.5


def test_a_stream_silent_for_seconds_outlives_the_gateways_keepalive_pings():
    with BackgroundGateway() as gw:
        gw.add_fake_decode("decode-0", token_ids=[5, 6], delay_s=SILENT_S)
        with Client(gw.address, timeout=60) as client:
            result = client.generate(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True,
                                     return_token_ids=True)
    assert result.token_ids == [5, 6] and result.finish_reason == "length"
