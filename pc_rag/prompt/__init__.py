"""What text means, before any model: PML (:mod:`.pml`), schema layouts (:mod:`.layout`) and prompt plans (:mod:`.plan`),
documents as modules (:mod:`.documents`), chat turns and tools (:mod:`.chat`, :mod:`.tools`,
:mod:`.schemas`), drop-in reuse (:mod:`.dropin`) and neighbour context (:mod:`.neighbours`). No torch."""
