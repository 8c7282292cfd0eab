"""KV tiers below the device: the tier index and its eviction, the host-RAM and disk tiers
(the disk store: verified, content-keyed entries), and the tiers' cost model."""
