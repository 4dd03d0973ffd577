"""pc-rag's native code: the C kernels (products over weights in blocks of 32, the one-call decode
step and its threads) and how Python reaches them: where the library comes from (:mod:`.build`),
loading and checking it (:mod:`.loader`), the products with their arguments checked
(:mod:`.products`) and the step's argument structures (:mod:`.step`)."""
