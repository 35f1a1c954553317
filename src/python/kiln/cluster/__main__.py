"""`python -m kiln.cluster {list,status,logs [-f],stop,endpoints,mint} [JOB]`: Kiln's jobs on a
Ray cluster, from any machine that reaches it (docs/clusters.md). The cluster is
`--cluster ADDRESS`, or $RAY_ADDRESS.

Exit status: 0 done (`logs -f`: the job's own exit code); 1 one line saying what went wrong (an
unreachable cluster, another Ray version, no such job, no control endpoint); 130 `logs -f`
detached by Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kiln.cluster import endpoints, jobs
from kiln.cluster.connection import connect, resolve_address
from kiln.cluster.errors import ClusterError
from kiln_contract.parsing import SpecError
from kiln_contract.vocabulary import MAX_TOKEN_TTL_MINUTES, check_token_ttl

STATUS_FIELDS = ("job", "artifact", "state", "exit_code", "resources", "hosts", "retries",
                 "max_retries", "prefix", "started_at", "ended_at")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kiln.cluster", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cluster", metavar="ray://HOST:PORT|HOST:PORT", help="the Ray cluster (default: $RAY_ADDRESS)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every job: id, state, artifact, start time")
    for name, text in (("status", "one job's state"), ("stop", "save a checkpoint and stop")):
        commands.add_parser(name, help=text).add_argument("job")
    logs = commands.add_parser("logs", help="a job's output")
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    commands.add_parser(
        "endpoints", help="the job's control endpoint: name, address, node, routes"
    ).add_argument("job")
    mint = commands.add_parser("mint", help="a capability URL for the job's control endpoint")
    mint.add_argument("job", metavar="JOB|JOB/training-control")
    mint.add_argument(
        "--ttl-minutes",
        type=float,
        default=720.0,
        help=f"how long the URL works (default 720, at most {MAX_TOKEN_TTL_MINUTES}: a week)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "mint":
        args.job = endpoints.job_of(args.job)
        try:
            check_token_ttl("--ttl-minutes", args.ttl_minutes)
        except SpecError as e:
            parser.error(f"{e}; mint a fresh URL when one expires")
    try:
        address = resolve_address(args.cluster or "auto")
        assert address is not None  # "auto" reads RAY_ADDRESS or raises
        ray = connect(address)
        try:
            return _command(ray, args, address)
        finally:
            ray.shutdown()
    except ClusterError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1


def _command(ray: Any, args: argparse.Namespace, address: str) -> int:
    if args.command == "list":
        for status in jobs.list_jobs(ray):
            print(f"{status['job']}  {status['state']:<9}  {status['artifact']}  "
                  f"{_when(status['started_at'])}")  # fmt: skip
        return 0
    handle = jobs.job(ray, args.job, address)
    if args.command == "status":
        status = ray.get(handle.status.remote())
        for field in STATUS_FIELDS:
            value = status.get(field)  # a job of an older driver lacks newer fields
            print(f"{field}: {_when(value) if field.endswith('_at') else value}")
        return 0
    if args.command == "stop":
        stopped = jobs.stop(ray, handle, args.job)
        if stopped is None:
            print(f"kiln: job {args.job} had already finished")
            return 0
        print(f"kiln: job {args.job} is {stopped['state']} (exit code {stopped['exit_code']})")
        return 0
    if args.command in ("endpoints", "mint"):
        return _endpoint(ray, handle, args)
    if args.follow:
        with jobs.detaching() as detached:
            return jobs.follow(ray, handle, args.job, address, detached)
    offset = 0
    while lines := ray.get(handle.read.remote(offset))[0]:
        print("\n".join(lines))
        offset += len(lines)
    return 0


def _endpoint(ray: Any, handle: Any, args: argparse.Namespace) -> int:
    """`endpoints` lists the job's one endpoint; `mint` prints a URL for it (to this caller
    only) and, on stderr, how to reach it."""
    ttl_minutes = args.ttl_minutes if args.command == "mint" else None
    found = jobs.endpoint(ray, handle, args.job, ttl_minutes)
    if args.command == "endpoints":
        print(endpoints.listing(args.job, found))
        print(f"  {endpoints.reach(found)}")
        return 0
    print(endpoints.minted(found))
    print(f"kiln: {endpoints.reach(found)}", file=sys.stderr)
    return 0


def _when(timestamp: float | None) -> str:
    return "-" if timestamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


if __name__ == "__main__":
    sys.exit(main())
