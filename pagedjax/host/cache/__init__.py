"""Prefix caching: the hash-chain and radix-tree prefix caches and session bookkeeping."""
