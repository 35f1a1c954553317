"""`python -m kiln.control mint RUN_DIR [--ttl-minutes N]`: print a fresh control URL for a run.

Works for whoever can read RUN_DIR/control/key (the user who started the run): the key signs the
token, so nothing is asked of the running server.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from kiln.control.tokens import EndpointError, read_endpoint, token_expiring_in
from kiln_contract.parsing import SpecError
from kiln_contract.processes import is_running
from kiln_contract.vocabulary import MAX_TOKEN_TTL_MINUTES, check_token_ttl


def mint(run_dir: Path, ttl_minutes: float) -> str:
    endpoint, key = read_endpoint(run_dir)
    if endpoint.hostname == socket.gethostname() and not is_running(endpoint.pid):
        raise EndpointError(
            f"the control server recorded under {run_dir} (pid {endpoint.pid}) is not running; "
            "the run has ended or crashed"
        )
    return endpoint.url(token_expiring_in(key, ttl_minutes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.control")
    commands = parser.add_subparsers(dest="command", required=True)
    mint_parser = commands.add_parser("mint", help="print a fresh capability URL for a running run")
    mint_parser.add_argument("run_dir", type=Path, help="the run's output directory")
    mint_parser.add_argument(
        "--ttl-minutes",
        type=float,
        default=720.0,
        help=f"how long the URL works (default 720, at most {MAX_TOKEN_TTL_MINUTES}: a week)",
    )
    args = parser.parse_args(argv)
    try:
        check_token_ttl("--ttl-minutes", args.ttl_minutes)
    except SpecError as e:
        parser.error(f"{e}; mint a fresh URL when one expires")
    try:
        print(mint(args.run_dir, args.ttl_minutes))
    except EndpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
