"""`phaselens serve`: the instrumented reference server (OpenAI-compatible HTTP)."""

from __future__ import annotations

import argparse
import sys

from phaselens.commands._flags import given, refuse
from phaselens.reference_server.engine.config import DEVICES, DTYPES, POLICIES, EngineConfig
from phaselens.reference_server.pd.pd_protocol import PROTOCOL_PHASELENS, PROTOCOLS


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the instrumented reference LLM server",
        description="Continuous-batching reference server, OpenAI-compatible, traced "
        "through OTLP as configured by the OTEL_* environment variables.",
    )
    d = EngineConfig()
    p.add_argument("--model", default="tiny", help="'tiny' (built-in random Llama) or a local HF model folder")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) /v1/models lists and requests may use (default: --model exactly as "
        "given; its base name is accepted too)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--device", choices=DEVICES, default=d.device)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--policy", choices=POLICIES, default=d.policy)
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="waiting-queue bound (then 503)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=d.cpu_threads,
        help="torch threads on cpu (0: 1 for a model under 10M parameters, torch's default otherwise)",
    )
    p.add_argument(
        "--reasoning-tokens", type=int, default=0, help="chat: stream the first N output tokens as reasoning_content"
    )
    p.add_argument("--auth-token", default=None, help="require 'Authorization: Bearer TOKEN' on /v1/*")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without --auth-token")
    p.add_argument("--tls-cert", metavar="PEM", default=None, help="serve HTTPS: certificate chain (with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the certificate's private key")
    p.add_argument("--no-telemetry", action="store_true", help="serve without the phaselens instrumentation")
    p.add_argument(
        "--role",
        choices=("prefill", "decode", "router"),
        default=None,
        help="disaggregated serving (docs/disaggregation.md): a prefill or decode instance, or the router "
        "in front of them (default: one colocated server)",
    )
    p.add_argument(
        "--engine",
        choices=("thread", "process"),
        default="thread",
        help="where the serving loop runs: a thread beside the HTTP event loop, or its own process "
        "(vLLM V1's EngineCore shape; colocated only; docs/engine-process.md)",
    )
    p.add_argument("--kv-port", type=int, default=0, help="decode role: the KV-transfer port (0 picks a free one)")
    p.add_argument("--prefill", nargs="+", default=(), metavar="URL", help="router role: the prefill instances")
    p.add_argument("--decode", nargs="+", default=(), metavar="URL", help="router role: the decode instances")
    p.add_argument(
        "--pd-protocol",
        choices=PROTOCOLS,
        default=PROTOCOL_PHASELENS,
        help="router role: what the instances speak: phaselens (reference servers) or vllm (vLLM instances "
        "with a KV connector: prefill with max_tokens 1 and kv_transfer_params; docs/disaggregation.md)",
    )
    p.set_defaults(func=run, _parser=p)


# what only a server with a model reads: the router runs none
_ENGINE_FLAGS = (
    "model",
    "served_model_name",
    "cpu_threads",
    "device",
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_tokens",
    "block_size",
    "policy",
    "max_waiting",
    "seed",
    "reasoning_tokens",
    "engine",
)


def run(args: argparse.Namespace) -> int:
    if not args.no_telemetry:
        from phaselens.instrumentation.pipeline import check_sampling_env

        try:
            check_sampling_env()  # OTEL_TRACES_SAMPLER_ARG, PHASELENS_TAIL_SLO: refused before the model loads
        except ValueError as exc:
            args._parser.error(str(exc))
    if args.role != "decode":
        refuse(args, given(args, "kv_port"), "is the decode instance's KV-transfer port: give --role decode")
    if args.role != "router":
        refuse(args, given(args, "pd_protocol"), "is the router's: give --role router")
    if args.role == "router":
        refuse(args, given(args, *_ENGINE_FLAGS), "configure a model server; the router runs no model")
        refuse(args, given(args, "tls_cert", "tls_key"), "are not served by the router (plain HTTP only)")
        return _router(args)
    if args.prefill or args.decode:
        print("phaselens serve: --prefill/--decode are options of --role router", file=sys.stderr)
        return 2
    from phaselens.common.tls import TlsConfigError, server_tls
    from phaselens.reference_server.serve import ServeOptions, serve

    try:
        tls = server_tls(args.tls_cert, args.tls_key)
    except TlsConfigError as exc:
        print(f"phaselens serve: {exc}", file=sys.stderr)
        return 2

    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        block_size=args.block_size,
        policy=args.policy,
        max_waiting=args.max_waiting,
        seed=args.seed,
        cpu_threads=args.cpu_threads,
    )
    options = ServeOptions(
        engine=engine,
        host=args.host,
        port=args.port,
        reasoning_tokens=args.reasoning_tokens,
        auth_token=args.auth_token,
        insecure=args.insecure,
        tls=tls,
        telemetry=not args.no_telemetry,
        served_model_names=tuple(args.served_model_name or ()),
        role=args.role or "",
        kv_port=args.kv_port,
        engine_mode=args.engine,
    )
    try:
        return serve(options)
    except (ValueError, OSError) as exc:
        print(f"phaselens serve: {exc}", file=sys.stderr)
        return 2


def _router(args: argparse.Namespace) -> int:
    from phaselens.reference_server.serve import RouterOptions, serve_router

    options = RouterOptions(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        host=args.host,
        port=args.port,
        auth_token=args.auth_token,
        insecure=args.insecure,
        telemetry=not args.no_telemetry,
        pd_protocol=args.pd_protocol,
    )
    try:
        return serve_router(options)
    except (ValueError, OSError) as exc:
        print(f"phaselens serve: {exc}", file=sys.stderr)
        return 2
