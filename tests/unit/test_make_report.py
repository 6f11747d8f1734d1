"""bench/make_report.py: the README block rendered from small fixture results (no plots)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import make_report  # noqa: E402

FIXTURES = Path(__file__).with_name("fixtures")


def results():
    return [json.loads((FIXTURES / name).read_text()) for name in ("bench_side_by_side.json", "bench_scaling.json")]


def test_side_by_side_row_has_both_downtimes_and_their_ratio():
    block = make_report.render_block(results())
    row = next(ln for ln in block.splitlines() if ln.startswith("| planned, gpt_demo tiny, 3 ranks"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["0.025 s", "4 s", "1/160 (0.0063)"]
    assert cells[5] == "90.0%"
    assert cells[6] == "n/a (CPU)"
    assert cells[7] == "1.6 MB at 0.8 GB/s vs 2 GB/s"
    assert cells[8] == "`python bench/cpu_side_by_side.py --repeats 3`"


def test_unexpected_failure_row_says_what_is_not_measured():
    block = make_report.render_block(results())
    row = next(ln for ln in block.splitlines() if ln.startswith("| unexpected failure"))
    assert "| issue #6: not measured |" in row
    assert "3.5 s to the first step; 27 steps lost, progress regained after 4.2 s" in row


def test_phase_table_lists_every_phase_once_with_blank_cells_where_absent():
    table = make_report.phase_table(results()[0])
    lines = table.splitlines()
    assert lines[0] == "| phase (median) | TrainMover planned | checkpoint-restart planned | checkpoint-restart failure |"
    assert "| imports |  | 1.7 s | 1.6 s |" in lines
    assert "| switch (agree, state copy, swap) | 0.03 s |  |  |" in lines


def test_phases_keep_the_order_a_restart_passes_them():
    assert make_report.merge_order(["save", "stop", "resubmit", "imports"], ["detect + stop", "resubmit", "imports"]) == [
        "save", "stop", "detect + stop", "resubmit", "imports"]
    assert make_report.merge_order(["a", "c"], ["a", "b", "c", "d"]) == ["a", "b", "c", "d"]


def test_scaling_table_and_slope():
    block = make_report.render_block(results())
    assert "| 8 | 0.05 s | 0.050 | 0.06 s | 9 s | 1/180 (0.0056) |" in block
    assert "**+5.00 ms per rank**" in block
    assert "checkpoint-restart: +1000 ms per rank" in block


def test_readme_block_is_replaced_between_markers_only():
    readme = f"# T\n\n## Measured\n\nold table\n\n{make_report.BEGIN}\nstale\n{make_report.END}\n\n## Next\ntext\n"
    out = make_report.replace_block(readme, f"{make_report.BEGIN}\nnew\n{make_report.END}")
    assert out == f"# T\n\n## Measured\n\nold table\n\n{make_report.BEGIN}\nnew\n{make_report.END}\n\n## Next\ntext\n"


def test_block_goes_at_the_end_of_the_measured_section_the_first_time():
    readme = "# T\n\n## Measured\n\nold table\n\n## Next\ntext\n"
    out = make_report.replace_block(readme, f"{make_report.BEGIN}\nnew\n{make_report.END}")
    assert out == f"# T\n\n## Measured\n\nold table\n\n{make_report.BEGIN}\nnew\n{make_report.END}\n\n## Next\ntext\n"


def test_newest_result_per_scenario_and_machine_wins():
    old, new = results()[0], dict(results()[0], when="2026-11-22T00:00:00+00:00", command="newer")
    assert make_report.newest([old, new], "side-by-side") == [new]
