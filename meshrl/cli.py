"""`meshrl` command line: run, plan, deploy and operate a mesh.

    meshrl plan CONFIG [overrides] [--json]
    meshrl serve-config [CONFIG] [overrides] [--run-dir DIR] > serve.yaml   (then `serve deploy serve.yaml`)
    meshrl coordinator serve [CONFIG] [overrides] [--run-dir DIR] [--resume]
    meshrl reward serve [CONFIG] [overrides] [--host H] [--port P]
    meshrl environment serve [CONFIG] [overrides] [--host H] [--port P]
    meshrl param-server serve [CONFIG] [overrides] [--run-dir DIR]
    meshrl status|pause|resume|checkpoint|stop --address HOST:PORT [--token T | --token-file F] [--tls ...]
    meshrl set-staleness VALUE --address HOST:PORT [--token T | --token-file F] [--tls ...]
    meshrl bench coordinator [--out FILE]
    meshrl bench reward [--out FILE]
    meshrl bench weights [--size-gb 1] [--transports grpc,object_store,disk,gloo] [--cross-node] [--out FILE]
    meshrl bench weights --model qwen3_small --lora-rank 8     # full vs LoRA adapter versions
    meshrl bench trainer [--out FILE]
    meshrl bench rollout [--engines transformers,vllm] [--out FILE]
    meshrl bench agent [--delay-ms 200] [--json] [--out FILE]
    meshrl bench gateway [--calls 50] [--sessions 64] [--json] [--out FILE]

Subcommands register themselves in `_COMMANDS`; each is a small function taking parsed args and
returning an exit code. Output to the terminal is this module's job (services log, never print).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from meshrl.watchdog import RunFailed
from services.common.errors import MeshError

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}
WEIGHTS_TRANSPORTS = "grpc,object_store,disk,gloo"


def _command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        _COMMANDS[name] = fn
        return fn

    return register


def _config_args(p: argparse.ArgumentParser, config_required: bool = False) -> None:
    if config_required:
        p.add_argument("config", help="YAML config file")
    else:
        p.add_argument("config", nargs="?", default=None, help="YAML config file (default: the built-in example)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. async_training.staleness_threshold=0.5")


def _split_config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None
    return config, overrides


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("MESHRL_ADDRESS", "127.0.0.1:50051"), help="coordinator host:port")
    p.add_argument("--token", default=os.environ.get("MESHRL_OPERATOR_TOKEN") or os.environ.get("MESHRL_TOKEN"),
                   help="operator token (or MESHRL_OPERATOR_TOKEN, then MESHRL_TOKEN); sent as `authorization: Bearer`")
    p.add_argument("--token-file", default=None,
                   help="read the operator token from this file (meshrl train writes RUN_DIR/operator.token)")
    p.add_argument(
        "--application", default=os.environ.get("MESHRL_APPLICATION"),
        help="Serve application name (when the address is Serve's gRPC ingress with several apps)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    p.add_argument("--tls", action="store_true", help="use TLS (system roots, or --ca-file)")
    p.add_argument("--ca-file", default=None, help="PEM root certificates for TLS")
    p.add_argument("--cert-file", default=None, help="PEM client certificate for mTLS (with --key-file)")
    p.add_argument("--key-file", default=None, help="PEM private key of --cert-file")
    p.add_argument("--server-name", default=None, help="name to check the server's certificate against")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrl", description="Fully asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run a whole job (no CONFIG: the built-in example)")
    _config_args(p)
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<experiment>-<mode>-<time>)")
    p.add_argument("--mode", choices=["fully_async", "one_step_off", "sync"], default=None,
                   help="async_training.mode (default: the config's)")
    p.add_argument("--resume", default=None, help="continue RUN_DIR from its last checkpoint (queue intact)")
    p.add_argument("--no-report", action="store_true", help="skip report.html")

    p = sub.add_parser("serve-config", help="print a Ray Serve config (serve deploy / serve run) for a cluster")
    _config_args(p)
    p.add_argument("--run-dir", default=None,
                   help="run directory on a filesystem every node mounts (default: ./runs/<experiment>-<mode>-<time>, absolute)")
    p.add_argument("--mode", choices=["fully_async", "one_step_off", "sync"], default=None,
                   help="async_training.mode (default: the config's)")

    p = sub.add_parser("report", help="rebuild report.html (self-contained, plots embedded) from run directories (overlaid)")
    p.add_argument("run_dirs", nargs="+", help="run directories")
    p.add_argument("--out", default=None, help="output directory (default: the first run directory)")

    p = sub.add_parser("pretrain", help="build the built-in example's warm-start checkpoint (cached)")
    p.add_argument("--steps", type=int, default=None, help="SFT steps (default: the example's)")
    p.add_argument("--task", default="addition", help="synthetic task")
    p.add_argument("--digits", type=int, default=2, help="digits per operand")
    p.add_argument("--arch", default=None, help="tiny model size: qwen3 (0.8M, default), qwen3_small (25M), qwen3_moe")
    p.add_argument("--length-tail-alpha", type=float, default=None, help="copy: heavy-tailed lengths (Pareto shape)")
    p.add_argument("--max-digits", type=int, default=None, help="copy: longest string with --length-tail-alpha")
    p.add_argument("--lr", type=float, default=None, help="SFT learning rate (default: the example's)")
    p.add_argument("--batch-size", type=int, default=None, help="SFT batch size (default: the example's)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear learning-rate warm-up steps")
    p.add_argument("--stop-loss", type=float, default=None, help="stop once the mean loss of the last 50 steps is below this (default 0.45; tool_add: 0.03, its tool traces' loss)")
    p.add_argument("--tool-fraction", type=float, default=None, help="tool_add: fraction of traces that call the tool (default 0.3)")
    p.add_argument("--device", default="cpu", help="device to train on (cpu, cuda); not part of the cache key")

    p = sub.add_parser("plan", help="print the derived run quantities and resource layout; starts nothing")
    _config_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="per-device link speed in Gbit/s: also estimate weight-sync seconds per version")
    p.add_argument("--changed-fraction", type=float, default=None,
                   help="with --link-gbps: share of elements one version changes, for the delta-sync "
                        "estimate (default 0.02; verl reports 1-3%% of bf16 elements per step)")

    p = sub.add_parser("coordinator", help="run the coordinator without Ray")
    csub = p.add_subparsers(dest="coordinator_command", required=True)
    ps = csub.add_parser("serve", help="serve CoordinatorService on a plain grpc.aio server")
    _config_args(ps)
    ps.add_argument("--run-dir", default=None, help="run directory (ledger, resolved config)")
    ps.add_argument("--resume", action="store_true",
                    help="a restart: continue the run whose ledger is in --run-dir (or coordinator.ledger_path); "
                         "refused when it is not there, never a fresh run from prompt 0")

    p = sub.add_parser("param-server", help="run the param server without Ray (the grpc/disk/collective transports)")
    psub = p.add_subparsers(dest="param_server_command", required=True)
    ps = psub.add_parser("serve", help="serve ParamServerService on a plain grpc.aio server (param_server.host:port)")
    _config_args(ps)
    ps.add_argument("--run-dir", default=None, help="run directory (the disk transport's default weights dir)")

    p = sub.add_parser("reward", help="run the reward service without Ray")
    rsub = p.add_subparsers(dest="reward_command", required=True)
    ps = rsub.add_parser("serve", help="serve RewardService on a plain grpc.aio server")
    _config_args(ps)
    ps.add_argument("--host", default="127.0.0.1")
    ps.add_argument("--port", type=int, default=50061, help="0 picks a free port")

    p = sub.add_parser("environment", help="run an environment (the config's verl tools / interactions) without Ray")
    esub = p.add_subparsers(dest="environment_command", required=True)
    ps = esub.add_parser("serve", help="serve EnvironmentService on a plain grpc.aio server")
    _config_args(ps)
    ps.add_argument("--host", default=None, help="default: environment.host")
    ps.add_argument("--port", type=int, default=None, help="default: environment.port (0 picks a free port)")

    for name, helptext in [
        ("status", "show the run's status"),
        ("pause", "stop granting leases and delivering batches"),
        ("resume", "undo pause"),
        ("checkpoint", "ask the trainer to checkpoint at its next step"),
        ("stop", "end the run: no new leases; the trainer checkpoints and exits"),
    ]:
        p = sub.add_parser(name, help=helptext)
        _client_args(p)
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("set-staleness", help="change async_training.staleness_threshold on the live run")
    p.add_argument("value", type=float)
    _client_args(p)

    p = sub.add_parser("bench", help="benchmarks (JSON out)")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    pb = bsub.add_parser("coordinator", help="groups/s and lease latency, Serve ingress and plain grpc.aio")
    pb.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pb.add_argument("--seconds", type=float, default=5.0, help="measurement time per case")
    pb.add_argument("--no-serve", action="store_true", help="skip the Ray Serve ingress cases")
    pr = bsub.add_parser("reward", help="samples/s: reward pipeline, Serve gRPC ingress, external service vs direct calls")
    pr.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pr.add_argument("--seconds", type=float, default=5.0, help="measurement time per case")
    pr.add_argument("--batch-size", type=int, default=64, help="items per Score call")
    pr.add_argument("--concurrency", type=int, default=4, help="concurrent callers")
    pr.add_argument("--no-serve", action="store_true", help="skip the Ray Serve cases")
    pw = bsub.add_parser("weights", help="publish + fetch GB/s per weight transport vs memcpy / raw broadcast")
    pw.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pw.add_argument("--size-gb", type=float, default=1.0, help="bytes of one version, in GiB")
    pw.add_argument("--bucket-mb", type=int, default=256, help="bucket size (update_weights_bucket_megabytes)")
    pw.add_argument("--rounds", type=int, default=2, help="steady-state rounds after the cold one")
    pw.add_argument("--warmup-rounds", type=int, default=4,
                    help="host transports: rounds between the cold one and the steady ones, reported on their own "
                    "(until a store has cycled once and reuses memory)")
    pw.add_argument("--transports", default=WEIGHTS_TRANSPORTS,
                    help="comma list of grpc, object_store, disk, gloo, nccl (nccl needs 2 GPUs); "
                    "with --cross-node: grpc, object_store (the default there)")
    pw.add_argument("--layout", default="packed", choices=("packed", "tensors"),
                    help="host transports: buckets as the FSDP export hands them over (packed: one buffer per "
                    "bucket) or one allocation per tensor (tensors: e.g. megatron's export)")
    pw.add_argument("--source-device", default="cpu",
                    help="host transports, packed layout: where the exported tensors live before packing (cuda: "
                    "as an FSDP trainer's gathered parameters; the export fingerprints them there)")
    pw.add_argument("--hop", action="store_true",
                    help="also time a version crossing from a trainer rank (a Ray actor) to its deployment, as "
                    "RayTrainGroup.export_weights receives it, against torch's pickling and ray.put/get")
    pw.add_argument("--cross-node", action="store_true",
                    help="between Ray nodes in three network namespaces made for the run (root, iproute2), "
                    "against a raw TCP copy between the same namespaces (meshrl/bench/crossnode.py)")
    pw.add_argument("--model", default=None,
                    help="adapter case: a real model's versions (a tiny arch, e.g. qwen3_small: 25M), full vs LoRA")
    pw.add_argument("--lora-rank", type=int, default=8, help="adapter case: LoRA rank of the adapter version")
    pws = bsub.add_parser("weights-sharded", help="sync from trainer rank 0 vs from every rank: nccl (S+R GPUs), or gloo between namespaces")
    pws.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pws.add_argument("--size-gb", type=float, default=4.0, help="bytes of one version, in GiB")
    pws.add_argument("--bucket-mb", type=int, default=512, help="bucket size")
    pws.add_argument("--rounds", type=int, default=3, help="steady-state rounds after the cold one")
    pws.add_argument("--senders", type=int, default=2, help="trainer ranks")
    pws.add_argument("--receivers", type=int, default=2, help="rollout ranks")
    pws.add_argument("--backend", default="nccl", choices=["nccl", "gloo"],
                     help="gloo: CPU processes (a check, not a measurement, unless --cross-node --link-mbit)")
    pws.add_argument("--cross-node", action="store_true",
                     help="gloo: every rank on a node of its own (network namespaces; root, iproute2)")
    pws.add_argument("--link-mbit", type=float, default=None,
                     help="with --cross-node: every node's link, Mbit/s each way (tc), so the wire sets the pace")
    pme = bsub.add_parser("megatron-export", help="the megatron engine's rank-0 export (pageable / packed) vs each "
                          "rank's own slices, the same model in one run (needs --tp devices)")
    pme.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pme.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one device each)")
    pme.add_argument("--hidden", type=int, default=2048, help="hidden size of the random Qwen3 (16 heads of 128)")
    pme.add_argument("--layers", type=int, default=24, help="decoder layers")
    pme.add_argument("--rounds", type=int, default=5, help="timed rounds after the checked warm-up round")
    pme.add_argument("--bucket-mb", type=int, default=512, help="bucket size")
    pme.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo (a check, not a measurement)")
    pwd = bsub.add_parser("weights-delta", help="nccl sync of whole versions vs delta sync (changed elements), 2 GPUs")
    pwd.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pwd.add_argument("--size-gb", type=float, default=4.0, help="bf16 bytes of one version, in GiB")
    pwd.add_argument("--bucket-mb", type=int, default=512, help="bucket size")
    pwd.add_argument("--rounds", type=int, default=5, help="rounds after the first (whole) version")
    pwd.add_argument("--lrs", default="1e-6,1e-5", help="comma list: the walk's step per element (sets how many change)")
    pwd.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="gloo: CPU processes (a check, not a measurement)")
    pwd.add_argument("--cross-node", action="store_true",
                     help="gloo: sender, receiver and param server on three network namespaces made for the run "
                     "(root, iproute2)")
    pt = bsub.add_parser("trainer", help="training tokens/s: the fsdp engine vs a plain PyTorch loop (CPU, one rank)")
    pt.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pt.add_argument("--steps", type=int, default=12, help="measured steps per case (after 2 warm-up steps)")
    pt.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    pt.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    pe = bsub.add_parser("e2e", help="time to a target reward: fully async vs sync vs the plain single-process loop")
    pe.add_argument("overrides", nargs="*", help="dotted overrides applied to the built-in example (all cases)")
    pe.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pe.add_argument("--target-reward", type=float, default=0.5, help="smoothed reward to reach")
    pe.add_argument("--window", type=int, default=5, help="smoothing window in steps")
    pe.add_argument("--modes", default="fully_async,sync", help="comma list of fully_async, one_step_off, sync")
    pe.add_argument("--no-baseline", action="store_true", help="skip the plain single-process loop")
    pe.add_argument("--run-root", default=None, help="where the runs go (default: a temporary directory)")
    pe.add_argument("--config", default=None, help="config YAML for all cases (default: the built-in example)")
    pe.add_argument("--targets", default="", help="comma list of further smoothed rewards to time (besides --target-reward)")
    pe.add_argument("--max-train-s", type=float, default=None, help="stop each case cleanly this long after its first step")
    pe.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine earlier results (cases merged, ratios recomputed) instead of running")
    pe.add_argument("--gpu-csv", default=None, help="with --merge: nvidia-smi CSV for per-case GPU utilization")
    pe.add_argument("--label", default="", help="name this invocation's cases MODE[LABEL] (e.g. fully_async[nccl]), "
                    "so that --merge keeps apart cases that differ only in their overrides")
    pro = bsub.add_parser("rollout", help="tokens/s on a long-tailed mix: engines vs model.generate / bare vLLM")
    pro.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pro.add_argument("--engines", default="transformers,vllm", help="comma list; vllm needs .venv-vllm")
    pro.add_argument("--prompts", type=int, default=48, help="prompts (each with --n samples)")
    pro.add_argument("--n", type=int, default=4, help="samples per prompt")
    pro.add_argument("--slots", type=int, default=64, help="concurrent sequences (engine slots = generate batch)")
    pro.add_argument("--repeats", type=int, default=3, help="interleaved measurement rounds (median reported)")
    pro.add_argument("--device", default="cpu", help="device of the transformers case (cpu, cuda)")
    pa = bsub.add_parser("agent", help="multi-turn tokens/s with an instant vs a slow (sleeping) environment")
    pa.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pa.add_argument("--json", action="store_true", help="print JSON (the output is JSON in any case)")
    pa.add_argument("--delay-ms", type=float, default=200.0, help="sleep of the slow environment per call")
    pa.add_argument("--groups", type=int, default=48, help="prompt groups per round")
    pa.add_argument("--n", type=int, default=4, help="trajectories per group")
    pa.add_argument("--concurrency", type=int, default=24, help="groups in flight (a replica's leases)")
    pa.add_argument("--slots", type=int, default=64, help="engine slots (max_num_seqs)")
    pa.add_argument("--repeats", type=int, default=3, help="interleaved rounds per case (median reported)")
    pg = bsub.add_parser("gateway", help="p50/p99 of a call through the OpenAI-compatible gateway vs a direct engine call")
    pg.add_argument("--out", default=None, help="write JSON here (default: stdout only)")
    pg.add_argument("--json", action="store_true", help="print JSON (the output is JSON in any case)")
    pg.add_argument("--calls", type=int, default=50, help="calls per path per round")
    pg.add_argument("--rounds", type=int, default=4, help="alternating rounds (direct / gateway, order flipped)")
    pg.add_argument("--max-tokens", type=int, default=16, help="tokens per call")
    pg.add_argument("--sessions", type=int, default=64, help="concurrent agent sessions (openai SDK); 0 skips them")
    pg.add_argument("--group-size", type=int, default=8, help="samples per lease among those sessions")
    return parser


def _run_dir(arg: str | None, name: str) -> Path:
    if arg:
        return Path(arg)
    import time

    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


@_command("train")
def _train(args: argparse.Namespace) -> int:
    from meshrl.progress import progress_view
    from meshrl.train import resolve_config, train

    config, overrides = _split_config_and_overrides(args)
    resume = Path(args.resume) if args.resume else None
    console = "console" in resolve_config(config, overrides, mode=args.mode, resume=resume).trainer.logger
    with progress_view(console=console) as view:
        summary = train(config, overrides, run_dir=Path(args.run_dir) if args.run_dir else None, mode=args.mode,
                        resume=resume, on_progress=view.update, report=not args.no_report)
    print(json.dumps({k: summary[k] for k in ("run_dir", "mode", "steps", "wall_s", "reward_first_10pct",
                                               "reward_last_10pct", "max_staleness_seen", "audit")}, indent=2))
    if not args.no_report:
        print(f"report: {Path(summary['run_dir']) / 'report.html'}")
    if summary.get("failure"):
        print(f"error: {summary['failure']}\nresume: {summary['resume']}", file=sys.stderr)
        return 1
    return 0 if summary["audit"]["balanced"] else 4


@_command("serve-config")
def _serve_config(args: argparse.Namespace) -> int:
    import shlex

    from meshrl.serve_config import serve_config
    from services.common.logging import configure_logging

    configure_logging("cli", json=False, level="WARNING")  # stderr: stdout is the YAML
    config, overrides = _split_config_and_overrides(args)
    command = shlex.join(["meshrl", "serve-config", *sys.argv[2:]]) if sys.argv[1:2] == ["serve-config"] else "meshrl serve-config"
    sys.stdout.write(serve_config(config, overrides, run_dir=Path(args.run_dir) if args.run_dir else None,
                                  mode=args.mode, command=command))
    return 0


@_command("report")
def _report(args: argparse.Namespace) -> int:
    from meshrl.report import write_report

    print(write_report(args.run_dirs, args.out))
    return 0


@_command("pretrain")
def _pretrain(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from meshrl.pretrain import PretrainSpec, ensure_pretrained

    spec = PretrainSpec.for_task(args.task, digits=args.digits, length_tail_alpha=args.length_tail_alpha,
                                 max_digits=args.max_digits, warmup_steps=args.warmup_steps,
                                 tool_fraction=args.tool_fraction)
    for name in ("steps", "arch", "lr", "batch_size", "stop_loss"):
        if getattr(args, name) is not None:
            spec = replace(spec, **{name: getattr(args, name)})
    print(ensure_pretrained(spec, device=args.device))
    return 0


@_command("plan")
def _plan(args: argparse.Namespace) -> int:
    from meshrl.plan import make_plan

    config, overrides = _split_config_and_overrides(args)
    plan = make_plan(config, overrides, link_gbps=args.link_gbps, changed_fraction=args.changed_fraction)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="meshrl plan", show_header=False)
        for key, value in _flatten(plan):
            table.add_row(key, str(value))
        Console().print(table)
    return 0


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((f"{prefix}{k}", v))
    return out


@_command("coordinator")
def _coordinator(args: argparse.Namespace) -> int:
    from services.common.config import load_config, write_resolved_config
    from services.common.errors import ConfigError
    from services.common.logging import configure_logging
    from services.coordinator.server import CoordinatorServer

    config, overrides = _split_config_and_overrides(args)
    cfg = load_config(config, overrides)
    if args.resume and not args.run_dir and not cfg.coordinator.ledger_path:
        raise ConfigError("--resume continues a run: give its --run-dir (or coordinator.ledger_path), where its ledger is")
    run_dir = _run_dir(args.run_dir, "coordinator")
    configure_logging("coordinator")

    async def main() -> None:
        import signal

        server = CoordinatorServer(cfg, run_dir, resume=args.resume)
        write_resolved_config(cfg, run_dir)  # once the ledger is open: a refused --resume writes nothing
        await server.start()
        print(f"coordinator listening on {server.address} (run dir {run_dir})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    return 0


@_command("param-server")
def _param_server(args: argparse.Namespace) -> int:
    from services.common.config import load_config
    from services.common.logging import configure_logging
    from services.param_server.server import ParamServerServer

    config, overrides = _split_config_and_overrides(args)
    cfg = load_config(config, overrides)
    run_dir = _run_dir(args.run_dir, "param-server")
    configure_logging("param_server")

    async def main() -> None:
        import signal

        server = ParamServerServer(cfg, run_dir)
        await server.start()
        print(f"param server listening on {server.address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    return 0


@_command("reward")
def _reward(args: argparse.Namespace) -> int:
    from services.common.config import load_config
    from services.common.logging import configure_logging
    from services.reward.server import RewardServer

    config, overrides = _split_config_and_overrides(args)
    cfg = load_config(config, overrides)
    configure_logging("reward")

    async def main() -> None:
        import signal

        server = RewardServer(cfg, args.host, args.port)
        await server.start()
        print(f"reward service listening on {server.address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    return 0


@_command("environment")
def _environment(args: argparse.Namespace) -> int:
    from services.common.config import load_config
    from services.common.logging import configure_logging
    from services.environment.factory import tool_environment
    from services.environment.server import EnvironmentServer

    config, overrides = _split_config_and_overrides(args)
    cfg = load_config(config, overrides)
    configure_logging("environment")

    async def main() -> None:
        import signal

        server = EnvironmentServer(tool_environment(cfg), cfg.environment, host=args.host, port=args.port,
                                   max_json_depth=cfg.security.limits.max_json_depth)
        await server.start()
        print(f"environment service listening on {server.address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    return 0


def _client(args: argparse.Namespace) -> Any:
    from services.common.security import ChannelSecurity
    from services.coordinator.client import CoordinatorClient

    token = Path(args.token_file).read_text().strip() if args.token_file else args.token
    if bool(args.cert_file) != bool(args.key_file):
        raise SystemExit("error: --cert-file and --key-file go together (mTLS)")
    sec = ChannelSecurity(token=token).with_tls(tls=args.tls, ca_file=args.ca_file, cert_file=args.cert_file,
                                                key_file=args.key_file, server_name=args.server_name)
    return CoordinatorClient(args.address, application=args.application, timeout_s=args.timeout, security=sec)


def _status_dict(resp: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


@_command("status")
def _status(args: argparse.Namespace) -> int:
    async def main() -> dict[str, Any]:
        async with _client(args) as c:
            return _status_dict(await c.status())

    status = asyncio.run(main())
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {status['run_id']}", show_header=False)
    for key, value in _flatten(status):
        table.add_row(key, json.dumps(value) if isinstance(value, list) else str(value))
    Console().print(table)
    return 0


def _simple_control(method: str, done: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def main() -> None:
            async with _client(args) as c:
                await getattr(c, method)()

        asyncio.run(main())
        print(done)
        return 0

    return run


_COMMANDS["pause"] = _simple_control("pause", "paused")
_COMMANDS["resume"] = _simple_control("resume", "resumed")
_COMMANDS["checkpoint"] = _simple_control("request_checkpoint", "checkpoint requested")
_COMMANDS["stop"] = _simple_control("stop", "stop requested")


@_command("set-staleness")
def _set_staleness(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with _client(args) as c:
            return await c.set_staleness(args.value)

    max_required = asyncio.run(main())
    print(f"staleness_threshold={args.value} max_required_samples={max_required}")
    return 0


@_command("bench")
def _bench(args: argparse.Namespace) -> int:
    if args.bench_command == "coordinator":
        from meshrl.bench.coordinator import run_benchmark

        result = run_benchmark(seconds=args.seconds, serve=not args.no_serve)
    elif args.bench_command == "reward":
        from meshrl.bench.reward import run_benchmark as run_reward_benchmark

        result = run_reward_benchmark(
            seconds=args.seconds, batch_size=args.batch_size, concurrency=args.concurrency, serve=not args.no_serve
        )
    elif args.bench_command == "weights" and args.cross_node:
        from meshrl.bench.crossnode import run_benchmark as run_crossnode_benchmark

        transports = args.transports if args.transports != WEIGHTS_TRANSPORTS else "grpc,object_store"
        result = run_crossnode_benchmark(size_gb=args.size_gb, bucket_mb=args.bucket_mb, rounds=args.rounds,
                                         transports=tuple(t for t in transports.split(",") if t))
    elif args.bench_command == "weights":
        from meshrl.bench.weights import run_benchmark as run_weights_benchmark

        chosen = tuple(t for t in args.transports.split(",") if t)
        if args.model:
            from meshrl.bench.weights_lora import run_model_benchmark

            result = run_model_benchmark(arch=args.model, lora_rank=args.lora_rank, bucket_mb=args.bucket_mb,
                                         rounds=args.rounds, transports=chosen)
        else:
            result = run_weights_benchmark(size_gb=args.size_gb, bucket_mb=args.bucket_mb, rounds=args.rounds,
                                           transports=chosen, warmup_rounds=args.warmup_rounds, layout=args.layout,
                                           source_device=args.source_device, hop=args.hop)
    elif args.bench_command == "weights-sharded":
        from meshrl.bench.weights_sharded import run_benchmark as run_sharded_benchmark

        result = run_sharded_benchmark(size_gb=args.size_gb, bucket_mb=args.bucket_mb, rounds=args.rounds,
                                       senders=args.senders, receivers=args.receivers, backend=args.backend,
                                       cross_node=args.cross_node, link_mbit=args.link_mbit)
    elif args.bench_command == "megatron-export":
        from meshrl.bench.megatron_export import run_benchmark as run_megatron_export

        result = run_megatron_export(tp=args.tp, hidden=args.hidden, layers=args.layers, rounds=args.rounds,
                                     bucket_mb=args.bucket_mb, device=args.device)
    elif args.bench_command == "weights-delta":
        from meshrl.bench.weights_delta import run_benchmark as run_delta_benchmark

        result = run_delta_benchmark(size_gb=args.size_gb, bucket_mb=args.bucket_mb, rounds=args.rounds,
                                     lrs=tuple(float(x) for x in args.lrs.split(",") if x.strip()), backend=args.backend,
                                     cross_node=args.cross_node)
    elif args.bench_command == "trainer":
        from meshrl.bench.trainer import run_benchmark as run_trainer_benchmark

        result = run_trainer_benchmark(steps=args.steps, batch_size=args.batch_size, threads=args.threads or None)
    elif args.bench_command == "e2e":
        from meshrl.bench.e2e import merge_results
        from meshrl.bench.e2e import run_benchmark as run_e2e

        if args.merge:
            result = merge_results([json.loads(Path(p).read_text()) for p in args.merge], gpu_csv=args.gpu_csv)
        else:
            result = run_e2e(
                overrides=list(args.overrides), target=args.target_reward, window=args.window,
                modes=tuple(m for m in args.modes.split(",") if m), baseline=not args.no_baseline,
                out_dir=args.run_root, config=args.config,
                extra_targets=[float(t) for t in args.targets.split(",") if t.strip()], max_train_s=args.max_train_s,
            )
            if args.label:
                from meshrl.bench.e2e import ratios

                result["cases"] = {f"{name}[{args.label}]": case for name, case in result["cases"].items()}
                result["ratios"] = ratios(result["cases"])
    elif args.bench_command == "rollout":
        from meshrl.bench.rollout import run_benchmark as run_rollout

        result = run_rollout(
            engines=tuple(e for e in args.engines.split(",") if e), prompts=args.prompts, n=args.n,
            slots=args.slots, repeats=args.repeats, device=args.device,
        )
    elif args.bench_command == "agent":
        from meshrl.bench.agent import run_benchmark as run_agent

        result = run_agent(delay_ms=args.delay_ms, groups=args.groups, n=args.n, concurrency=args.concurrency,
                           slots=args.slots, repeats=args.repeats)
    elif args.bench_command == "gateway":
        from meshrl.bench.gateway import run_benchmark as run_gateway

        result = run_gateway(calls=args.calls, rounds=args.rounds, max_tokens=args.max_tokens, sessions=args.sessions,
                             group_size=args.group_size)
    else:  # pragma: no cover - argparse restricts choices
        raise SystemExit(f"unknown benchmark {args.bench_command}")
    # what a result needs to be reproduced and compared, whichever benchmark wrote it
    import platform
    import time

    result.setdefault("date", time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    result.setdefault("machine", {"platform": platform.platform(), "python": platform.python_version(),
                                  "cpus": os.cpu_count()})
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except RunFailed as exc:  # `meshrl train`: the cause, where the details are, how to go on
        print(f"error: {exc.reason}", file=sys.stderr)
        print(f"details: {exc.run_dir / 'logs'}", file=sys.stderr)
        if exc.resume:
            print(f"resume: {exc.resume}", file=sys.stderr)
        return 1
    except MeshError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        import grpc

        if isinstance(exc, grpc.RpcError):
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
