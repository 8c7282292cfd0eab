"""CPU time on this machine, read from /proc (Linux): what the benchmarks set beside their wall
clock. Each reader returns None (or {}) where /proc is missing or a process is gone."""
import os
from typing import Dict, Optional, Tuple

TICKS_PER_S = os.sysconf('SC_CLK_TCK') if hasattr(os, 'sysconf') else 100


def _stat(pid) -> Optional[Tuple[int, int]]:
  """(parent pid, user + system ticks) of process `pid` (/proc/PID/stat)."""
  try:
    with open(f'/proc/{int(pid)}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()  # the name, in parentheses, may hold spaces
    return int(fields[1]), int(fields[11]) + int(fields[12])
  except (OSError, ValueError, IndexError, TypeError):
    return None


def process_cpu_s(pid) -> Optional[float]:
  """CPU seconds (user + system) process `pid` has run so far."""
  stat = _stat(pid)
  return None if stat is None else stat[1] / TICKS_PER_S


def tree_ticks(pid: int) -> Dict[int, int]:
  """{pid: user + system ticks} of process `pid` and every descendant."""
  table = {}
  for entry in os.listdir('/proc') if os.path.isdir('/proc') else ():
    if entry.isdigit():
      stat = _stat(entry)
      if stat is not None:
        table[int(entry)] = stat
  tree, frontier = {pid}, [pid]
  while frontier:
    parent = frontier.pop()
    for child, (ppid, _) in table.items():
      if ppid == parent and child not in tree:
        tree.add(child)
        frontier.append(child)
  return {p: table[p][1] for p in tree if p in table}


def tree_cpu_s(pid: int) -> float:
  """CPU seconds of process `pid` and its descendants."""
  return sum(tree_ticks(pid).values()) / TICKS_PER_S


def machine_busy_s() -> Optional[float]:
  """CPU seconds every process on this machine has run so far (/proc/stat: all but idle and
  iowait)."""
  try:
    with open('/proc/stat') as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
  return (sum(fields) - idle) / TICKS_PER_S
