"""choose_policy / expand_policy / ActivationPolicy.parse: pure planning logic."""
from __future__ import annotations

import pytest
from outcore.activations.policy import ActivationPolicy as P
from outcore.activations.policy import BlockProfile, choose_policy, expand_policy
from outcore.errors import BudgetError, ConfigError

MB = 1 << 20
BLOCKS = [BlockProfile(saved_bytes=100 * MB, input_bytes=10 * MB, forward_s=0.1)] * 6


def test_fits_means_keep_everything():
    assert choose_policy(BLOCKS, 600 * MB, nvme_budget=None, nvme_read_bps=2e9,
                         nvme_write_bps=3e9) == [P.KEEP] * 6


def test_free_offload_goes_to_the_earliest_blocks_first():
    # 100 MB at 2-3 GB/s hides behind a 0.1 s forward: offloading is free, so it wins
    # over recompute, and the earliest blocks (needed last in backward) go first.
    got = choose_policy(BLOCKS, 350 * MB, nvme_budget=None, nvme_read_bps=2e9, nvme_write_bps=3e9)
    assert got == [P.OFFLOAD_NVME] * 3 + [P.KEEP] * 3


def test_slow_disk_prefers_recompute():
    got = choose_policy(BLOCKS, 450 * MB, nvme_budget=None, nvme_read_bps=1e8, nvme_write_bps=1e8)
    assert got[:2] == [P.RECOMPUTE, P.RECOMPUTE] and got[2:] == [P.KEEP] * 4


def test_host_budget_is_used_before_nvme_and_respected():
    got = choose_policy(BLOCKS, 250 * MB, host_budget=150 * MB, host_bps=10e9,
                        nvme_budget=None, nvme_read_bps=2e9, nvme_write_bps=3e9)
    assert got.count(P.OFFLOAD_HOST) == 1  # only one block fits in 150 MB of HOST
    assert got.count(P.OFFLOAD_NVME) == 3 and got[-1] is P.KEEP


def test_copy_that_steals_compute_is_charged():
    # On a CPU device the copy into the transfer buffer runs on the compute's cores:
    # at 0.5 GB/s, 100 MB costs 0.2 s, more than recomputing a 0.1 s forward.
    fast = dict(nvme_budget=None, nvme_read_bps=2e9, nvme_write_bps=3e9)
    assert choose_policy(BLOCKS, 350 * MB, copy_bps=20e9, **fast) == [P.OFFLOAD_NVME] * 3 + [P.KEEP] * 3
    assert choose_policy(BLOCKS, 350 * MB, copy_bps=0.5e9, **fast) == [P.RECOMPUTE] * 3 + [P.KEEP] * 3


def test_keep_last_blocks_are_never_changed():
    got = choose_policy(BLOCKS, 300 * MB, nvme_budget=None, nvme_read_bps=2e9, nvme_write_bps=3e9,
                        keep_last=3)
    assert got == [P.OFFLOAD_NVME] * 3 + [P.KEEP] * 3
    with pytest.raises(BudgetError, match="last 4"):
        choose_policy(BLOCKS, 300 * MB, nvme_budget=None, nvme_read_bps=2e9, nvme_write_bps=3e9,
                      keep_last=4)


def test_no_offload_tiers_means_recompute_and_keep_last():
    got = choose_policy(BLOCKS, 200 * MB)
    assert got[-1] is P.KEEP and P.OFFLOAD_NVME not in got and P.OFFLOAD_HOST not in got
    assert got.count(P.RECOMPUTE) >= 4


def test_impossible_budget_names_need_and_budget():
    with pytest.raises(BudgetError, match=r"budget is 1000 bytes"):
        choose_policy(BLOCKS, 1000)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="device=-1"):
        choose_policy(BLOCKS, -1)
    with pytest.raises(ConfigError, match="keep_last=-2"):
        choose_policy(BLOCKS, 10, keep_last=-2)
    with pytest.raises(ConfigError, match="copy_bps=-1"):
        choose_policy(BLOCKS, 10, copy_bps=-1)


def test_expand_policy():
    assert expand_policy("offload", 3) == [P.OFFLOAD_NVME, P.OFFLOAD_NVME, P.KEEP]
    assert expand_policy("offload", 4, keep_last=2) == [P.OFFLOAD_NVME] * 2 + [P.KEEP] * 2
    assert expand_policy("offload", 2, keep_last=5) == [P.KEEP] * 2
    with pytest.raises(ConfigError, match="keep_last=-1"):
        expand_policy("offload", 2, keep_last=-1)
    assert expand_policy("recompute", 2) == [P.RECOMPUTE] * 2
    assert expand_policy(["keep", P.OFFLOAD_HOST], 2) == [P.KEEP, P.OFFLOAD_HOST]
    with pytest.raises(ConfigError, match="3 entries for 2 blocks"):
        expand_policy(["keep"] * 3, 2)
    with pytest.raises(ConfigError, match="'swap'"):
        expand_policy("swap", 2)
