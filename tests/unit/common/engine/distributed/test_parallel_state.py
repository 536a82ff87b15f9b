"""parallel_state: the layer split of pipeline stages, the one-process defaults, and the
groups and collectives of a real 2 x 2 gloo world (four spawned processes)."""
from __future__ import annotations

import queue
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from common.engine.distributed import parallel_state
from common.engine.distributed.parallel_state import pipeline_layer_range

TIMEOUT_S = 120.0


@pytest.mark.parametrize("num_layers, pp_size, sizes", [(4, 2, [2, 2]), (3, 2, [2, 1]), (30, 4, [7, 8, 8, 7]),
                                                         (7, 4, [2, 2, 2, 1]), (5, 1, [5])])
def test_layers_split_evenly_with_the_remainder_before_the_last_stage(num_layers, pp_size, sizes):
    ranges = [pipeline_layer_range(num_layers, r, pp_size) for r in range(pp_size)]
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"hidden layers \(2\) must be at least the pipeline parallel size \(3\)"):
        pipeline_layer_range(2, 0, 3)


def test_without_initialisation_everything_is_one_rank():
    assert not parallel_state.model_parallel_is_initialized()
    assert (parallel_state.get_tp_rank(), parallel_state.get_tp_size()) == (0, 1)
    assert (parallel_state.get_pp_rank(), parallel_state.get_pp_size()) == (0, 1)
    assert parallel_state.is_first_stage() and parallel_state.is_last_stage()
    x = torch.arange(4.0)
    assert parallel_state.tp_all_reduce(x) is x
    assert parallel_state.tp_all_gather(x) is x
    assert parallel_state.tp_broadcast_from_first(x) is x
    with pytest.raises(RuntimeError, match="no next stage"):
        parallel_state.send_to_next_stage(x)


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
        parallel_state.initialize_model_parallel(2, 2)
        summed = parallel_state.tp_all_reduce(torch.tensor([float(rank)]))
        gathered = parallel_state.tp_all_gather(torch.tensor([[float(rank)]]), dim=-1)
        broadcast = parallel_state.tp_broadcast_from_first(torch.tensor([rank, 10 * rank])).tolist()
        received = None
        if parallel_state.is_first_stage():
            parallel_state.send_to_next_stage(torch.full((2, 3), float(rank)))
        else:
            received = parallel_state.recv_from_prev_stage((2, 3), torch.float32, torch.device("cpu")).tolist()
        with parallel_state.one_rank_view():  # as a draft model is built on the rank that samples
            alone = torch.tensor([float(rank)])
            one_rank = [parallel_state.get_tp_size(), parallel_state.get_pp_size(), parallel_state.is_first_stage(),
                        parallel_state.is_last_stage(), parallel_state.tp_all_reduce(alone) is alone]
        results.put({"rank": rank, "one_rank": one_rank,
                     "tp": [parallel_state.get_tp_rank(), parallel_state.get_tp_size()],
                     "pp": [parallel_state.get_pp_rank(), parallel_state.get_pp_size()],
                     "first": parallel_state.is_first_stage(), "last": parallel_state.is_last_stage(),
                     "summed": summed.tolist(), "gathered": gathered.tolist(), "received": received,
                     "broadcast": broadcast})
        parallel_state.destroy_model_parallel()
        assert not parallel_state.model_parallel_is_initialized()
        dist.destroy_process_group()
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def test_groups_and_collectives_of_a_two_by_two_world():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = [ctx.Process(target=_rank_main, args=(rank, port, results), daemon=True) for rank in range(4)]
    for p in processes:
        p.start()
    try:
        by_rank = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(by_rank) < 4:
            try:
                msg = results.get(timeout=1.0)
            except queue.Empty:
                assert all(p.is_alive() or i in by_rank for i, p in enumerate(processes)), "a rank died"
                assert time.monotonic() < deadline, "ranks stuck"
                continue
            assert "error" not in msg, msg["error"]
            by_rank[msg["rank"]] = msg
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # rank = pp_rank * tp_size + tp_rank: stage 0 is ranks 0, 1; stage 1 ranks 2, 3.
    for rank, msg in by_rank.items():
        pp_rank, tp_rank = divmod(rank, 2)
        assert msg["one_rank"] == [1, 1, True, True, True]
        assert msg["tp"] == [tp_rank, 2] and msg["pp"] == [pp_rank, 2]  # the view gone, the groups are back
        assert (msg["first"], msg["last"]) == (pp_rank == 0, pp_rank == 1)
        stage_ranks = [2 * pp_rank, 2 * pp_rank + 1]
        assert msg["summed"] == [float(sum(stage_ranks))]  # within the stage's TP group only
        assert msg["gathered"] == [[float(r) for r in stage_ranks]]  # in tp_rank order
        assert msg["broadcast"] == [stage_ranks[0], 10 * stage_ranks[0]]  # the stage's tp rank 0's
        # The same tp_rank of the previous stage sent it.
        assert msg["received"] == (None if pp_rank == 0 else [[float(tp_rank)] * 3] * 2)
