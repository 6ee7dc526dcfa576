import io

from pdserve.core.progress import Progress


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal (a fake: what stderr is in a shell)."""

    def isatty(self) -> bool:
        return True


def test_elsewhere_a_line_per_tenth_and_none_redrawn():
    out = io.StringIO()
    progress = Progress(86, "configurations simulated", stream=out)
    for done in range(1, 87):
        progress.at(done, 86)
    progress.close()
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue()
    assert lines[-1] == ""
    assert len(lines[:-1]) == 10
    assert lines[0] == "9/86 configurations simulated (10%)"
    assert lines[-2] == "86/86 configurations simulated (100%)"


def test_work_cut_short_ends_with_where_it_stopped_and_its_note():
    out = io.StringIO()
    progress = Progress(60, "requests", stream=out)
    for failed in range(7):
        progress.advance(note=f"{failed} failed" if failed else "")
    progress.close()
    progress.close()  # twice: no repeat
    assert out.getvalue().split("\n")[-2:] == ["7/60 requests (12%), 6 failed", ""]
    assert out.getvalue().count("7/60") == 1


def test_a_terminal_redraws_one_line_and_ends_it_once():
    out = FakeTerminal()
    progress = Progress(3, "requests", stream=out)
    for _ in range(3):
        progress.advance()
    progress.close()
    assert out.getvalue() == "\r1/3 requests (33%)\r2/3 requests (67%)\r3/3 requests (100%)\n"


def test_disabled_writes_nothing():
    out = FakeTerminal()
    progress = Progress(2, "requests", stream=out, enabled=False)
    progress.advance()
    progress.advance()
    progress.close()
    assert out.getvalue() == ""
