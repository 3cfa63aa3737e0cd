"""benchmarks/tools/verify_rows.py on a tiny model: every row count is timed on both clocks and the table gives the
extra row's cost against the one-row step."""

from backend.model.runner import ModelRunner
from benchmarks.tools import verify_rows


def test_each_row_count_is_timed_and_tabled(tiny_model_factory):
    runner = ModelRunner(tiny_model_factory("llama"), "float32", 4, 16, quantization="none")
    times = verify_rows.step_times(runner, context=8, repeats=2)
    assert sorted(times) == list(verify_rows.ROWS)
    assert all(wall > 0 and cpu >= 0 for wall, cpu in times.values())
    lines = verify_rows.table(times)
    assert len(lines) == 2 + len(verify_rows.ROWS)
    assert lines[2].startswith("| 1 |") and lines[2].endswith("|  |  |")  # one row: no extra-row figure
    assert all(line.count("x |") == 2 for line in lines[2:])
