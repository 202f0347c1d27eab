"""The ``duet`` command.

Until the serving layer lands (gRPC router, Ray worker pools), every subcommand runs the engine
in this process:
  duet serve               run the engine on a few sample prompts and print the results
  duet generate "prompt"   stream one completion to the terminal
  duet prepare-model       convert the embedded model into the local cache
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

SAMPLE_PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a KV cache is in one sentence.<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(xs):",
]


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="local HF checkpoint dir or 'SmolLM2-135M-Instruct' (default)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")


def _build(args: argparse.Namespace):
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    return LLM(args.model, dtype=args.dtype), params


def _serve(args: argparse.Namespace) -> int:
    llm, params = _build(args)
    t0 = time.perf_counter()
    outs = llm.generate(SAMPLE_PROMPTS, params)
    dt = time.perf_counter() - t0
    for prompt, out in zip(SAMPLE_PROMPTS, outs):
        print(f"--- {prompt!r}\n{out.text}\n[{len(out.token_ids)} tokens, {out.finish_reason.value}]")
    n = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {n} tokens in {dt:.1f}s ({n / dt:.1f} tok/s, continuous batching)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    llm, params = _build(args)
    engine = llm.engine
    engine.add_request("cli", args.prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from workers.models.assets import resolve_model

    print(resolve_model(args.model))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine on sample prompts (serving over gRPC comes next)")
    _engine_args(serve)
    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    _engine_args(gen)
    prep = sub.add_parser("prepare-model", help="convert/locate the model and print its checkpoint path")
    prep.add_argument("--model", default="SmolLM2-135M-Instruct")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from workers.errors import DuetError

    handlers = {"serve": _serve, "generate": _generate, "prepare-model": _prepare}
    try:
        return handlers[args.command](args)
    except DuetError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
