"""What text means, before any model: PML (:mod:`.pml`), positions and plans (:mod:`.layout`),
documents as modules (:mod:`.documents`), chat turns and tools (:mod:`.chat`, :mod:`.tools`,
:mod:`.schemas`), drop-in reuse (:mod:`.dropin`) and neighbour context (:mod:`.neighbours`). No torch."""
