"""Decoding: per-request state and sampling (:mod:`.request`), JSON-constrained output
(:mod:`.constrained`) and the loop over a running batch (:mod:`.loop`)."""
