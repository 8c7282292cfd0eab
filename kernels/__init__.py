"""Paged-attention kernels behind one function, `paged_attention(..., impl=...)`.

Each implementation lives in its own module; see kernels/reference.py for the shared
shape contract. `impl` names:
  reference  gather to dense + masked softmax (the oracle)
"""
from kernels.reference import paged_attention_ref

IMPLS = ('reference',)


def paged_attention(q, k_pages, v_pages, block_tables, context_lens, q_positions, *,
                    impl='reference', scale=None):
  """Attention of queries over a paged KV cache; see kernels/reference.py for shapes."""
  if impl == 'reference':
    return paged_attention_ref(q, k_pages, v_pages, block_tables, context_lens, q_positions,
                               scale=scale)
  raise ValueError(f'attention impl {impl!r} is not one of {IMPLS}')
