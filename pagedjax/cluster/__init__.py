"""Serving across replicas: a request's cached prefix helps only on the replica that holds it.

  index.py    a cluster-wide KV index (which replica holds which block in which tier), kept from
              the replicas' KV events (pagedjax/host/kv_events.py)
  routers.py  routing policies behind one interface and a registry: random, round robin, least
              loaded, approximate prefix affinity, precise (the KV index), tier-aware cost
  sim.py      N simulated replicas (the real engine host code each, pagedjax/sim) on one event
              clock behind a router; per-replica and cluster figures

index.py and routers.py are plain host Python (no jax); sim.py builds engines. Study:
experiments/cluster.py (configs/cluster.py); findings in docs/cluster.md.
"""
