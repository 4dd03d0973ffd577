"""How a model's linear layers hold their weights: the ``weights=`` choice (:mod:`.choice`), blocks of
32 on pc-rag's kernels (:mod:`.blocks`), torch's 4-bit kernel (:mod:`.int4`), fp16 (:mod:`.float16`),
siblings multiplied as one (:mod:`.siblings`) and decode-sized products (:mod:`.small_batch`)."""
