"""Rolling accept-length watchdog: the seed's failure (accept length 1.00, slower than no MTP) must not pass
silently while the engine runs, whatever the start-up canaries said.

Fed one count per verify round (tokens committed by that round = accepted drafts + 1 bonus, SGLang's
``accept len``). Once ``window`` rounds are seen, the mean over the last ``window`` rounds at or below
``threshold`` raises an alarm: logged (ERROR, once per episode), exposed by :meth:`AcceptWatchdog.state` for
the metrics and the manifest, and with ``strict`` raised as :class:`AcceptLengthAlarm`.
"""

from __future__ import annotations

import logging
from collections import deque

from bytebound.errors import VerificationError

log = logging.getLogger("bytebound.verify")


class AcceptLengthAlarm(VerificationError):
    """The rolling accept length fell to the threshold (``--strict``): MTP is on but drafts are not accepted."""


class AcceptWatchdog:
    """Rolling mean of committed tokens per verify round over the last ``window`` rounds.

    Args:
        window: rounds in the rolling mean (the alarm can fire after ``window`` rounds, not before).
        threshold: alarm when the rolling mean is ``<= threshold`` (1.0 = no draft ever accepted).
        strict: raise :class:`AcceptLengthAlarm` when the alarm fires.
    """

    def __init__(self, window: int = 64, threshold: float = 1.05, strict: bool = False):
        if window < 1:
            raise ValueError(f"watchdog window must be >= 1, got {window}")
        self.window, self.threshold, self.strict = int(window), float(threshold), bool(strict)
        self._last: deque[int] = deque(maxlen=self.window)
        self._sum = 0
        self.rounds = 0            # rounds observed since start
        self.alarm = False         # currently alarming
        self.alarms = 0            # alarm episodes so far (entering the alarm state)
        self.first_alarm_round: int | None = None
        self.last_alarm_value: float | None = None

    @property
    def rolling(self) -> float | None:
        """Mean committed tokens per round over the last ``window`` rounds (None before any round)."""
        return self._sum / len(self._last) if self._last else None

    def observe(self, committed: int) -> None:
        """Record one verify round that committed ``committed`` tokens (>= 1). Raises AcceptLengthAlarm in
        strict mode when the rolling mean over a full window is at or below the threshold."""
        if len(self._last) == self.window:
            self._sum -= self._last[0]
        self._last.append(int(committed))
        self._sum += int(committed)
        self.rounds += 1
        if len(self._last) < self.window:
            return
        value = self._sum / self.window
        if value <= self.threshold:
            if not self.alarm:
                self.alarm, self.alarms = True, self.alarms + 1
                self.first_alarm_round = self.first_alarm_round or self.rounds
                self.last_alarm_value = value
                log.error("%s", self.message())
            self.last_alarm_value = value
            if self.strict:
                raise AcceptLengthAlarm(self.message())
        elif self.alarm:
            self.alarm = False
            log.warning("accept-length watchdog: recovered, rolling accept length %.3f over the last %d rounds",
                        value, self.window)

    def message(self) -> str:
        v = self.rolling
        return (f"accept-length watchdog ALARM (lever: MTP / draft sharing): rolling accept length "
                f"{v:.3f} over the last {self.window} verify rounds <= threshold {self.threshold:.3f} "
                f"(round {self.rounds}); drafts are not being accepted - speculative decoding is slower than "
                f"plain decoding. Check the draft's LM head (must be the target's module) and the FP8 head scales.")

    def state(self) -> dict:
        """JSON-serialisable state for metrics and the manifest."""
        r = self.rolling
        return {"window": self.window, "threshold": self.threshold, "strict": self.strict, "rounds": self.rounds,
                "rolling_accept_length": None if r is None else round(r, 4),
                "window_full": len(self._last) == self.window, "alarm": self.alarm, "alarms": self.alarms,
                "first_alarm_round": self.first_alarm_round,
                "last_alarm_value": None if self.last_alarm_value is None else round(self.last_alarm_value, 4)}


def watch_rounds(source, stats, watchdog: AcceptWatchdog | None):
    """Pass ``(token, round)`` pairs from ``mtp_tokens`` through, feeding ``watchdog`` once per verify round.

    ``mtp_tokens`` updates ``stats`` (a ``SpecStats``) for round r before yielding r's first token, so the
    round's count (accepted drafts + 1) is known at that point and the alarm fires before its tokens leave.
    """
    if watchdog is None:
        yield from source
        return
    last, acc = 0, 0
    try:
        for tok, rnd in source:
            if rnd != last and rnd > 0:
                now = sum(stats.accepted_at)
                last, accepted, acc = rnd, now - acc, now
                watchdog.observe(accepted + 1)
            yield tok, rnd
    finally:
        source.close()
