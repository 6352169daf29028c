"""The one exception type a user ever sees: a bad input, reported as one line, exit code 2."""
from __future__ import annotations


class ConfigError(Exception):
    """A problem with the user's input. `str(err)` is the full user-facing message: it names
    the key and the fix. Several problems may be joined with "; " so all are reported at once."""

    exit_code = 2

    def __init__(self, *problems: str):
        self.problems = tuple(one_line(p) for p in problems if p)
        super().__init__("; ".join(self.problems))


class SweepError(ConfigError):
    """Bad input that every job of a sweep meets (an unwritable cache_dir, a GPU run on a machine
    without a GPU): it stops a sweep at its first job, where another ConfigError stops only its job."""


def one_line(text: str) -> str:
    """A message on one line whatever the user typed: line breaks in echoed values are escaped."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def collect(problems: list[str]) -> None:
    """Raise one ConfigError with every problem found, or return if there are none."""
    if problems:
        raise ConfigError(*problems)
