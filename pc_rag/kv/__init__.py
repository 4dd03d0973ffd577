"""Module KV at rest and in flight: buffers (:mod:`.buffers`), 8/4-bit storage (:mod:`.quantize`),
the entry format (:mod:`.records`), the memory/disk tiers (:mod:`.store`), the Redis tier and the
shared registry's records (:mod:`.remote`, :mod:`.redis_link`, :mod:`.replication`), and the
choice to load or recompute (:mod:`.load_or_compute`)."""
