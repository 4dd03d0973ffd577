"""The prefill path: module encoding (:mod:`.encode`), assembly (:mod:`.rows`, :mod:`.assemble`,
:mod:`.ape`), recovery (:mod:`.recovery`, :mod:`.scored`) and the passes (:mod:`.passes`), read top
to bottom in :mod:`.pipeline`."""
