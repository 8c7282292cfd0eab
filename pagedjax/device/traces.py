"""One count of the device programs traced in this process: the step (every variant) and the block
copies and transfers. jit traces a function exactly when it meets a new input shape signature
and then compiles it, so a trace is a compilation. The engine charges the count's growth during
its own calls to its compilation figure (pagedjax/executor.py); tests bound it."""
_count = [0]


def record() -> None:
  """Called inside a traced function body: runs at trace time only."""
  _count[0] += 1


def count() -> int:
  return _count[0]
