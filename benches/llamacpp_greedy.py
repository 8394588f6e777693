#!/usr/bin/env python3
"""llama.cpp's greedy ids on a GGUF file after given prompt ids (argmax of its logits, no
sampler), for benches/int8_agreement.sh. Prints the generated ids as a JSON list.

    python3 benches/llamacpp_greedy.py FILE.gguf '[1, 2, 3]' N [THREADS]
"""

import json
import sys

import llama_cpp
import numpy as np


def main():
    path, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                          n_ctx=512, logits_all=True, verbose=False)
    llm.eval(ids)
    out = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
