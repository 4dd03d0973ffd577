"""A separate process that encodes documents into a shared kv_dir and answers questions.

Run by tests/test_processes.py: ``python cache_worker.py MODEL CACHE_DIR ORDER [KILL_AT_FSYNC]``.
Prints ``ready`` before encoding and one JSON line with its answers and counters at the end.
``KILL_AT_FSYNC=n`` SIGKILLs the process at its n-th fsync: the file being written is complete
in its temporary file but not yet renamed into place (odd n: a KV file; even n: its manifest).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from pc_rag import PromptCache, build_prompt

DOCUMENTS = [
    f"Bulletin {i}: the ferry on line {i % 7} left pier {i * 11 % 97} with {i * 3 + 5} passengers and {i % 4} bicycles aboard."
    for i in range(40)
]
QUESTIONS = [(f"How many passengers were on bulletin {i}?", [i, (i + 17) % 40, (i + 29) % 40]) for i in range(0, 40, 8)]


def main() -> None:
    model, kv_dir, order = sys.argv[1], sys.argv[2], sys.argv[3]
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if kill_at:
        real_fsync, calls = os.fsync, [0]

        def fsync(fd: int) -> None:
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            real_fsync(fd)

        os.fsync = fsync
    engine = PromptCache.from_pretrained(model, kv_dir=kv_dir)
    # one decode thread, as the test's reference holds it: while an engine measures its thread count its first steps
    # alternate 1 and 2 threads (pc_rag/forward/threads.py), which rounds the last bits apart, and a random tiny model's
    # near-tied logits then flip a greedy token (1 CI run in many)
    engine.forward.decode_threads.fixed = 1
    indices = list(range(len(DOCUMENTS)))
    if order == "reverse":
        indices.reverse()
    print("ready", flush=True)
    names = {}
    for i in indices:  # one document per call: many small writes, so a kill lands mid-corpus
        names[i] = engine.add_documents([DOCUMENTS[i]], progress=False)[0]
    answers = [engine.generate(build_prompt(q, [names[d] for d in docs]), max_new_tokens=6).token_ids for q, docs in QUESTIONS]
    print(json.dumps({"answers": answers, "encoded": engine.forward.encoded, "loads": engine.store.disk_loads}), flush=True)


if __name__ == "__main__":
    main()
