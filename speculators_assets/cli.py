"""`speculators-assets`: operate the code location from CI and from a terminal.

    speculators-assets refresh-benchmark --url http://dagster.example:3000 --variant smollm2_135m [--token T]

launches the `refresh_benchmark` job for a variant (partition) on a running deployment through
Dagster's GraphQL API, waits for it, prints the outcome, and exits non-zero if
the run failed (a failed blocking check fails the run).

    speculators-assets demo [--variant smollm2_135m]

materializes a variant's whole lineage on this machine through Dagster (`make demo`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from urllib.parse import urlparse

from speculators.errors import SpeculatorsError, shorten
from speculators_assets.variants import VariantError

TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}
# A variant file that cannot be used, a bad flag or setting: printed as one `error:` line, exit code 2.
USER_ERRORS = (VariantError, SpeculatorsError)


def graphql_client(url: str, token: str | None, timeout: int):
    from dagster_graphql import DagsterGraphQLClient

    parsed = urlparse(url if "://" in url else f"http://{url}")
    try:
        port = parsed.port
    except ValueError:  # urlparse checks the port only when asked
        port = -1
    if not parsed.hostname or port == -1 or parsed.scheme not in ("http", "https"):
        raise SpeculatorsError(f"--url {url} is not an http(s) address with a host; pass e.g. http://127.0.0.1:3000")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return DagsterGraphQLClient(
        parsed.hostname,
        port_number=port or (443 if parsed.scheme == "https" else 80),
        use_https=parsed.scheme == "https",
        headers=headers,
        timeout=timeout,
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
) -> int:
    from dagster_graphql import DagsterGraphQLClientError

    try:
        client = graphql_client(url, token, timeout=60)  # (connects: fetches the schema)
        run_id = client.submit_job_execution(
            job,
            repository_location_name=location,
            repository_name="__repository__",
            run_config={"ops": {"benchmark_report": {"config": {"force": True}}}},  # measure anew, never reuse
            tags={"dagster/partition": variant, "speculators/trigger": "ci"},
        )
    except DagsterGraphQLClientError as error:
        print(f"error: could not launch {job} for variant {variant} at {url}: {client_error(error)}", file=sys.stderr)
        return 2
    print(f"launched {job} for {variant}: run {run_id} ({url.rstrip('/')}/runs/{run_id})", flush=True)
    deadline = time.monotonic() + timeout
    status = "STARTING"
    while True:
        try:
            status = client.get_run_status(run_id).value
        except DagsterGraphQLClientError as error:
            print(f"warning: status query failed ({client_error(error)}); retrying", file=sys.stderr)
        if status in TERMINAL:
            break
        if time.monotonic() > deadline:
            print(f"error: run {run_id} still {status} after {timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(poll)
    print(f"run {run_id} finished: {status}", flush=True)
    return 0 if status == "SUCCESS" else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speculators-assets", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    refresh = commands.add_parser("refresh-benchmark", help="re-run a variant's benchmark on a deployment; wait")
    refresh.add_argument("--url", required=True, help="Dagster webserver, e.g. http://127.0.0.1:3000")
    refresh.add_argument("--variant", required=True, help="the partition, e.g. smollm2_135m")
    refresh.add_argument("--token", help="bearer token for a deployment behind an auth proxy")
    refresh.add_argument("--location", default="speculators_pipeline", help="code location name")
    refresh.add_argument("--timeout", type=float, default=7200.0, help="seconds to wait for the run")
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
        return refresh_benchmark(args.url, args.variant, args.token, args.location, timeout=args.timeout)
    except USER_ERRORS as error:  # the user's to fix: one line, no traceback, like `speculators`
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
