"""One llama.cpp measurement for benchmarks/quant_decode.py, run inside a llama.cpp venv
(`.bench-envs/llamacpp-*`, made by benchmarks/llamacpp_env.sh): no torch, no Duet imports.

Reads a JSON job on stdin, prints one JSON result line on stdout. Jobs (all greedy, temp 0, the
same token ids Duet gets, EOS ignored because tokens are drawn from ``Llama.generate``, which never
stops by itself):
    {"kind": "generate", "model": path, "threads": 2, "n_batch": 512, "prompts": [[ids]...], "n": N}
        -> {"seconds": wall time to produce N tokens for each prompt, one request after another
           (llama-cpp-python's Python API serves one sequence at a time), "tokens": [[ids]...]}
    {"kind": "prefill", ..., "prompts": [[ids]], "n": 0}  -> {"seconds": time of Llama.eval(prompt)}
Each job loads the model, warms up on the first prompt, then times one run over all prompts. A crash of
llama.cpp kills only this process: the caller records it.
"""

from __future__ import annotations

from typing import Any
import json
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    from llama_cpp import Llama

    llm = Llama(model_path=job["model"], n_ctx=2048, n_threads=job["threads"], n_threads_batch=job["threads"],
                n_batch=job["n_batch"], n_ubatch=job["n_batch"], verbose=False, seed=0)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        out: list[Any] = []
        for ids in prompts:
            if job["kind"] == "prefill":
                llm.reset()
                llm.eval(ids)
                out.append([])
                continue
            toks = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                toks.append(int(tok))
                if len(toks) == job["n"]:
                    break
            out.append(toks)
        return out

    run(job["prompts"][:1])  # warm-up
    t0 = time.perf_counter()
    tokens = run(job["prompts"])
    print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": tokens}))


if __name__ == "__main__":
    main()
