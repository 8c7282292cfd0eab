"""A request's life on the host: its tokens, its block table, and how much of it is cached."""
import dataclasses
import enum
from typing import List, Optional

from pagedjax.host.requests.sampling_params import SamplingParams


class Status(enum.Enum):
  PENDING = 'pending'  # submitted, but its arrival time has not come yet
  WAITING = 'waiting'  # visible to the scheduler, holds no blocks
  RUNNING = 'running'  # holds device blocks, takes part in steps
  SWAPPED = 'swapped'  # preempted by swap: its cached K/V sit in the host tier
  FINISHED = 'finished'


@dataclasses.dataclass
class Sequence:
  request_id: int
  prompt_ids: List[int]
  params: SamplingParams
  arrival_time: float = 0.0  # engine clock seconds; FCFS order is (arrival_time, request_id)
  output_ids: List[int] = dataclasses.field(default_factory=list)
  block_table: List[int] = dataclasses.field(default_factory=list)
  host_blocks: List[int] = dataclasses.field(default_factory=list)  # while SWAPPED
  kv_tail: Optional[tuple] = None  # swapped from a KIVI pool: (num_cached, host copy of its
  # partial last block's unquantized keys), put back in its lane before it runs (executor.py)
  # Offload (host/scheduling/offload.py): the host-RAM blocks of this sequence's leading logical blocks, in
  # order; block_table then holds the logical blocks after them. window: the most device blocks
  # it may hold (0 = no limit).
  host_table: List[int] = dataclasses.field(default_factory=list)
  window: int = 0
  num_cached: int = 0  # leading tokens whose K/V are in the pool (or, swapped, in the host tier)
  max_cached: int = 0  # the most num_cached has been: positions below it fed again after a
  # recompute preemption are recomputed work (executor.py counts them)
  block_keys: List[int] = dataclasses.field(default_factory=list)  # prefix-cache chain keys of
  # the full blocks of all_ids computed so far (block_manager.py)
  num_offered: int = 0  # leading blocks of block_table already offered to the prefix cache
  forks: List['Sequence'] = dataclasses.field(default_factory=list)  # parallel samples not yet
  # forked: they split off once this leader has cached all but its last prompt token
  lane: int = 0  # recent-window lane while running (pool.py); 0 = none
  status: Status = Status.WAITING
  finish_reason: Optional[str] = None  # 'eos' | 'length' | 'max_seq_len'
  num_preemptions: int = 0
  first_token_time: Optional[float] = None
  finish_time: Optional[float] = None
  group_id: Optional[int] = None  # parallel samples (SamplingParams.n): the first sample's id
  beam: Optional[object] = None  # the BeamGroup (beam.py) of a beam-search request's beams
  extra_rows: int = 0  # batch rows reserved for beams not forked yet (a beam leader's k - 1)

  @property
  def order(self):
    """FCFS priority: earlier arrivals first; preemption takes the last. The running and swapped
    queues keep this order; the waiting queue keeps the queue-order policy's (scheduler.queue_order,
    host/policies.py; 'fcfs' is this key)."""
    return (self.arrival_time, self.request_id)

  @property
  def width(self) -> int:
    """Batch rows this sequence will take: itself, its pending forks and reserved beams."""
    return 1 + len(self.forks) + self.extra_rows

  @property
  def num_to_prefill(self) -> int:
    """Pending tokens to feed as prompt chunks: a leader keeps its last prompt token back for
    its forks, which each feed it as their own first decode (each samples with its own seed)."""
    return self.num_pending - (1 if self.forks else 0)

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

  def finish_reason_now(self, eos_id: Optional[int], max_seq_len: int) -> Optional[str]:
    """Why the sequence finishes after its latest token ('eos', 'length', 'max_seq_len'), or
    None while it goes on."""
    if self.params.stop_on_eos and eos_id is not None and self.output_ids[-1] == eos_id:
      return 'eos'
    if len(self.output_ids) >= self.params.max_new_tokens:
      return 'length'
    if self.num_tokens >= max_seq_len:
      return 'max_seq_len'
    return None


@dataclasses.dataclass
class Completion:
  request_id: int
  prompt_ids: List[int]
  output_ids: List[int]
  finish_reason: str
  num_preemptions: int = 0
  text: Optional[str] = None
  logits: Optional[list] = None  # per generated token, [V] float32 (only when recorded)
  arrival_time: float = 0.0  # engine clock seconds, like the two below
  first_token_time: Optional[float] = None
  finish_time: Optional[float] = None
  group_id: Optional[int] = None  # parallel samples (SamplingParams.n): the first sample's id
  score: Optional[float] = None  # beam search: the best hypothesis's score (beam.py)
  beams: Optional[list] = None  # beam search: (output_ids, score) of the k best, best first
