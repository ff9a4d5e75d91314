"""``balanced_splits`` (on by default): each row's split count of a uniform fast-step launch, from the
host's plan (the kernel itself against its reference: tests/kernels/test_fast_decode.py)."""

from __future__ import annotations

import pytest

from sfi_vllm.backends.common import balanced_split_table, row_keys
from sfi_vllm.config import build_config
from sfi_vllm.kernels.fast_decode import balanced_num_splits, balanced_row_splits, uniform_num_splits
from sfi_vllm.trigger import StepMode
from test_sfi_layer import plan_for


@pytest.mark.parametrize("rows", [1, 2, 6, 8, 16, 32, 64])
def test_rows_of_equal_work_get_the_default_count(rows):
    assert balanced_row_splits([16384] * rows, 8) == [uniform_num_splits(rows, 8)] * rows
    assert balanced_num_splits(rows, 8) >= uniform_num_splits(rows, 8)


def test_a_dense_row_among_fast_rows_gets_a_share_by_its_keys():
    got = balanced_row_splits([16384] + [2308] * 15, 8)
    assert got[1:] == [3] * 15 and got[0] == 22
    # every program reads about as many keys, and the launch about 528 programs
    assert abs(8 * sum(got) - 528) <= 8 * 16
    assert max(16384 / got[0], 2308 / got[1]) < 1.2 * min(16384 / got[0], 2308 / got[1])
    # at 16 rows the grid has 16 splits: the kernel caps the dense row there
    assert balanced_num_splits(16, 8) == 16


def test_small_rows_keep_at_least_one_tile_and_empty_rows_one_split():
    assert balanced_row_splits([40, 0, 0], 8) == [2, 1, 1]  # 32-key programs at least
    assert balanced_row_splits([], 8) == []
    assert balanced_row_splits([10 ** 7], 8) == [64]


def test_row_keys_count_what_each_row_reads():
    cfg = build_config({"boundary_token_ids": [7]}, use_env=False)
    modes = [StepMode.FAST, StepMode.SLOW, StepMode.DENSE, StepMode.FAST]
    plan = plan_for(modes, cfg=cfg, context=[16384, 16384, 900, 8192])
    plan.keys_only = [False, False, False, True]
    g = plan.geometry[0]
    fast = g.sinks + g.selected + 16384 - g.window_start
    assert 1000 < fast < 16384 // 2
    keys = row_keys(plan)
    assert keys[:3] == [fast, 16384, 900]  # a dense slow row and a dense row read their context
    g3 = plan.geometry[3]
    assert keys[3] == g3.sinks + g3.selected + 8192 - g3.window_start
    # a keys-only slow row scored in the kernel also reads its keys (without values)
    assert row_keys(plan, scored=[False, True, False, True])[3] == keys[3] + 8192 // 2


def test_the_table_pads_with_one_split_and_skips_large_batches(monkeypatch):
    cfg = build_config({"boundary_token_ids": [7]}, use_env=False)
    plan = plan_for([StepMode.SLOW] + [StepMode.FAST] * 3, cfg=cfg, context=[16384] * 4)
    table = balanced_split_table(plan, 4, 10, 8).tolist()
    assert table[4:] == [1] * 6 and table[0] > max(table[1:4]) >= 1
    assert table[:4] == balanced_row_splits(row_keys(plan), 8)
    # no plan: every row alike
    assert balanced_split_table(None, 4, 6, 8).tolist() == [uniform_num_splits(4, 8)] * 4 + [1, 1]
    # a grid of one split: nothing to share, and no host pass over the rows
    assert balanced_num_splits(300, 8) == 1
    big = plan_for([StepMode.SLOW] + [StepMode.FAST] * 299, cfg=cfg, context=[16384] * 300)

    def no_count(*args, **kwargs):
        raise AssertionError("counted the keys of a batch whose grid has one split")
    import sfi_vllm.backends.common as common
    monkeypatch.setattr(common, "row_keys", no_count)
    assert balanced_split_table(big, 300, 320, 8).tolist() == [1] * 320
    with pytest.raises(AssertionError, match="counted the keys"):
        balanced_split_table(plan, 4, 10, 8)
