#!/opt/pdserve/bin/python
"""`pdserve-healthcheck`: the image's HEALTHCHECK. Exit 0 only while the pdserve service
in this container reports SERVING through the gRPC health service; it runs
`pdserve health ADDR` (common/cli/health.py) on the service's own address:

- PDSERVE_HEALTH_ADDRESS if set;
- else 127.0.0.1:$PDSERVE_PORT (or $PDSERVE_HOST:$PDSERVE_PORT when the service binds
  one interface that is not a wildcard) when the port is fixed;
- else (PDSERVE_PORT=0: the service bound a free port, as in the host-network stack)
  the TCP ports this container's processes listen on, found in /proc, newest socket
  first; the first one that answers SERVING passes.

compose.yaml runs `pdserve health 127.0.0.1:50051` directly; this wrapper is what the
host-network override (where each replica's port is only known to itself) and plain
`docker run` use.
"""
from __future__ import annotations

import os
import sys


def _listening_inodes() -> dict[int, int]:
    """inode -> port of every listening TCP socket in this network namespace."""
    ports: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        ports[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
        except OSError:
            continue
    return ports


def own_listening_ports() -> list[int]:
    """Ports this container's processes (its PID namespace) listen on, newest first."""
    listening = _listening_inodes()
    mine: set[tuple[int, int]] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listening:
                    mine.add((inode, listening[inode]))
    return [port for _, port in sorted(mine, reverse=True)]


def candidate_addresses() -> list[str]:
    explicit = os.environ.get("PDSERVE_HEALTH_ADDRESS")
    if explicit:
        return [explicit]
    host = os.environ.get("PDSERVE_HOST", "127.0.0.1")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = os.environ.get("PDSERVE_PORT", "0")
    if port not in ("", "0"):
        return [f"{host}:{port}"]
    return [f"{host}:{p}" for p in dict.fromkeys(own_listening_ports())]


def main() -> int:
    from common.cli.health import main as health
    addresses = candidate_addresses()
    if not addresses:
        print("no listening port yet", file=sys.stderr)
        return 1
    status = 1
    for address in addresses:
        status = health([address, "--timeout", "3"])
        if status == 0:
            return 0
    return status


if __name__ == "__main__":
    sys.exit(main())
