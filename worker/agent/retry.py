"""Riding out an outage (Redis, the controller): retry with jittered exponential waits, say
once that it went down and once that it is back, and give up only when told to stop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_random_exponential

log = logging.getLogger("meshkeeper.agent")
T = TypeVar("T")
FIRST_WAIT_S = 0.1  # the first retry waits up to this; each one after, up to twice the last


class _Stopped(Exception):
    pass


class Outage:
    """`call(fn)` calls fn until it returns, retrying `errors` with a full-jitter exponential
    wait capped at `max_wait_s`; None once `stop` is set while failing. Any other exception
    (a refused join token, a bug) propagates at once. One object per retried thing: it keeps
    whether that thing is down, so an outage is logged once however many calls fail in it."""

    def __init__(
        self,
        errors: type[BaseException] | tuple[type[BaseException], ...],
        max_wait_s: float,
        stop: threading.Event,
        *,
        down: str,
        back: str,
        sleep: Callable[[float], object] | None = None,
        on_failure: Callable[[BaseException], object] | None = None,
    ):
        self.down, self.back, self.on_failure, self.stop = down, back, on_failure, stop
        self.is_down = False
        self._sleep = sleep or stop.wait
        self.retrying = Retrying(
            retry=retry_if_exception_type(errors),
            wait=wait_random_exponential(multiplier=FIRST_WAIT_S, max=max_wait_s),
            stop=lambda _: stop.is_set(),
            sleep=self._wait,
            before_sleep=self._failed,
            retry_error_callback=self._failed,
        )

    def call(self, fn: Callable[[], T]) -> T | None:
        try:
            result = self.retrying(fn)
        except _Stopped:
            return None
        if self.is_down and not self.stop.is_set():
            self.is_down = False
            log.info(self.back)
        return result

    def _wait(self, seconds: float) -> None:
        self._sleep(seconds)
        if self.stop.is_set():  # told to stop while waiting: no further try
            raise _Stopped

    def _failed(self, state: RetryCallState) -> None:
        error = state.outcome.exception()
        if self.on_failure:
            self.on_failure(error)
        if not self.is_down:
            self.is_down = True
            log.warning(self.down, error)
