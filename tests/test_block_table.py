"""worker.input_batch.BlockTable: the run-long table of every live request's block ids that a step gathers its
rows from; rows and columns grow past their first size, released rows are reused, and a row's later blocks
land after its earlier ones."""

from __future__ import annotations

import numpy as np

from worker.input_batch import BlockTable


def test_rows_grow_are_reused_and_gather_in_the_steps_order() -> None:
    table = BlockTable(rows=2, columns=2)
    blocks = {i: [10 * i + j for j in range(1 + i % 3)] for i in range(5)}
    rows = {i: table.add(ids) for i, ids in blocks.items()}  # 5 rows: grows from 2
    assert len(set(rows.values())) == 5 and table.array.shape[0] >= 5
    for i in (4, 0, 2):
        got = table.take([rows[i]], len(blocks[i]))
        assert got.tolist() == [blocks[i]]
    table.release(rows[1])
    again = table.add([99])
    assert again == rows[1]  # the freed row is taken first
    assert table.take([again, rows[3]], 1).tolist() == [[99], [30]]


def test_columns_grow_and_new_blocks_append() -> None:
    table = BlockTable(rows=4, columns=2)
    first = table.add([1, 2])
    other = table.add([7])
    table.write(first, [3, 4, 5], start=2)  # past the first width
    table.write(other, list(range(100, 170)), start=1)  # 71 blocks: a long context
    assert table.take([first], 5).tolist() == [[1, 2, 3, 4, 5]]
    assert table.take([other], 71).tolist() == [[7, *range(100, 170)]]
    assert table.take([first, other], 3).dtype == np.int32
