"""A recorded alert on the windowed prefix hit rate, and the admission throttle it drives.

A recomputation storm: the prefix most prompts share changes (a deployment ships a new system
prompt), and until the new one has been computed and cached once, every request misses it and
prefills it in full, several of them at once. The prefix cache's hit rate collapses and TTFT
spikes. This module sees the collapse and records it.

Windowed hit rate: prefix-cache hit tokens / queried tokens (counted at admission,
host/scheduling/block_manager.py) over the last `window` iterations. Iterations without a lookup add no
weight; the rate is None while the window holds no lookup.

Alert: fires when the windowed rate falls below (1 - drop) x its recent level, and clears once
the windowed rate is back at (1 - drop) x the level it fell from. The recent level is the rate of
the `window` iterations just before the current window; when those held no lookup (light
traffic), the last such rate seen. Comparing with the window before, not with a fixed target, lets
one config serve traces whose steady hit rates differ; a fall spread over more than two windows is
a drift, not a storm, and does not fire. Each firing is recorded (`HitRateAlert`):
iteration and engine-clock time, the level before and the rate at firing, the lowest rate while
active, and when it cleared.

Throttle: while the alert is active, `prefill_cap` is throttle_prefill_tokens (the engine hands it
to Scheduler.prefill_cap, which caps the prompt tokens an iteration computes; decodes are not
capped). Then the first requests to meet the new prefix compute and cache it before a crowd of
others prefill it again, each for itself, and the ones admitted later hit it.
"""
import collections
import dataclasses
from typing import List, Optional


@dataclasses.dataclass
class HitRateAlert:
  """One firing of the hit-rate alert."""
  fired_iteration: int
  fired_t: float  # engine-clock seconds
  hit_rate_before: float  # the recent level it fell from (the window before)
  hit_rate_after: float  # the windowed rate when it fired
  min_hit_rate: float  # the lowest windowed rate while it was active
  cleared_iteration: Optional[int] = None  # None: still active when the run ended
  cleared_t: Optional[float] = None
  hit_rate_cleared: Optional[float] = None  # the windowed rate when it cleared


class _Window:
  """Sums of (queried, hit) tokens over the last `size` iterations."""

  def __init__(self, size: int):
    self.size, self.rows = size, collections.deque()
    self.queried = self.hit = 0

  def push(self, queried: int, hit: int) -> Optional[tuple]:
    """Adds one iteration's counts; returns the row that left the window, if one did."""
    self.rows.append((queried, hit))
    self.queried, self.hit = self.queried + queried, self.hit + hit
    if len(self.rows) <= self.size:
      return None
    old = self.rows.popleft()
    self.queried, self.hit = self.queried - old[0], self.hit - old[1]
    return old

  @property
  def rate(self) -> Optional[float]:
    return self.hit / self.queried if self.queried else None


class HitRateMonitor:
  """Feeds on each iteration's prefix lookups; keeps the windowed rate, the alert and the cap."""

  def __init__(self, window: int = 32, drop: float = 0.0, throttle_prefill_tokens: int = 0):
    """window: iterations; drop: the fraction the rate must fall below its recent level for the
    alert to fire (0: never); throttle_prefill_tokens: prompt tokens per iteration while the
    alert is active (0: no throttle)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
      raise ValueError(f'window={window!r} is not allowed: an integer >= 1 (iterations)')
    if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop < 1:
      raise ValueError(f'drop={drop!r} is not allowed: a fraction in [0, 1) (0 = no alert)')
    if (isinstance(throttle_prefill_tokens, bool) or not isinstance(throttle_prefill_tokens, int)
        or throttle_prefill_tokens < 0):
      raise ValueError(f'throttle_prefill_tokens={throttle_prefill_tokens!r} is not allowed: '
                       'an integer >= 0 (0 = no throttle)')
    if throttle_prefill_tokens and not drop:
      raise ValueError(f'throttle_prefill_tokens={throttle_prefill_tokens} needs drop > 0: the '
                       'alert turns the throttle on and off')
    self.window, self.drop = window, drop
    self.throttle_prefill_tokens = throttle_prefill_tokens
    self._current, self._earlier = _Window(window), _Window(window)
    self.level: Optional[float] = None  # None until a window before held a lookup
    self.alerts: List[HitRateAlert] = []
    self.min_rate: Optional[float] = None  # lowest windowed rate once a recent level existed
    self.active_iterations = 0  # iterations that ended with the alert active

  @property
  def rate(self) -> Optional[float]:
    """The windowed hit rate now (None: no lookup in the window)."""
    return self._current.rate

  @property
  def active(self) -> bool:
    return bool(self.alerts) and self.alerts[-1].cleared_iteration is None

  @property
  def prefill_cap(self) -> Optional[int]:
    """Prompt tokens per iteration at most while the alert is active; None otherwise."""
    return self.throttle_prefill_tokens if self.active and self.throttle_prefill_tokens else None

  def observe(self, iteration: int, t: float, queried_tokens: int, hit_tokens: int) -> None:
    """One iteration's lookups (tokens queried and found at admission)."""
    left = self._current.push(queried_tokens, hit_tokens)
    if left is not None:
      self._earlier.push(*left)
    if self._earlier.rate is not None:
      self.level = self._earlier.rate
    rate, level = self._current.rate, self.level
    if rate is not None and level is not None:
      self.min_rate = rate if self.min_rate is None else min(self.min_rate, rate)
    if self.active:
      alert = self.alerts[-1]
      if rate is not None:
        alert.min_hit_rate = min(alert.min_hit_rate, rate)
        if rate >= (1 - self.drop) * alert.hit_rate_before:
          alert.cleared_iteration, alert.cleared_t, alert.hit_rate_cleared = iteration, t, rate
    elif (self.drop and rate is not None and level is not None and
          rate < (1 - self.drop) * level):
      self.alerts.append(HitRateAlert(iteration, t, level, rate, rate))
    self.active_iterations += self.active

  def figures(self) -> dict:
    """The run's alert figures (summary.json)."""
    return {
        'prefix_hit_rate_window': self.window,
        'prefix_hit_rate_windowed_min': self.min_rate,
        'hit_rate_alert_drop': self.drop,
        'hit_rate_alerts_fired': len(self.alerts),
        'hit_rate_alerts_cleared': sum(a.cleared_iteration is not None for a in self.alerts),
        'hit_rate_alert_iterations': self.active_iterations,
        'hit_rate_alerts': [dataclasses.asdict(a) for a in self.alerts],
    }
