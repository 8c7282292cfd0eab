"""What a request asks of sampling: plain, validated parameters (the device side samples with
them inside the jitted step, pagedjax/device/sampling.py).

A request's parameters may also be given as a dict of these fields (`as_params`): it is
SamplingParams(**d), with the same validation, and None is the defaults.
"""
import dataclasses
import math
import numbers
import re
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters.

  n: parallel samples of one prompt. The engine prefills the prompt once and forks n sequences
  that share its blocks (copy-on-write); sample i draws with seed `seed + i`.
  cache_salt: requests share cached prefix blocks only with requests of the same salt.
  beam_width: k > 0 runs beam search with k beams (beam.py) instead of sampling; 0 is off.
  length_penalty: alpha of GNMT's ((5 + len) / 6) ** alpha dividing a finished beam's summed
  log-prob (beam search only; 0 ranks by summed log-prob).
  priority: lower values are more important (vLLM's convention); preemption with
  scheduler.victim='priority' takes the largest value first.
  session_id: the conversation this request is a turn of (prefix caching on): when it finishes,
  its blocks stay cached as the session's and are evicted or demoted as one unit with the rest
  of that session (host/cache/sessions.py); the next turn matches them as any prefix.
  """
  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_on_eos: bool = True
  n: int = 1
  cache_salt: Optional[str] = None
  beam_width: int = 0
  length_penalty: float = 0.0
  priority: int = 0
  session_id: Optional[str] = None

  def validate(self):
    """Raises ValueError naming the first field whose type or range is not allowed. Ranges are
    what the step can carry: seeds (with the per-sample offsets seed + i) and top_k travel as
    int32."""
    _integer('max_new_tokens', self.max_new_tokens, 1, INT32_MAX, 'an integer >= 1')
    _number('temperature', self.temperature, f'a number in [0, {FLOAT32_MAX:.7g}] (0 is greedy; '
            'the step carries it as float32)', high=FLOAT32_MAX)
    _integer('top_k', self.top_k, 0, INT32_MAX, f'an integer in [0, {INT32_MAX}] (0 disables it)')
    _number('top_p', self.top_p, 'a number in (0, 1] (1 disables it)', low=0, closed_low=False,
            high=1)
    _integer('n', self.n, 1, INT32_MAX, 'an integer >= 1 (parallel samples)')
    _integer('seed', self.seed, INT32_MIN, INT32_MAX - (self.n - 1),
             f'an integer in [{INT32_MIN}, {INT32_MAX - (self.n - 1)}] (sample i of n={self.n} '
             'draws with seed + i, an int32)')
    if not isinstance(self.stop_on_eos, bool):
      raise ValueError(f'stop_on_eos={brief(self.stop_on_eos)} is not allowed: True or False')
    if self.cache_salt is not None and not is_text(self.cache_salt):
      raise ValueError(f'cache_salt={brief(self.cache_salt)} is not allowed: None or a string '
                       '(valid Unicode: it is hashed as UTF-8)')
    _integer('beam_width', self.beam_width, 0, INT32_MAX, 'an integer >= 0 (0 is off)')
    if self.beam_width and (self.n > 1 or self.temperature > 0):
      raise ValueError(f'beam_width={self.beam_width} is not allowed with n={self.n} or '
                       f'temperature={self.temperature}: beam search is deterministic and '
                       'returns its beams itself')
    _number('length_penalty', self.length_penalty, 'a finite number >= 0')
    _integer('priority', self.priority, INT32_MIN, INT32_MAX, 'an integer (lower is served first)')
    if self.session_id is not None and (not is_text(self.session_id) or not self.session_id):
      raise ValueError(f'session_id={brief(self.session_id)} is not allowed: None or a non-empty '
                       'string (valid Unicode)')


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def as_params(value) -> SamplingParams:
  """A request's sampling parameters: a SamplingParams as is, a dict of its fields as
  SamplingParams(**value), None as the defaults; raises ValueError naming anything else (and any
  key that is not a field). Validation is still `validate`'s."""
  if isinstance(value, SamplingParams):
    return value
  if value is None:
    return SamplingParams()
  if isinstance(value, Mapping):
    unknown = [k for k in value if k not in FIELDS]
    if unknown:
      raise ValueError(f'params: {brief(unknown)} not fields of SamplingParams: allowed keys '
                       f'{", ".join(FIELDS)}')
    return SamplingParams(**value)
  raise ValueError(f'params={brief(value)} ({type(value).__name__}) is not allowed: a '
                   'SamplingParams, a dict of its fields, or None (the defaults)')


def is_text(value) -> bool:
  """A str that encodes as UTF-8 (no lone surrogates), as salts must to be hashed."""
  if not isinstance(value, str):
    return False
  try:
    value.encode('utf-8')
  except UnicodeEncodeError:
    return False
  return True


def brief(value, limit: int = 60) -> str:
  """repr(value) cut to about `limit` characters, for error messages. Never raises: an int too
  long for str() (Python refuses beyond 4300 digits) is named by its size."""
  try:
    text = repr(value)
  except ValueError:  # an int of over 4300 digits, or a container holding one
    if isinstance(value, int):
      text = f'<int of {value.bit_length()} bits>'
    elif isinstance(value, (list, tuple)):
      items = ', '.join(brief(v, limit) for v in value[:5]) + (', ...' if len(value) > 5 else '')
      text = f'[{items}]' if isinstance(value, list) else f'({items})'
    else:
      text = f'<{type(value).__name__} holding an int too long to print>'
  text = re.sub(r'\n\s*', ' ', text)  # numpy arrays print over several lines
  return text if len(text) <= limit else text[:limit - 3] + '...'


def _integer(name, value, low, high, allowed):
  # numbers.Integral covers numpy integers; bool is an int in Python but never a count here.
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not (
      low <= value <= high):
    raise ValueError(f'{name}={brief(value)} is not allowed: {allowed}')


def _number(name, value, allowed, low=0, closed_low=True, high=math.inf):
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value):
    raise ValueError(f'{name}={brief(value)} is not allowed: {allowed}')
  if not (value >= low if closed_low else value > low) or value > high:
    raise ValueError(f'{name}={brief(value)} is not allowed: {allowed}')


def _finite(value: numbers.Real) -> bool:
  """math.isfinite, with an int too large for a float (which would overflow it) not finite."""
  try:
    return math.isfinite(value)
  except OverflowError:
    return False
