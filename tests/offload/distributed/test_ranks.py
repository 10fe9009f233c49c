"""offload/distributed/ranks.py: the ranks the launcher describes in the environment."""
import pytest

from outcore.errors import ConfigError
from outcore.offload.distributed import Ranks, elastic_attempt, from_env, join


def test_no_launcher_is_one_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert from_env() == Ranks(0, 1, 0)
    assert join() == Ranks(0, 1, 0)  # nothing to join: no process group is created
    assert not from_env().distributed and from_env().is_main


def test_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    r = from_env()
    assert (r.rank, r.world, r.local_rank, r.distributed, r.is_main) == (3, 4, 1, True, False)


@pytest.mark.parametrize("rank,world", [("2", "2"), ("x", "2"), ("0", "0")])
def test_bad_environment_is_one_line(monkeypatch, rank, world):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ConfigError, match="RANK|WORLD_SIZE"):
        from_env()


def test_the_torchrun_attempt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert elastic_attempt() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert elastic_attempt() == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "two")
    with pytest.raises(ConfigError, match="TORCHELASTIC_RESTART_COUNT='two'"):
        elastic_attempt()


@pytest.mark.gpu
def test_each_local_rank_gets_its_own_gpu_and_too_many_ranks_are_one_line():
    import torch

    from outcore.offload.device import Device
    from outcore.offload.device import use_local_device

    last = torch.cuda.device_count() - 1
    use_local_device(last)  # what join() does under torchrun, before NCCL's group
    try:
        assert Device().torch_device == torch.device("cuda", last)
    finally:
        torch.cuda.set_device(0)
    with pytest.raises(RuntimeError, match=f"LOCAL_RANK={last + 1} but this machine has"):
        use_local_device(last + 1)
