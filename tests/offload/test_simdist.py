"""``simgloo``, the simulated accelerator's process-group backend (``offload/simdist.py``): two
real processes run every collective outcore and torch's checkpointing use on sim tensors over
the default (simgloo) group and on CPU tensors over a plain gloo group, and get the same bits;
what NCCL refuses (a CPU tensor beside a device tensor, a non-contiguous device tensor) and a
collective reading device memory another stream wrote unordered are refused here too."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import require_sim

WORKER = textwrap.dedent('''
    import datetime, sys, torch, torch.distributed as dist
    from outcore.offload.device import resolve_device
    from outcore.offload.device import distributed_backend

    rank, init = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    sim = resolve_device("sim")
    assert distributed_backend(sim) == "simgloo"
    dist.init_process_group(distributed_backend(sim), init_method="file://" + init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    assert dist.get_backend() == "simgloo"
    gloo = dist.new_group(backend="gloo")
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def collectives(dev, group):
        """Every collective on tensors of ``dev`` over ``group``; the results on the CPU."""
        g = torch.Generator().manual_seed(rank)
        def t(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=g).to(dtype).to(dev)
        out = {}
        x = t(1000); dist.all_reduce(x, group=group); out["all_reduce"] = x
        x = t(33); dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group); out["all_reduce max"] = x
        x = t(64, dtype=torch.bfloat16); dist.all_reduce(x, group=group); out["all_reduce bf16"] = x
        x = t(7); dist.broadcast(x, src=1, group=group); out["broadcast"] = x
        x = t(9); dist.reduce(x, dst=0, group=group); out["reduce"] = x if rank == 0 else torch.zeros(0)
        xs = [torch.empty(5, device=dev) for _ in range(2)]; dist.all_gather(xs, t(5), group=group)
        out["all_gather"] = torch.cat(xs)
        x = torch.empty(12, device=dev); gather_single(x, t(6), group=group); out["all_gather_single"] = x
        x = torch.empty(4, device=dev); dist.reduce_scatter(x, [t(4), t(4)], group=group); out["reduce_scatter"] = x
        x = torch.empty(3, device=dev); scatter_single(x, t(6), group=group); out["reduce_scatter_single"] = x
        xs = [torch.empty(2, device=dev) for _ in range(2)] if rank == 0 else None
        dist.gather(t(2), xs, dst=0, group=group); out["gather"] = torch.cat(xs) if rank == 0 else torch.zeros(0)
        x = torch.empty(3, device=dev); dist.scatter(x, [t(3), t(3)] if rank == 0 else None, src=0, group=group)
        out["scatter"] = x
        x = torch.empty(4, device=dev); dist.all_to_all_single(x, t(4), group=group); out["all_to_all_single"] = x
        if rank == 0:
            dist.send(t(5), dst=1, group=group); out["send/recv"] = torch.zeros(0)
        else:
            x = torch.empty(5, device=dev); dist.recv(x, src=0, group=group); out["send/recv"] = x
        dist.barrier(group=group)
        box = [{"rank": rank}]; dist.broadcast_object_list(box, src=1, group=group); out["objects"] = box[0]["rank"]
        for k, v in out.items():
            if torch.is_tensor(v):
                assert v.numel() == 0 or v.device.type == torch.device(dev).type, k  # (0: not this rank's)
                out[k] = v.cpu()
        return out

    want = collectives("cpu", gloo)
    del gloo  # (a group alive at the interpreter's exit is torn down there: gloo may abort)
    for dev in ("sim", "cpu"):  # the default group: simgloo carries CPU tensors itself (over its gloo)
        got = collectives(dev, None)
        for k, v in want.items():
            assert (torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k]), (dev, k, v, got[k])

    def refused(match, fn):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"not refused: {match}")

    # as NCCL: one device per collective, contiguous device tensors
    refused("tensors on cpu and sim", lambda: gather_single(torch.empty(4), torch.ones(2, device=sim)))
    refused("contiguous", lambda: dist.all_reduce(torch.ones(4, 4, device=sim).t()[0]))
    # device memory a side stream wrote, reduced on the compute stream with no event in between:
    # a race (on a GPU the collective could read the bytes before they are written)
    x = torch.zeros(4096, device=sim)
    torch.accelerator.synchronize()
    side = torch.Stream(device=sim)
    with side:
        x.fill_(rank + 1)
    refused("stream-order race", lambda: dist.all_reduce(x))
    written = torch.Event(device=sim)
    written.record(side)
    torch.accelerator.current_stream(sim).wait_event(written)
    dist.all_reduce(x)
    assert torch.equal(x.cpu(), torch.full((4096,), 3.0))
    dist.destroy_process_group()
''')


@pytest.mark.slow(ci=True)
def test_every_collective_on_sim_tensors_equals_gloo_on_cpu_tensors(tmp_path):
    require_sim()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "init")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    failed = [out for p, out in zip(procs, outs) if p.returncode]
    assert not failed, "\n".join(out[-3000:] for out in failed)


def test_each_device_s_backend_and_simgloo_registered_for_sim():
    import torch.distributed as dist

    from outcore.offload.device import distributed_backend

    assert distributed_backend("cpu") == distributed_backend(torch.device("cpu")) == "gloo"
    assert distributed_backend(torch.device("cuda", 0)) == distributed_backend("cuda") == "nccl"
    assert distributed_backend("sim") == "simgloo"  # registered with torch.distributed now
    assert "simgloo" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["sim"] == "simgloo"
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # (simgloo carries CPU tensors, gloo stays CPU's)
