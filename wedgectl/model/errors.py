"""Domain errors: each carries its one-line message and its exit code."""

from __future__ import annotations

from wedgectl.model import exitcodes


class WedgectlError(Exception):
    """An error the CLI turns into one line on stderr and an exit code."""

    exit_code = exitcodes.INTERNAL

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class InputNotFound(WedgectlError):
    exit_code = exitcodes.NO_SUCH_FILE


class UnreadableInput(WedgectlError):
    exit_code = exitcodes.UNREADABLE_INPUT


class NoVllmLines(WedgectlError):
    exit_code = exitcodes.NO_VLLM_LINES


class BadBundle(WedgectlError):
    exit_code = exitcodes.BAD_BUNDLE


class UnwritableOutput(WedgectlError):
    exit_code = exitcodes.UNWRITABLE_OUTPUT


class NoSuchProcess(WedgectlError):
    exit_code = exitcodes.NO_SUCH_PROCESS


class NotVllm(WedgectlError):
    exit_code = exitcodes.NOT_VLLM


class Unreachable(WedgectlError):
    exit_code = exitcodes.UNREACHABLE


class BadMetrics(WedgectlError):
    exit_code = exitcodes.BAD_METRICS
