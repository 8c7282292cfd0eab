"""How kernels/xla.py splits a batch into independent loops, in plain Python (no jax), so that
the simulator's cost model (pagedjax/sim/cost_model.py, 'batch_max' attention) walks exactly the
spans the kernel walks."""
from typing import List

# Independent loops over slices of the batch (or of the context, for fewer sequences).
SEQ_SPLITS = 2
# Decode splits the batch only when every loop gets at least this many sequences: a loop step's
# fixed cost is paid once per loop, and over few rows it outweighs what separate loops gain
# (docs/attention.md, "How the xla kernel is built").
MIN_LOOP_ROWS = 32


def batch_bounds(batch: int, tokens_per_row: int) -> List[int]:
  """Row boundaries of the kernel's batch loops for `batch` rows of `tokens_per_row` query
  tokens each (batch >= SEQ_SPLITS): loop i takes rows [bounds[i], bounds[i + 1]) and walks
  to their longest context."""
  min_rows = MIN_LOOP_ROWS if tokens_per_row == 1 else 1
  loops = max(1, min(SEQ_SPLITS, batch // min_rows))
  return [batch * i // loops for i in range(loops + 1)]
