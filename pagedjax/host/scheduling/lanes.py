"""Lanes: a running sequence's row in per-sequence device state (the recent-window rings of a
quantized pool, pagedjax/device/pool.py). Lanes 1..max_batch_size are handed out; lane 0 is the
null lane that padded rows write into, like the null block."""
from typing import Iterable, List, Tuple

from pagedjax.host.requests.sequence import Sequence


class Lanes:

  def __init__(self, max_batch_size: int):
    self._free = list(range(max_batch_size, 0, -1))  # pop() hands out low lanes first

  def assign(self, running: Iterable[Sequence]) -> List[Tuple[Sequence, int]]:
    """Every running sequence without a lane takes one; returns (sequence, lane) of those."""
    given = []
    for seq in running:
      if not seq.lane:
        seq.lane = self._free.pop()
        given.append((seq, seq.lane))
    return given

  def release(self, seq: Sequence) -> None:
    if seq.lane:
      self._free.append(seq.lane)
      seq.lane = 0
