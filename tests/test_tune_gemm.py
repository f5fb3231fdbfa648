"""`scripts/tune.py gemm`'s variants (benchmarks/tuning/gemm.py; the sweep itself needs a GPU): the
engine's table entry comes first, and every variant is a tile the kernels accept for that projection."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.tuning import gemm as sweep  # noqa: E402


@pytest.mark.parametrize("name", sorted(sweep.SHAPES))
@pytest.mark.parametrize("m", [1, 16, 32, 64, 128, 192, 256])
def test_variants_start_with_the_table_entry(name, m):
    found = sweep.variants(name, m)
    table = sweep.table_config(name, m)
    if table is None and name != "gate_up":
        assert found == []
        return
    assert found and len(found) == len(set(found))
    if table is not None:
        assert found[0] == table
    k = sweep.SHAPES[name][1]
    for cfg in found:
        assert k % cfg.bk == 0 and cfg.num_stages in (2, 3, 4, 6, 8)
        if name in ("o", "down"):  # the table's row tiles, other widths, depths and slice counts
            assert cfg.bm == table.bm and k % (cfg.splits * cfg.bk) == 0
        elif name == "gate_up" and m > 128 and cfg.bm == 128:  # past cuBLAS's switch: 128-row tiles too
            assert cfg.num_warps in (4, 8) and cfg.bn in (64, 128)
        else:  # other row tiles too, none taller than the batch needs (or the table's own)
            assert cfg.bm in (16, 32, 64) and (cfg.bm <= max(16, m) or cfg.bm == found[0].bm)


def test_gate_up_past_the_table_sweeps_the_gated_tiles():
    """Past 128 rows cuBLAS runs gate_up; the sweep still times our gated kernel there."""
    assert sweep.table_config("gate_up", 256) is None
    assert sweep.variants("gate_up", 256)[0].bm == 64
