"""`pdserve up` divides the CPUs it may use (affinity, CPU quota) among its engine processes,
and its decode processes beside a prefill pool keep one weight copy."""
from __future__ import annotations

import textwrap

import pytest

from common.cli.processes import route_flags
from common.cli.up import LocalStack, default_reserved_cpus, engine_threads
from common.engine.cpus import num_cpus_available
from common.engine.engine_args import engine_config_from_args
from decode_service.main import build_parser as decode_parser
from tests.support.cpu_cgroup import one_cpu_cgroup
from tests.support.fresh_process import run_python


def test_engine_processes_share_the_cores_and_pinned_roles_use_their_cpus():
    num_cores = num_cpus_available()
    stack = LocalStack(1, 1, reserved_cpus=0)
    assert stack._thread_flags("decode") == ["--num-threads", str(max(1, num_cores // 2))]
    reserving = LocalStack(0, 1, reserved_cpus=1)  # one core left to the gateway and the services' threads
    # ... but not for the steps that prefill, when no token streams
    assert reserving._thread_flags("decode") == (["--num-threads", str(max(1, num_cores - 1))] + (
        ["--num-prefill-threads", str(num_cores)] if num_cores > 1 else []))
    assert "--num-prefill-threads" not in LocalStack(0, 2)._thread_flags("decode")  # the other streams
    assert "--num-prefill-threads" not in LocalStack(1, 1)._thread_flags("decode")
    assert "--num-prefill-threads" not in LocalStack(0, 1, reserved_cpus=0)._thread_flags("decode")
    crowded = LocalStack(num_cores, num_cores)  # more engines than cores: one thread each, not zero
    assert crowded._thread_flags("prefill") == ["--num-threads", "1"]
    pinned = LocalStack(1, 1, cpu_affinity={"decode": {0}})
    assert pinned._thread_flags("decode") == ["--num-threads", "1"]
    with pytest.raises(ValueError, match="reserved_cpus"):
        LocalStack(1, 1, reserved_cpus=-1)


@pytest.mark.parametrize("num_cpus, num_prefill, num_decode, reserved, threads", [
    (2, 0, 1, 1, (1, 1)),    # a decode that prefills, on 2 cores: one for it, one for the rest
    (2, 0, 1, 0, (2, 2)),
    (2, 1, 1, 1, (1, 1)),    # fewer cores than engines plus the reserve: still one each
    (4, 1, 1, 1, (1, 2)),    # the core left over goes to decode
    (16, 1, 1, 1, (7, 8)),
    (8, 2, 2, 1, (1, 2)),    # 7 cores: 1 each and 3 left, enough for both decodes
    (8, 2, 3, 1, (1, 1)),    # 7 cores: 1 each and 2 left, not enough for three decodes
    (64, 0, 4, 0, (16, 16)),
])
def test_engine_threads_leave_the_reserved_cpus_and_give_decode_the_rest(num_cpus, num_prefill, num_decode,
                                                                        reserved, threads):
    assert engine_threads(num_cpus, num_prefill, num_decode, reserved) == threads


def test_a_core_is_reserved_by_default_only_on_hosts_of_eight_cpus_or_more():
    assert [default_reserved_cpus(n) for n in (1, 2, 4, 7, 8, 64)] == [0, 0, 0, 0, 1, 1]
    num_cores = num_cpus_available()
    by_default = LocalStack(0, 1)._thread_flags("decode")
    assert by_default[:2] == ["--num-threads", str(max(1, num_cores - default_reserved_cpus(num_cores)))]


def test_up_inside_a_one_cpu_quota_gives_its_engines_one_thread_each():
    """Run in a container limited to one CPU on a bigger host, up divides that CPU, not the
    host's cores (which the container still sees)."""
    script = textwrap.dedent("""
        from common.cli.up import LocalStack
        print(LocalStack(1, 1, reserved_cpus=0)._thread_flags("prefill"))
        print(LocalStack(1, 1, reserved_cpus=0)._thread_flags("decode"))
        print(LocalStack(0, 1)._thread_flags("decode"))
    """)
    with one_cpu_cgroup() as group:
        done = run_python(script, timeout_s=60, cgroup=group)
    assert done.stdout.splitlines() == ["['--num-threads', '1']"] * 3


def test_a_num_threads_flag_given_to_up_reaches_the_engines_and_wins():
    routed = route_flags(["--num-threads", "3"])
    assert routed["decode"] == ["--num-threads", "3"] and routed["prefill"] == ["--num-threads", "3"]
    assert "--num-threads" not in routed["gateway"]
    # up's share goes first on the command line: argparse keeps a flag's last value.
    stack = LocalStack(1, 1, passthrough=["--num-threads", "3"])
    argv = [*stack._thread_flags("decode"), *stack.flags["decode"]]
    assert argv[-2:] == ["--num-threads", "3"]


def test_decode_processes_beside_a_prefill_pool_keep_one_weight_copy_unless_told_not_to():
    stack = LocalStack(1, 1)
    assert stack._weight_flags("decode") == ["--single-weight-copy"] and stack._weight_flags("prefill") == []
    assert LocalStack(0, 1)._weight_flags("decode") == []  # alone, a decode process prefills everything
    # A --no-single-weight-copy given to up comes after up's own flag, and argparse keeps the last.
    told = LocalStack(1, 1, passthrough=["--no-single-weight-copy"])
    argv = [*told._weight_flags("decode"), *told.flags["decode"]]
    assert not engine_config_from_args(decode_parser().parse_args(argv)).single_weight_copy
    assert engine_config_from_args(decode_parser().parse_args(stack._weight_flags("decode"))).single_weight_copy
