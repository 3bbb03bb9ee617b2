"""`speculators-assets`: operate the code location from CI and from a terminal.

    speculators-assets refresh-benchmark --url https://dagster.example --variant smollm2_135m [--token T]

launches the `refresh_benchmark` job for a variant (partition) on a running deployment through
Dagster's GraphQL API, waits for it (at most --timeout seconds), prints the outcome, and exits non-zero
if the run failed (a failed blocking check fails the run). A --token goes only over https:// or to this
machine (loopback), unless --allow-insecure-token says the network to the host is private.

    speculators-assets demo [--variant smollm2_135m]

materializes a variant's whole lineage on this machine through Dagster (`make demo`).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import ParseResult, urlparse

from speculators.errors import SpeculatorsError, argv_problem, shorten, user_error_line
from speculators.flags import number
from speculators_assets.steps import BENCHMARK_REPORT
from speculators_assets.variants import VariantError

TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine: `localhost` or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def parse_url(url: str) -> tuple[ParseResult, int]:
    """The webserver's address and port; one error for anything that is not http(s) with a host."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    try:
        port = parsed.port
    except ValueError:  # urlparse checks the port only when asked
        port = -1
    if not parsed.hostname or port == -1 or parsed.scheme not in ("http", "https"):
        raise SpeculatorsError(f"--url {url} is not an http(s) address with a host; pass e.g. http://127.0.0.1:3000")
    return parsed, port or (443 if parsed.scheme == "https" else 80)


def check_token_transport(parsed: ParseResult, token: str | None, allow_insecure_token: bool) -> None:
    """A bearer token is a password: over plain http:// anyone on the way reads it, so it goes only over
    https:// or to this machine, unless the user says the network is private."""
    host = parsed.hostname or ""
    if token and parsed.scheme == "http" and not is_loopback(host) and not allow_insecure_token:
        raise SpeculatorsError(
            f"--token would go in clear text over http:// to {host}, where anyone on the way can read it; use an "
            f"https:// --url, or pass --allow-insecure-token if the network to {host} is private"
        )


def graphql_client(url: str, token: str | None, timeout: int, allow_insecure_token: bool = False):
    from dagster_graphql import DagsterGraphQLClient

    parsed, port = parse_url(url)
    check_token_transport(parsed, token, allow_insecure_token)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return DagsterGraphQLClient(
        parsed.hostname or "",
        port_number=port,
        use_https=parsed.scheme == "https",
        headers=headers,
        timeout=timeout,
    )


Reply = TypeVar("Reply")


def from_reply(url: str, asked: str, query: Callable[[], Reply]) -> Reply:
    """`query()`, whose GraphQL reply the client reads without checking it: a reply without the field it
    expects (KeyError), of another shape (TypeError) or with a status Dagster does not have (ValueError)
    is one error naming what was missing, not a traceback from inside dagster_graphql."""
    try:
        return query()
    except KeyError as error:
        missing = f"has no field {shorten(str(error.args[0]) if error.args else '?', 80)!r}"
    except TypeError:
        missing = "is not of the shape Dagster's GraphQL API answers"
    except ValueError as error:  # (DagsterRunStatus of a status it does not know)
        missing = f"holds a value Dagster does not have ({shorten(str(error), 120)})"
    raise SpeculatorsError(
        f"the reply of {url} to {asked} {missing}; check that --url is the Dagster webserver (its GraphQL API "
        f"at /graphql) of a Dagster version this client speaks"
    )


def client_error(error: Exception) -> str:
    """The reason a GraphQL call failed, on one line: the client's own message repeats the whole query."""
    cause = error.__cause__
    text = str(cause) if cause is not None else (str(error).strip().splitlines() or [type(error).__name__])[0]
    return shorten(text)


