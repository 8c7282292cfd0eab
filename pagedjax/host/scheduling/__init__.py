"""Scheduling: the block allocator and block manager, the scheduler and its Plan, lanes, the
step inputs built from a plan, the swap store preemption swaps into, and offload (long
sequences with blocks in host RAM)."""
