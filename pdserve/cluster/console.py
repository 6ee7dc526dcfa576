"""Progress and errors of the cluster commands go to stderr, unbuffered; stdout is for data."""

import sys


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