def refresh_benchmark(
    url: str,
    variant: str,
    token: str | None = None,
    location: str = "speculators_pipeline",
    job: str = "refresh_benchmark",
    timeout: float = 7200.0,
    poll: float = 5.0,
    allow_insecure_token: bool = False,
) -> int:
    from dagster_graphql import DagsterGraphQLClientError

    for name, value in (("timeout", timeout), ("poll", poll)):  # (NaN would never end the wait)
        if not (0 < value < float("inf")):
            raise SpeculatorsError(f"{name} {value} is not a finite number of seconds above 0; pass e.g. 7200")
    client = graphql_client(url, token, timeout=60, allow_insecure_token=allow_insecure_token)
    try:
        run_id: Any = from_reply(
            url,
            f"the launch of {job}",
            lambda: client.submit_job_execution(
                job,
                repository_location_name=location,
                repository_name="__repository__",
                run_config={"ops": {BENCHMARK_REPORT: {"config": {"force": True}}}},  # measure anew, never reuse
                tags={"dagster/partition": variant, "speculators/trigger": "ci"},
            ),
        )
    except DagsterGraphQLClientError as error:
        print(f"error: could not launch {job} for variant {variant} at {url}: {client_error(error)}", file=sys.stderr)
        return 2
    if not isinstance(run_id, str) or not run_id:
        raise SpeculatorsError(
            f"the reply of {url} to the launch of {job} names no run id ({shorten(repr(run_id), 80)}); check that "
            f"--url is the Dagster webserver"
        )
    print(f"launched {job} for {variant}: run {run_id} ({url.rstrip('/')}/runs/{run_id})", flush=True)
    deadline = time.monotonic() + timeout
    status = "STARTING"
    while True:
        try:
            status = from_reply(url, f"the status of run {run_id}", lambda: client.get_run_status(run_id)).value
        except DagsterGraphQLClientError as error:
            print(f"warning: status query failed ({client_error(error)}); retrying", file=sys.stderr)
        if status in TERMINAL:
            break
        left = deadline - time.monotonic()
        if left <= 0:  # (a run that stays RUNNING, or a server that keeps failing, ends here)
            print(f"error: run {run_id} still {status} after {timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(min(poll, left))
    print(f"run {run_id} finished: {status}", flush=True)
    return 0 if status == "SUCCESS" else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if (problem := argv_problem(argv)) is not None:  # (as `speculators` does: before argparse echoes it)
        print(f"error: {problem}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="speculators-assets", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    refresh = commands.add_parser("refresh-benchmark", help="re-run a variant's benchmark on a deployment; wait")
    refresh.add_argument("--url", required=True, help="Dagster webserver, e.g. https://dagster.example")
    refresh.add_argument("--variant", required=True, help="the partition, e.g. smollm2_135m")
    refresh.add_argument("--token", help="bearer token for a deployment behind an auth proxy (https:// or loopback)")
    refresh.add_argument(
        "--allow-insecure-token",
        action="store_true",
        help="send --token over plain http:// to another host (only on a private network)",
    )
    refresh.add_argument("--location", default="speculators_pipeline", help="code location name")
    refresh.add_argument(
        "--timeout", type=number(float, 1), default=7200.0, help="seconds to wait for the run (default 7200)"
    )
    demo = commands.add_parser(
        "demo", help="materialize a variant's whole lineage here, through Dagster; print the results (`make demo`)"
    )
    demo.add_argument("--variant", default="smollm2_135m", help="the partition (default: smollm2_135m)")
    demo.add_argument("--dagster-home", help="where the run is recorded (default: $DAGSTER_HOME or .dagster)")
    demo.add_argument("--storage", help="artifact root (default: $SPECULATORS_STORAGE_ROOT or .speculators-storage)")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from speculators_assets.demo import run_demo

            return run_demo(args.variant, args.dagster_home, args.storage)
        return refresh_benchmark(
            args.url,
            args.variant,
            args.token,
            args.location,
            timeout=args.timeout,
            allow_insecure_token=args.allow_insecure_token,
        )
    except VariantError as error:  # the user's to fix: one line, no traceback, like `speculators`
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # the same edge as `speculators`: what only the input raises is one line
        line = user_error_line(error, vars(args))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
