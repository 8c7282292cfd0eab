"""Sessions: the cached blocks of a conversation's turns, kept and evicted as one unit.

A request may name a session (SamplingParams.session_id; prefix caching on). When one of its
turns finishes, the cached blocks of its block table (full blocks of its prompt and generated
tokens, offered to the prefix cache as they filled) that no other sequence holds become that
session's (a block shared with running sequences, such as a system prompt, keeps its own order;
one shared only across time belongs to the session that used it last). The next turn
resends the history, so its lookup matches them like any cached prefix.

The prefix cache (prefix_cache.py) orders its evictable blocks by session before anything else,
under its own eviction policy:
  lru  the session whose last turn ended longest ago goes first, all of its blocks one after
       another (deepest first: a finished turn releases its blocks tail first)
  lfu  the session with the fewest turns goes first, least recently used among equals (a block
       hit more often than its session has turns counts its hits)
A block of no session keeps its place by its own release time (lru) or hits (lfu), on the same
clock, so sessions and other cached prefixes compete fairly.

idle_timeout_s > 0: a session whose last turn ended that long ago (engine clock) is demoted as a
unit at the start of the next iteration: its idle device blocks are evicted at once, written
back to the lower KV tiers when there are any (kv_tiers.py), dropped otherwise. That frees the
device for active sessions before anyone has to wait; its next turn finds the blocks below.
"""
from typing import Dict, List, Optional, Set


class Sessions:

  def __init__(self, idle_timeout_s: float = 0.0):
    self.idle_timeout_s = idle_timeout_s
    self._session_of: Dict[int, str] = {}  # cached block -> its session
    self._blocks: Dict[str, Set[int]] = {}  # session -> its cached blocks
    self._tick: Dict[str, int] = {}  # session -> cache clock tick of its last turn's end
    self._turns: Dict[str, int] = {}  # session -> finished turns
    self._ended_s: Dict[str, float] = {}  # session -> engine clock of its last turn's end
    self._idle: Set[str] = set()  # sessions demoted since their last turn
    self.idle_demotions = self.idle_demoted_blocks = 0

  def __len__(self) -> int:
    return len(self._turns)

  def end_turn(self, session: str, blocks: List[int], tick: int, now: float) -> None:
    """A turn of session finished holding `blocks` (cached ones): they become the session's."""
    owned = self._blocks.setdefault(session, set())
    for block in blocks:
      previous = self._session_of.get(block)
      if previous is not None and previous != session:
        self._blocks[previous].discard(block)
      self._session_of[block] = session
      owned.add(block)
    self._tick[session] = tick
    self._turns[session] = self._turns.get(session, 0) + 1
    self._ended_s[session] = now
    self._idle.discard(session)

  def order(self, block: int) -> Optional[tuple]:
    """(turns, tick of the last turn's end) of block's session, or None: the cache's sort key."""
    session = self._session_of.get(block)
    if session is None:
      return None
    return self._turns[session], self._tick[session]

  def forget(self, block: int) -> None:
    """The block left the device cache (evicted)."""
    session = self._session_of.pop(block, None)
    if session is not None:
      self._blocks[session].discard(block)

  def idle(self, now: float) -> List[str]:
    """Sessions idle for idle_timeout_s and not yet demoted, longest idle first."""
    if not self.idle_timeout_s:
      return []
    due = [s for s, t in self._ended_s.items()
           if s not in self._idle and now - t >= self.idle_timeout_s]
    return sorted(due, key=self._ended_s.get)

  def blocks(self, session: str) -> List[int]:
    return list(self._blocks.get(session, ()))

  def demoted(self, session: str, num_blocks: int) -> None:
    self._idle.add(session)
    self.idle_demotions += 1
    self.idle_demoted_blocks += num_blocks

  def figures(self) -> dict:
    return {'sessions': len(self._turns), 'session_turns': sum(self._turns.values()),
            'session_idle_demotions': self.idle_demotions,
            'session_idle_demoted_blocks': self.idle_demoted_blocks}
