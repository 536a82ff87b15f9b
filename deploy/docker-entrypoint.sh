#!/bin/sh
# pdserve container entrypoint: work out the address this replica advertises, then
# exec the command (the service becomes PID 1 and gets SIGTERM from `docker stop`).
#
# Replicas made by `docker compose up --scale decode=3` share one service definition,
# so none can be given its own address in compose.yaml. A prefill or decode instance
# registers with the gateway under its advertised address (gRPC host:port; the same
# host is used for its ZeroMQ KV / event endpoints). When
#   - PDSERVE_ADVERTISE_ADDRESS is not set,
#   - the service listens on every interface (PDSERVE_HOST 0.0.0.0 or ::), and
#   - its gRPC port is fixed (PDSERVE_PORT not 0),
# this sets PDSERVE_ADVERTISE_ADDRESS=<this container's IP>:<PDSERVE_PORT>: the IP that
# `hostname -i` resolves (Docker writes it into /etc/hosts), reachable from every other
# container on the compose network. Anything else is left to the service's own
# default (its --host and the port it actually bound, which is what the host-network
# test stack uses: PDSERVE_HOST=127.0.0.1, PDSERVE_PORT=0). Kubernetes sets
# PDSERVE_ADVERTISE_ADDRESS from the pod IP (deploy/k8s). PDSERVE_ADVERTISE=hostname
# skips this and lets the services advertise the container's hostname instead.
#
# Instance ids need nothing here: the services' default (ROLE-HOSTNAME-PID-RANDOM) is
# unique even on the host network, where every replica has the host's name and PID 1.
set -eu

container_ip() {
    # first address only: a container on several networks lists one per network
    ip=$(hostname -i 2>/dev/null | awk '{print $1}') || ip=
    case "$ip" in
        ''|127.*|::1) return 1 ;;
    esac
    printf '%s\n' "$ip"
}

if [ -z "${PDSERVE_ADVERTISE_ADDRESS:-}" ] && [ "${PDSERVE_ADVERTISE:-ip}" = ip ]; then
    case "${PDSERVE_HOST:-}" in
        0.0.0.0|::|'[::]')
            port=${PDSERVE_PORT:-0}
            if [ "$port" != 0 ] && ip=$(container_ip); then
                case "$ip" in
                    *:*) PDSERVE_ADVERTISE_ADDRESS="[$ip]:$port" ;;
                    *) PDSERVE_ADVERTISE_ADDRESS="$ip:$port" ;;
                esac
                export PDSERVE_ADVERTISE_ADDRESS
            fi
            ;;
    esac
fi

if [ "$#" -eq 0 ]; then
    set -- pdserve --help
fi
exec "$@"
