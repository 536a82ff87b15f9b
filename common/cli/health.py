"""`pdserve health ADDR`: exit 0 only if ADDR reports SERVING (grpc.health.v1).

Works against the gateway and every prefill or decode instance, like
grpc_health_probe, and is what compose.yaml's healthchecks run. Exit status:
0 SERVING, 1 NOT_SERVING / SERVICE_UNKNOWN / UNKNOWN, 2 unreachable or timed out.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 5.0) -> str:
    """The status name ADDR reports for `service` ("" = the whole server)."""
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve health", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="HOST:PORT of a gateway, prefill or decode instance")
    parser.add_argument("--service", default="",
                        help="service to ask about, e.g. pdserve.v1.GenerateService (default: the server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as e:
        # A service the server does not know is NOT_FOUND: report it like the probe does.
        if e.code() == grpc.StatusCode.NOT_FOUND:
            print("SERVICE_UNKNOWN")
            return 1
        print(f"{e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
