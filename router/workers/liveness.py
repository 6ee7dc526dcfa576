"""Whether a worker still answers: the router's rule for a hung worker (its process alive, its
port open, its calls never answered: SIGSTOP, a blocked event loop) and for one that flaps.

A worker whose Stats (polled every LOAD_POLL_S) and Health calls have not answered for
`--worker-unresponsive-timeout` seconds leaves the pools: no new request goes to it. It returns
once it has answered every call for BACK_AFTER_S, twice as long for each time it was taken out
within FLAP_WINDOW_S before (up to MAX_BACK_AFTER_S), so a worker that keeps stalling spends
longer out each time instead of catching requests between stalls. Times are
`time.monotonic()` seconds, passed in, so the rule is tested without waiting.
"""

from dataclasses import dataclass, field

BACK_AFTER_S = 2.0  # answering this long brings a worker taken out back (the first time)
MAX_BACK_AFTER_S = 60.0
FLAP_WINDOW_S = 300.0  # outs within this window make the next return slower
FRESH_S = 2.0  # an answer older than this does not count as "answering now"


@dataclass
class Liveness:
    last_answer: float  # its last answer (or when it joined)
    out_since: float | None = None  # taken out for silence; None: serving
    answering_since: float | None = None  # while out: the start of its unbroken answers
    outs: list[float] = field(default_factory=list)  # when it was taken out, recent ones

    @property
    def serving(self) -> bool:
        return self.out_since is None

    def answered(self, now: float) -> None:
        self.last_answer = now
        if self.out_since is not None and self.answering_since is None:
            self.answering_since = now

    def missed(self) -> None:
        """A call failed or timed out: a run of answers toward its return starts over."""
        self.answering_since = None

    def back_after(self, now: float) -> float:
        """How long it must answer before it returns, from its recent outs (this one included)."""
        recent = sum(now - out < FLAP_WINDOW_S for out in self.outs)
        return min(MAX_BACK_AFTER_S, BACK_AFTER_S * 2 ** max(0, recent - 1))

    def goes_out(self, now: float, deadline_s: float) -> bool:
        """True when a serving worker has been silent past `deadline_s`: it is out from now."""
        if not self.serving or now - self.last_answer <= deadline_s:
            return False
        self.out_since, self.answering_since = now, None
        self.outs = [out for out in self.outs if now - out < FLAP_WINDOW_S] + [now]
        return True

    def comes_back(self, now: float) -> bool:
        """True when a worker taken out has answered long enough, up to now: it serves again."""
        if (
            self.serving
            or self.answering_since is None
            or now - self.last_answer > FRESH_S
            or now - self.answering_since < self.back_after(now)
        ):
            return False
        self.out_since = self.answering_since = None
        return True
