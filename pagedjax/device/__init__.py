"""Device side: pure jitted code over the KV pool (pool layout and storage schemes, the step,
block copies and transfers, sampling). Nothing here imports the host package."""
