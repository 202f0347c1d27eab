"""The ``duet`` command: serve a model over gRPC on Ray worker pools, and talk to it.

  duet serve               start a deployment in the foreground: Ray (embedded local by default),
                           a pool of worker actors, and the router: gRPC (default 127.0.0.1:50051)
                           and the OpenAI-compatible HTTP API (default http://127.0.0.1:8000/v1);
                           Ctrl-C / SIGTERM shuts everything down
  duet router              a router alone, following a controller's member list (`duet serve --no-router`
                           elsewhere; the Helm chart's router Deployment runs this)
  duet generate "prompt"   stream one completion from a running router to the terminal
  duet status              the router's health and model, and every worker's health and load
  duet drain WORKER        move a worker's running requests to its pool's other workers (live KV
                           migration, nothing recomputed) and stop routing to it; --node-ip drains
                           every worker on a node (the Helm chart's preStop hook)
  duet bench               serving benchmark: Poisson load over gRPC, TTFT/TPOT/ITL/E2E percentiles,
                           goodput and the router's own overhead (see `duet bench --help`)
  duet profile             measure one replica's capacity at p90 TTFT/TPOT SLOs, save it as a
                           profile for the autoscaler and simulator (see `duet profile --help`)
  duet prepare-model       convert/locate the model and print its checkpoint path

Configuration for `serve`: a YAML file (--config, or $DUET_CONFIG; see cluster/duet.example.yaml),
then environment variables (DUET_MODEL, DUET_PORT, RAY_ADDRESS, ...), then flags; later wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from cluster.client_args import add_client_security, client_security

DEFAULT_TARGET = "localhost:50051"

# The `duet serve` flags: each setting's flag, env var and help come from the config models
# (cluster/config/duet.py SWITCHES, cluster/config/schema.py); values are parsed and checked there.
def _serve_flags() -> dict[str, str]:
    """flag -> dotted config key."""
    from cluster.config.duet import SWITCHES

    return {s.flag: key for key, s in SWITCHES.items() if s.flag}


def _add_config_flags(p: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    from cluster.config.schema import flag_help

    for flag, key in flags.items():
        p.add_argument(flag, dest=key, default=None, metavar=key.rsplit(".", 1)[-1].upper(), help=flag_help(key))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over gRPC and OpenAI HTTP: Ray + worker pools + router "
                       "(foreground)",
                       description="Start Ray (embedded local unless --ray-address / RAY_ADDRESS), the worker "
                       "pools (one colocated pool, or prefill + decode pools: see the YAML) and the router (gRPC on "
                       "--port, the OpenAI-compatible HTTP API on --http-port); log where it listens; serve until Ctrl-C or "
                       "SIGTERM, then stop the router, the workers and (if embedded) Ray. Settings: "
                       "defaults < --config YAML < DUET_* env < flags.")
    p.add_argument("--config", metavar="FILE", help="YAML config (default: $DUET_CONFIG if set); "
                   "see cluster/duet.example.yaml")
    _add_config_flags(p, _serve_flags())
    p.add_argument("--dry-run", action="store_true", help="validate the merged config, resolve the model and check "
                   "that it runs with each pool's parallel sizes and quantization (what serve checks before "
                   "starting anything), print the config as YAML and exit")
    p.add_argument("--no-router", action="store_true", help="run Ray, the pools and the controller (its Membership "
                   "service on controller.port) but no router: routers run elsewhere with `duet router "
                   "--membership HOST:PORT` (the Helm chart's Ray head does this)")


ROUTER_FLAGS = ("--model", "--host", "--port", "--http-port", "--policy")


def _router_flags() -> dict[str, str]:
    return {flag: key for flag, key in _serve_flags().items() if flag in ROUTER_FLAGS}


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run a router alone, following a controller's member list",
                       description="Serve the public gRPC API (duet.v1.Duet, health, reflection) and the "
                       "OpenAI-compatible HTTP API (--http-port, with /metrics) for workers that "
                       "a controller elsewhere (`duet serve --no-router`) manages: the member list comes from its "
                       "duet.control.v1.Membership service. Reads the same config as `duet serve` (router and model "
                       "sections); the model is resolved here for its tokenizer. Runs until Ctrl-C or SIGTERM.")
    p.add_argument("--config", metavar="FILE", help="YAML config (default: $DUET_CONFIG if set)")
    p.add_argument("--membership", metavar="HOST:PORT", default=os.environ.get("DUET_MEMBERSHIP"),
                   help="the controller's Membership service (default $DUET_MEMBERSHIP, else "
                   "controller.host:controller.port of the config)")
    _add_config_flags(p, _router_flags())
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port at /metrics "
                   "(default 0 = off)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one completion from a running router",
                       description="Send one request to a running router (`duet serve`) and stream the text "
                       "to stdout; a summary (tokens, finish reason) goes to stderr.")
    p.add_argument("prompt")
    p.add_argument("--target", default=os.environ.get("DUET_TARGET", DEFAULT_TARGET),
                   help=f"router host:port (default $DUET_TARGET or {DEFAULT_TARGET})")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template applied)")
    p.add_argument("--model", default="", metavar="NAME", help="a served model or LoRA adapter (<adapter> or "
                   "<model>:<adapter>), as `duet status` lists them (default: the router's default model)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (reproducible sampling)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--timeout", type=float, default=120.0, help="request deadline in seconds (default 120)")
    s = p.add_argument_group("structured output (at most one; the output is constrained token by token)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--json-object", action="store_true", help="any JSON object")
    g.add_argument("--json-schema", metavar="FILE", help="JSON valid for the JSON schema in FILE")
    g.add_argument("--regex", metavar="REGEX", help="text matching the regular expression (Rust regex syntax; "
                   "\\d is Unicode-aware, use [0-9] for ASCII digits)")
    g.add_argument("--choice", action="append", metavar="TEXT", help="exactly one of these strings (repeatable)")
    g.add_argument("--grammar", metavar="FILE", help="text parsing with the grammar in FILE (llguidance's Lark "
                   "dialect, or llama.cpp GBNF)")
    add_client_security(p)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="router health and every worker's health and load",
                       description="Ask the router (--target) for health and models, and join the deployment's "
                       "Ray cluster (--ray-address, default 'auto' = the local one `duet serve` started) to "
                       "find its worker actors, then ask each worker for health and load over gRPC.")
    p.add_argument("--target", default=os.environ.get("DUET_TARGET", DEFAULT_TARGET),
                   help=f"router host:port (default $DUET_TARGET or {DEFAULT_TARGET})")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="Ray cluster of the deployment (default $RAY_ADDRESS or 'auto'); for an explicit "
                   "address of a token-authenticated cluster also set RAY_AUTH_MODE=token")
    p.add_argument("--namespace", default="duet", help="Ray namespace of the workers (ray.namespace; default duet)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")
    add_client_security(p)


def _add_drain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drain", help="migrate a worker's running requests to its pool's other workers",
                       description="Join the deployment's Ray cluster (like `duet status`), and ask the worker (or "
                       "every worker on --node-ip) to stop taking requests and move its running ones, KV and "
                       "sampler state, to the other serving workers of its pool (live migration: nothing is "
                       "recomputed, the clients' streams continue). Requests that cannot move keep running there. "
                       "Exit status 1 if any request is left or a worker could not be drained.")
    p.add_argument("worker", nargs="?", help="worker id, e.g. decode-1 (see `duet status`)")
    p.add_argument("--node-ip", help="drain every worker serving on this IP instead (preStop: the pod's IP)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to move the requests (default 60)")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="Ray cluster of the deployment (default $RAY_ADDRESS or 'auto')")
    p.add_argument("--namespace", default="duet", help="Ray namespace of the workers (default duet)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_router(sub)
    _add_generate(sub)
    _add_status(sub)
    _add_drain(sub)
    # `duet bench` owns its flags (cluster/bench/serving.py); everything after "bench" goes there.
    sub.add_parser("bench", help="serving benchmark: Poisson load, latency percentiles, goodput, router overhead",
                   add_help=False)
    # `duet profile` owns its flags too (cluster/bench/profiler.py).
    sub.add_parser("profile", help="measure one replica's capacity at the SLOs and save it for the autoscaler",
                   add_help=False)
    prep = sub.add_parser("prepare-model", help="convert/locate the model and print its checkpoint path")
    prep.add_argument("--model", default="SmolLM2-135M-Instruct")
    return parser


def _serve(args: argparse.Namespace) -> int:
    from cluster.config.duet import load_config
    from cluster.deploy.preflight import preflight

    keys = {key: flag for flag, key in _serve_flags().items()}
    sources: dict[str, str] = {}
    config = load_config(args.config, overrides={k: getattr(args, k) for k in keys}, flag_names=keys,
                         sources=sources)
    if args.dry_run:
        import yaml

        from cluster.deploy.cpu_share import resolve_cpus

        preflight(config, sources)  # the model checks `duet serve` runs before starting anything
        if config.ray.address is None:
            _, note = resolve_cpus(config, config.ray.num_cpus or len(os.sched_getaffinity(0)))
            print(f"duet: embedded on this machine: {note}", file=sys.stderr)
        sys.stdout.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
        return 0
    from cluster.deploy.serve import run_foreground

    return run_foreground(config, with_router=not args.no_router, sources=sources)


def _router(args: argparse.Namespace) -> int:
    from cluster.config.duet import load_config
    from cluster.deploy.router_main import run_router_foreground

    keys = {key: flag for flag, key in _router_flags().items()}
    config = load_config(args.config, overrides={k: getattr(args, k) for k in keys}, flag_names=keys)
    if not 0 <= args.metrics_port <= 65535:
        raise config_error(f"--metrics-port={args.metrics_port}: must be in 0..65535 (0 = no metrics server)")
    membership = args.membership or f"{config.controller.host}:{config.controller.port}"
    return run_router_foreground(config, membership, args.metrics_port)


def config_error(message: str) -> Exception:
    from cluster.config.duet import ClusterConfigError

    return ClusterConfigError(message)


def _generate(args: argparse.Namespace) -> int:
    from router.client import stream

    kwargs = dict(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, structured=structured_spec(args))
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    last = None
    tls, token = client_security(args)
    for chunk in stream(prompt, target=args.target, timeout=args.timeout, tls=tls, token=token, **kwargs):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    if last is not None and last.usage is not None:
        print(f"[{last.usage.completion_tokens} tokens, {last.finish_reason}; prompt {last.usage.prompt_tokens} "
              f"tokens, {last.usage.cached_prompt_tokens} from the prefix cache]", file=sys.stderr)
    return 0


def structured_spec(args: argparse.Namespace):
    """The StructuredOutput the generate flags ask for (None: free text). Raises InvalidRequestError
    naming the flag for an unreadable file (the spec itself is checked by the router)."""
    from workers.errors import InvalidRequestError
    from workers.structured.spec import StructuredOutput

    def read(flag: str, path: str) -> str:
        try:
            return Path(path).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(flag, f"cannot read {path!r}: {e}") from None

    if args.json_object:
        return StructuredOutput("json_object")
    if args.json_schema is not None:
        return StructuredOutput("json_schema", read("--json-schema", args.json_schema))
    if args.regex is not None:
        return StructuredOutput("regex", args.regex)
    if args.choice:
        return StructuredOutput("choice", choices=tuple(args.choice))
    if args.grammar is not None:
        return StructuredOutput("grammar", read("--grammar", args.grammar))
    return None


def _status(args: argparse.Namespace) -> int:
    import json

    from cluster.deploy.status import format_status, router_status, worker_status

    tls, token = client_security(args)
    status: dict[str, object] = {"router": router_status(args.target, args.timeout, tls=tls, token=token),
                                 "namespace": args.namespace}
    try:
        import ray

        ray.init(address=args.ray_address, namespace=args.namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
    except Exception as e:  # noqa: BLE001 - report what we could reach
        hint = ("" if args.ray_address == "auto" or os.environ.get("RAY_AUTH_MODE") else
                "; if that cluster uses Ray token authentication (a local `duet serve` does), set "
                "RAY_AUTH_MODE=token: Ray only sends its token to an explicit address when told to")
        status["ray_error"] = (f"no Ray cluster reachable at {args.ray_address!r}: "
                               f"{str(e).splitlines()[0][:200]}{hint}")
    else:
        try:
            status["workers"] = worker_status(args.namespace, args.timeout)
        finally:
            ray.shutdown()  # disconnects; the cluster keeps running
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    reachable = "error" not in status["router"] or status.get("workers")  # type: ignore[operator]
    return 0 if reachable else 1


def _drain(args: argparse.Namespace) -> int:
    import json

    from cluster.deploy.drain import DrainError, drain, format_results, select
    from cluster.deploy.status import worker_status

    if (args.worker is None) == (args.node_ip is None):
        raise DrainError("give exactly one of WORKER or --node-ip")
    if args.timeout <= 0:
        raise DrainError(f"--timeout must be > 0, got {args.timeout}")
    import ray

    from cluster.deploy.ray_conn import RayConnectionError

    try:
        ray.init(address=args.ray_address, namespace=args.namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
    except Exception as e:  # noqa: BLE001 - one line, with the address tried
        raise RayConnectionError(f"no Ray cluster reachable at {args.ray_address!r}: "
                                 f"{str(e).splitlines()[0][:200]}") from None
    try:
        workers = worker_status(args.namespace, 5.0)
    finally:
        ray.shutdown()
    results = drain(select(workers, args.worker, args.node_ip), workers, args.timeout)
    print(json.dumps(results, indent=2) if args.json else format_results(results))
    return 0 if all("error" not in r and r["remaining"] == 0 for r in results) else 1


def _prepare(args: argparse.Namespace) -> int:
    from workers.models.assets.resolve import resolve_model

    print(resolve_model(args.model))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `duet [-v] bench|profile ...`: everything after the command belongs to its own parser.
    lead = 0
    while lead < len(argv) and argv[lead] in ("-v", "--verbose"):
        lead += 1
    if argv[lead:lead + 1] in (["bench"], ["profile"]):
        _configure_logging(lead > 0)
        if argv[lead] == "bench":
            from cluster.bench.serving import main as bench_main

            return bench_main(argv[lead + 1:])
        from cluster.bench.profiler import main as profile_main

        return profile_main(argv[lead + 1:])
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    handlers = {"serve": _serve, "router": _router, "generate": _generate, "status": _status, "drain": _drain,
                "prepare-model": _prepare}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # expected failures become one line; bugs keep their traceback
        if not _is_user_error(e):
            raise
        print(f"duet: error: {e}", file=sys.stderr)
        return 2 if _is_config_error(e) else 1


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _is_config_error(e: Exception) -> bool:
    from cluster.config.duet import ClusterConfigError

    return isinstance(e, ClusterConfigError)


def _is_user_error(e: Exception) -> bool:
    """Errors whose message already says what to do: print it, no traceback."""
    from cluster.config.duet import ClusterConfigError
    from cluster.deploy.drain import DrainError
    from cluster.deploy.membership_service import MembershipError
    from cluster.deploy.pools import PoolError
    from cluster.deploy.ray_conn import RayConnectionError
    from cluster.deploy.serve import ServeError
    from router.client import DuetError as ClientError
    from router.config import RouterConfigError
    from workers.errors import DuetError

    return isinstance(e, (ClusterConfigError, DrainError, MembershipError, PoolError, RayConnectionError, ServeError,
                          ClientError, RouterConfigError, DuetError))


if __name__ == "__main__":
    sys.exit(main())
