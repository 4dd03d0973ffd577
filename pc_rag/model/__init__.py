"""The model as pc-rag finds it: what it is and which paths are proved exact for it (:mod:`.spec`),
where it comes from (:mod:`.loading`) and how it encodes positions, measured (:mod:`.rope`). The
passes through it are :mod:`pc_rag.forward`'s."""
