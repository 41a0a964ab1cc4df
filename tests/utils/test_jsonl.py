"""Tier 1: the defensive JSONL helpers every resume and reader of the run dir's JSONL uses."""

from __future__ import annotations

from areal.utils.jsonl import keep_steps_upto, parse_line, read_records, repair_tail


def test_parse_line_refuses_cut_short_empty_and_non_object_lines():
    assert parse_line('{"step": 1}') == {"step": 1}
    assert parse_line('{"step": 1, "lo') is None
    assert parse_line("") is None
    assert parse_line("[1, 2]") is None
    assert parse_line("nan") is None


def test_read_records_skips_bad_lines_and_reads_a_missing_file_as_empty(tmp_path):
    path = tmp_path / "x.jsonl"
    assert read_records(path) == []
    path.write_text('{"step": 1}\ngarbage\n{"step": 2}\n{"st')
    assert read_records(path) == [{"step": 1}, {"step": 2}]


def test_repair_tail_cuts_back_to_the_last_complete_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert repair_tail(path) == len('{"step": 2, "lo')
    assert path.read_text() == '{"step": 1}\n'
    assert repair_tail(path) == 0  # already ends with a newline
    path.write_text('{"st')  # no complete line at all
    assert repair_tail(path) == 4 and path.read_text() == ""
    assert repair_tail(tmp_path / "missing.jsonl") == 0


def test_keep_steps_upto_keeps_the_exact_lines_of_earlier_steps(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1,  "a": 1.10}\n{"step": true}\n{"step": 3}\n{"step": 2}\n{"ste')
    keep_steps_upto(path, 2)
    assert path.read_text() == '{"step": 1,  "a": 1.10}\n{"step": 2}\n'
