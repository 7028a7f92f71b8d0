"""An invocation's error and stderr tail as stored and answered (app/services/invocations.py):
bounded whatever the guest wrote or its module named."""

from __future__ import annotations

from app.services.invocations import ERROR_CHARS, bounded_error, stderr_tail


def test_an_error_is_cut_at_its_bound() -> None:
    assert bounded_error(None) is None and bounded_error("short") == "short"
    cut = bounded_error("e" * (ERROR_CHARS * 100))
    assert cut is not None and len(cut) == ERROR_CHARS and cut.endswith("…")


def test_a_stderr_tail_is_bounded_in_utf8_bytes_after_decoding() -> None:
    assert stderr_tail(b"", 10) is None
    assert stderr_tail("héllo".encode(), 100) == "héllo"
    invalid = stderr_tail(b"\xff" * 65536, 65536)  # each invalid byte reads as U+FFFD, 3 bytes
    assert invalid is not None and len(invalid.encode()) <= 65536 and set(invalid) == {"\ufffd"}
    tail = stderr_tail(b"a" * 10 + "é".encode() * 10, 7)
    assert tail == "ééé" and len(tail.encode()) <= 7  # the tail's end, never half a character
