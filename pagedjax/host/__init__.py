"""Host side: plain Python + numpy bookkeeping between jitted steps (allocator, block manager,
scheduler, sequences, prefix caches, beam bookkeeping, metrics, step-input building). Nothing
here imports jax, flax, the device or model packages, or kernels (tests/test_layers.py)."""
