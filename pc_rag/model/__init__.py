"""The model as pc-rag drives it: what it is (:mod:`.spec`), where it comes from (:mod:`.loading`),
how it encodes positions (:mod:`.rope`), the attention kernels pc-rag registers
(:mod:`.attention`, :mod:`.shared_attention`, :mod:`.probe`) and the passes through it (:mod:`.forward`)."""
