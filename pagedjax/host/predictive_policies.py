"""Eviction policies that predict a conversation's return from what the cache has seen of it.

Both are plug-ins of the eviction registry (host/policies.py) and need sessions (sessions.py):
a block's priority is fixed when its conversation's turn releases it, from features of that
release the queue computes from its own event stream, so the same class runs in an engine
(config.prefix_cache.eviction = 'pagedjax.host.predictive_policies:ReturnPredictor', with fitted
weights set on a subclass) and in the policy lab (experiments/policy_lab.py), which fits the
weights on the first half of a trace and evaluates them on the second.

Features of one release (one finished turn of a session, or one release of a sequence without a
session), all counted by the queue:
  turns      the session's finished turns (1 for a first turn, and without a session)
  think      ticks (block releases) from the release of the deepest block this turn hit (its
             previous turn's) to this release; 0, and `first` = 1, for a first turn or one that
             hit nothing
  prompt     blocks released (the deepest block's depth + 1: a turn releases tail first)
  new        blocks of it that were not hits (computed by this turn: the new message, and the
             previous answer)
The design vector (FEATURES) is a fixed transform of them; `weights` are logistic-regression
weights over it for P(the conversation is read again), `delay_weights` linear-regression weights
for log(ticks until it is, given that it is). Defaults are a prior, not a fit: P rises with
turns (the one strong signal on Mooncake's trace), everything else 0.

  ReturnPredictor       LRU with a bonus: priority = release tick + horizon * P(return), so a
                        conversation likely to come back outlives one that is not by up to
                        `horizon` ticks (the lab sets it in cache capacities).
  LearnedReuseDistance  Belady on predictions: the block whose predicted next use,
                        release tick + predicted delay / P(return), is furthest goes first (an
                        expected wait: a return that is half as likely is expected twice as far
                        off), the deepest of a release first.

`Recorder` is ReturnPredictor that also keeps, per release, its features and when (if ever) a
block of it was read again: what the lab fits the weights from.
"""
import math
from typing import Dict, Hashable, List, Optional

from pagedjax.host.policies import HeapQueue

FEATURES = ('bias', 'log_turns', 'first', 'log1p_think', 'log1p_prompt', 'log1p_new',
            'new_8_or_more', 'was_hit', 'log1p_hits', 'depth_share', 'log1p_depth')


def design(turns: int, think: int, first: bool, prompt: int, new: int, hits: int,
           depth: int) -> List[float]:
  """The design vector of one block of a release (FEATURES, in that order): the release's
  features, then the block's own: whether this turn hit it, its hits since it was cached, its
  depth as a share of the prompt, and its depth."""
  return [1.0, math.log(max(turns, 1)), float(first), math.log1p(max(think, 0)),
          math.log1p(prompt), math.log1p(new), float(new >= 8), float(hits > 0),
          math.log1p(hits), depth / max(prompt, 1), math.log1p(depth)]


def sigmoid(z: float) -> float:
  return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


class ConversationFeatures(HeapQueue):
  """HeapQueue that computes the features of each release (module docstring) and calls
  score(x, major, depth) for the priority of each block it pushes."""

  weights = (-0.6, 0.9) + (0.0,) * (len(FEATURES) - 2)
  delay_weights = (9.0,) + (0.0,) * (len(FEATURES) - 1)

  def __init__(self):
    super().__init__()
    self._now = -1
    self._major_of: Dict[Hashable, int] = {}  # key -> release tick of its last release
    self._hit_majors: List[tuple] = []  # (depth, release tick) of the blocks hit since the
    self.hit_keys: set = set()  # last release, and the keys hit: the rest of a release is new
    self._group = None  # (major, x, p) of the release being pushed
    self._new_keys: set = set()  # the keys the release being pushed hit
    self._x = None  # the design vector of the block being pushed
    self._last_depth = None

  def tick(self) -> int:
    self._now = super().tick()
    return self._now

  def hit(self, key):
    super().hit(key)
    self.hit_keys.add(key)
    major = self._major_of.get(key)
    if major is not None:
      self._hit_majors.append((self.depth[key], major))

  def remove(self, key):
    super().remove(key)
    self._major_of.pop(key, None)

  def probability(self, x) -> float:
    return sigmoid(sum(w * v for w, v in zip(self.weights, x)))

  def delay(self, x) -> float:
    """Predicted ticks from a release to its conversation's next read (given that it comes)."""
    return math.exp(min(sum(w * v for w, v in zip(self.delay_weights, x)), 50.0))

  def _release(self, key, session):
    """(major, x, p, new group?) of the release key belongs to."""
    depth = self.depth[key]
    if session is not None:
      turns, major = session
      new_group = self._group is None or self._group[0] != major
    else:
      turns, major = 1, None
      new_group = self._group is None or self._last_depth is None or depth >= self._last_depth
    self._last_depth = depth
    if not new_group:
      return self._group, False
    if major is None:
      major = self._now + 1
    hits = self._hit_majors
    first = turns <= 1 or not hits
    think = 0 if first else major - max(hits)[1]  # the deepest hit: the conversation's own
    prompt = depth + 1
    release = (turns, think, first, prompt, max(prompt - len(hits), 0))
    self._hit_majors = []
    self._new_keys, self.hit_keys = self.hit_keys, set()  # this release's hits
    self._group = (major, release)
    return self._group, True

  def push(self, key, session=None):
    (major, release), new_group = self._release(key, session)
    self._major_of[key] = major
    x = design(*release, self.hits[key], self.depth[key])
    self._x = x
    self.released(key, major, x, new_group)
    super().push(key, session)

  def released(self, key, major, x, new_group) -> None:
    """A hook: key was released as part of the release at `major` (Recorder listens)."""

  def priority(self, key, tick, session):
    x = self._x
    return self.score(self._group[0], x, self.probability(x)) + (tick,)

  def score(self, major: int, x, p: float) -> tuple:
    raise NotImplementedError


class ReturnPredictor(ConversationFeatures):
  """LRU by release tick plus horizon * P(return) (module docstring)."""

  horizon = 4096.0  # ticks

  def score(self, major, x, p):
    return (major + self.horizon * p,)


class LearnedReuseDistance(ConversationFeatures):
  """Furthest predicted next use first: release tick + delay(x) / P(return)."""

  def score(self, major, x, p):
    wait = self.delay(x) / p if p > 0 else math.inf
    return (-(major + wait),)


class Recorder(ReturnPredictor):
  """ReturnPredictor that records, per block released: the release's tick, the block's design
  vector, and the tick of its next read (None: never). `releases` lists them in order."""

  def __init__(self):
    super().__init__()
    self.releases: List[dict] = []
    self._release_of: Dict[Hashable, int] = {}  # key -> index in releases

  def released(self, key, major, x, new_group):
    self.releases.append({'major': major, 'x': x, 'read_at': None})
    self._release_of[key] = len(self.releases) - 1

  def hit(self, key):
    super().hit(key)
    i = self._release_of.get(key)
    if i is not None and self.releases[i]['read_at'] is None:
      self.releases[i]['read_at'] = self._now

  def remove(self, key):
    super().remove(key)
    self._release_of.pop(key, None)


def fitted(cls, weights, delay_weights=None, **attributes) -> type:
  """A subclass of cls with these weights (and attributes): what an engine config can name."""
  fields = {'weights': tuple(weights), **attributes}
  if delay_weights is not None:
    fields['delay_weights'] = tuple(delay_weights)
  return type(f'Fitted{cls.__name__}', (cls,), fields)
