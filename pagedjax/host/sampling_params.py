"""What a request asks of sampling: plain, validated parameters (the device side samples with
them inside the jitted step, pagedjax/device/sampling.py)."""
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters.

  n: parallel samples of one prompt. The engine prefills the prompt once and forks n sequences
  that share its blocks (copy-on-write); sample i draws with seed `seed + i`.
  cache_salt: requests share cached prefix blocks only with requests of the same salt.
  beam_width: k > 0 runs beam search with k beams (beam.py) instead of sampling; 0 is off.
  length_penalty: alpha of GNMT's ((5 + len) / 6) ** alpha dividing a finished beam's summed
  log-prob (beam search only; 0 ranks by summed log-prob).
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

  def validate(self):
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f'max_new_tokens={self.max_new_tokens!r} is not allowed: an integer >= 1')
    if not self.temperature >= 0:
      raise ValueError(f'temperature={self.temperature!r} is not allowed: a number >= 0 (0 is greedy)')
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f'top_k={self.top_k!r} is not allowed: an integer >= 0 (0 disables it)')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p={self.top_p!r} is not allowed: a number in (0, 1] (1 disables it)')
    if not isinstance(self.n, int) or self.n < 1:
      raise ValueError(f'n={self.n!r} is not allowed: an integer >= 1 (parallel samples)')
    if not isinstance(self.beam_width, int) or self.beam_width < 0:
      raise ValueError(f'beam_width={self.beam_width!r} is not allowed: an integer >= 0 '
                       '(0 is off)')
    if self.beam_width and (self.n > 1 or self.temperature > 0):
      raise ValueError(f'beam_width={self.beam_width} is not allowed with n={self.n} or '
                       f'temperature={self.temperature}: beam search is deterministic and '
                       'returns its beams itself')
    if not self.length_penalty >= 0:
      raise ValueError(f'length_penalty={self.length_penalty!r} is not allowed: a number >= 0')
