#!/usr/bin/env python3
"""llama.cpp on a GGUF file, as benches/gguf.sh times ours: 64 greedy tokens after "The
capital of France is" (decode tokens/s from llama.cpp's own counters), and a 512-token
prompt (prefill tokens/s), best of ROUNDS; THREADS threads. Prints one JSON object.

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36
    python3 benches/llamacpp_gguf.py FILE.gguf [THREADS] [ROUNDS]
"""

import json
import resource
import sys
import time

import llama_cpp


def main():
    path = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
    prompt = llm.tokenize(b"The capital of France is", add_bos=False)
    decode, prefill = 0.0, 0.0
    for _ in range(rounds):
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        llm.eval(prompt)
        for _ in range(64):
            llm.eval([llm.sample(temp=0.0)])
        p = llama_cpp.llama_perf_context(llm._ctx.ctx)
        decode = max(decode, p.n_eval / (p.t_eval_ms / 1e3))
        llm.reset()
        ids = (prompt * 200)[:512]
        t = time.perf_counter()
        llm.eval(ids)
        prefill = max(prefill, 512 / (time.perf_counter() - t))
    print(json.dumps({
        "tool": f"llama.cpp {llama_cpp.__version__}",
        "decode_tokens_per_s": decode,
        "prefill_tokens_per_s": prefill,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


if __name__ == "__main__":
    main()
