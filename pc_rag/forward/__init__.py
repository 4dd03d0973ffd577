"""Every pass through the model: :class:`~pc_rag.forward.forward.Forward` (encoding, prefill, probe,
decode), the attention kernels pc-rag registers with transformers (:mod:`.attention`,
:mod:`.shared_attention`, :mod:`.packed`, :mod:`.row_extents`), the layer-by-layer probe
(:mod:`.probe`), the decode step written out (:mod:`.llama_step`) and in one C call
(:mod:`.fused_step`), key rotation (:mod:`.rotation`, :mod:`.rope_table`), threads and turns."""
