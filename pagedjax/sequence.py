"""A request's life on the host: its tokens, its block table, and how much of it is cached."""
import dataclasses
import enum
from typing import List, Optional

from pagedjax.sampling import SamplingParams


class Status(enum.Enum):
  WAITING = 'waiting'
  RUNNING = 'running'
  FINISHED = 'finished'


@dataclasses.dataclass
class Sequence:
  request_id: int
  prompt_ids: List[int]
  params: SamplingParams
  output_ids: List[int] = dataclasses.field(default_factory=list)
  block_table: List[int] = dataclasses.field(default_factory=list)
  num_cached: int = 0  # leading tokens whose K/V are in the pool
  status: Status = Status.WAITING
  finish_reason: Optional[str] = None  # 'eos' | 'length' | 'max_seq_len'
  num_preemptions: int = 0

  @property
  def all_ids(self) -> List[int]:
    return self.prompt_ids + self.output_ids

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_ids) + len(self.output_ids)

  @property
  def num_pending(self) -> int:
    """Tokens not yet in the cache: the prompt (or, after preemption, everything) then, while
    decoding, the one token sampled last step."""
    return self.num_tokens - self.num_cached


@dataclasses.dataclass
class Completion:
  request_id: int
  prompt_ids: List[int]
  output_ids: List[int]
  finish_reason: str
  num_preemptions: int = 0
  text: Optional[str] = None
  logits: Optional[list] = None  # per generated token, [V] float32 (only when recorded)
