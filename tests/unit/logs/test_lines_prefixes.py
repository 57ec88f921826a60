"""Launcher logger prefixes are decorations, stripped before the message is read."""

from __future__ import annotations

from oomguard.logs.lines import iter_records


def test_fastchat_and_loguru_prefixes_are_stripped_keeping_indentation() -> None:
    records = [
        r.text
        for r in iter_records(
            [
                '2024-03-20 19:18:27 | ERROR | stderr |   File "/srv/w.py", line 3, in <module>',
                "2024-03-20 19:18:27.123 | ERROR    | app.main:run:42 - CUDA out of memory",
            ]
        )
    ]
    assert records == ['  File "/srv/w.py", line 3, in <module>', "CUDA out of memory"]


def test_a_table_row_is_not_taken_for_a_logger_prefix() -> None:
    records = [r.text for r in iter_records(["| INFO | value |", "| 0.9 | 22.1 GiB |"])]
    assert records[0].startswith("| INFO")
