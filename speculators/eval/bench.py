"""`speculators bench`: GuideLLM against vLLM serving the verifier alone and with the speculator.

Both servers get the same flags, the same held-out prompts (real chat text, sent to
/v1/chat/completions so the server applies the chat template), the same profiles, temperature 0.
Two kinds of profile, one stream at a time: fixed length (`synchronous`), with an exact output
budget per request (ignore_eos: every request decodes the same number of tokens, so latencies compare
like for like); and natural length (`synchronous-natural`), where each answer stops at its end of
turn (up to a cap), which is what users decode: text after an end-of-turn token is not
(`--no-fixed-length` runs this one alone: half the GuideLLM time of the shortest sweep). The
spec-decode Prometheus counters are scraped before and after every GuideLLM run; their differences
give the acceptance length and the per-position acceptance rates. The headline acceptance is the
natural-length one when that profile runs. After the profiles each server
answers every prompt once more, alone, with the exact token ids (`return_token_ids`); outputs that
differ between the servers are classified (`OutputJudge`): a numerical near-tie of the verifier, or
diverged.

MT-Bench (`--prompts mt-bench`, `--requests` counting questions): turn 2 is asked after the verifier's
own answer, so the baseline server first answers every turn 1 (temperature 0, natural length up to
the answer cap), and the turn-2 prompts are built from those answers (MtBenchQuestion.second_turn);
both servers are then measured on the same prompts, each question's turn 1 then its turn 2. Prompts
with a category (MT-Bench's, or a `category` in a prompt file's rows) get a per-category pass after
the profiles: every prompt sent once more by our own client, a few requests in flight, each request
timed on both servers and, on the speculator server, its own spec-decode statistics returned with its
reply (vLLM's --per-request-spec-decode-metrics), summed per (category, turn) for acceptance and a
tokens/s ratio per category and turn (`per_category`; a table laid out like the EAGLE and SpecForge
papers' in report.md; `server_counters`, the counters over the whole pass, which they add up to).
Around every GuideLLM run bench also records how busy the machine was with anything but the server and
its client (`machine_load`: other processes and the hypervisor's steal, in average cores;
speculators/eval/machine_load.py): a run with more than a tenth of a core taken is flagged in the
progress line, and report.json's `machine_load` / report.md say whether every speed figure was measured
on a quiet machine.

The load sweep (report.json's `load_sweep`, report.md's "Under load"): after its main profiles each main
server answers the first n(c) prompts at every concurrency c (1, then `--concurrency`), one GuideLLM run
per point at the headline length; then one more speculator server per smaller K (`--sweep-k`, default
every K below the main one) runs the sweep alone. speculators/eval/load_sweep.py turns the points and the
headline acceptance into the speed-up measured and predicted per K and c, the best K per c and the
concurrency where the main K stops paying.

Report folder:
  prompts.jsonl  prompts-natural.jsonl  what GuideLLM read (fixed length, natural length; each prompt twice)
  baseline/ speculator/                 vllm.log, guidellm-<profile>.{json,html,log}, outputs.jsonl,
                                        guidellm-load-c<c>.{json,html,log} (the load sweep's points)
  speculator-k<K>/                      the smaller K's server: vllm.log and its load-sweep points
  report.json  report.md                the comparison, versions, hardware, settings
  acceptance.png  latency.png  throughput.png  concurrency.png (the load sweep's speed-ups)
  mt-bench-answers.jsonl                MT-Bench: the baseline's turn-1 answers the turn-2 prompts hold
  mt-bench/                             --mt-bench N: its prompt files and turn-1 answers (GuideLLM's files in
                                        baseline/ and speculator/ as guidellm-mt-bench-<profile>.*)

`--mt-bench N` measures MT-Bench's first N questions beside other prompts on the same two servers,
after the main prompts: one synchronous GuideLLM profile (natural length where that profile is on) and
the per-category pass, reported under report.json's `mt_bench` and in report.md's last section. It saves
the two server start-ups a second bench would cost (minutes each on a CPU, more on a large model).

This module runs the command: each role's server, the prompts measured against it, the report folder.
The parts it runs live beside it: guidellm.py (GuideLLM's command, run and report), served.py (the
prompts, our own client's requests, the per-category pass, greedy outputs), output_judge.py (the
lossless comparison of served outputs) and bench_report.py (report.json's comparison, report.md, plots).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import write_text_atomic
from speculators.checkpoint.acceptance_profile import write_bench_profile
from speculators.data.mt_bench import mt_bench_questions
from speculators.data.packaged import MT_BENCH
from speculators.errors import SpeculatorsError
from speculators.eval.bench_report import (
    hardware,
    machine_load_summary,
    plot_report,
    prompt_set_report,
    render_markdown,
    versions,
)
from speculators.eval.guidellm import (
    GUIDELLM_ATTEMPTS,
    GuideLLMRecordedNothing,
    guidellm_command,
    guidellm_profile,
    profile_name,
    read_guidellm_report,
    run_guidellm,
)
from speculators.eval.load_sweep import load_sweep_section
from speculators.eval.machine_load import load_note, load_snapshot, other_load
from speculators.eval.output_judge import JUDGE_TOP_LOGITS, OutputJudge, compare_served_outputs
from speculators.eval.served import (
    CATEGORY_STREAMS,
    ROLES,
    BenchPrompts,
    answer_cap,
    bench_prompts,
    category_pass,
    complete_mt_bench,
    greedy_outputs,
    prompt_groups,
    wait_until_idle,
    warm_up,
)
from speculators.models.algorithms import read_speculator_checkpoint
from speculators.precision import with_compute_dtype
from speculators.serving.multinode import refuse_node_flags
from speculators.serving.serve import ServerSettings, VllmServer, acceptance_from_counters, check_vision_serving
from speculators.settings import BenchSettings, node_group_of
from speculators.verifier.quantization import vllm_quantization_args

if TYPE_CHECKING:
    from speculators.data.conversation import Conversation


SWEEP_ROLE = "speculator-k"  # + K: the role (and report subfolder) of a smaller K's server (sweep_role)


def sweep_role(k: int) -> str:
    """The role (and report subfolder) of the speculator server at a smaller K that runs the load sweep alone."""
    return f"{SWEEP_ROLE}{k}"


def role_k(role: str, settings: BenchSettings) -> int:
    """The drafts per step a role's server makes: 0 for the verifier alone, the main K, or a sweep role's own."""
    if role == "baseline":
        return 0
    return int(role.removeprefix(SWEEP_ROLE)) if role.startswith(SWEEP_ROLE) else settings_k(settings)


def settings_k(settings: BenchSettings) -> int:
    if settings.num_speculative_tokens is None:
        raise SpeculatorsError("bench resolves K before it starts a server; this is a bug")
    return settings.num_speculative_tokens


def role_server_settings(role: str, settings: BenchSettings, role_dir: Path) -> ServerSettings:
    """The vLLM server of one role (baseline: the verifier alone; speculator: with the drafter at the main K;
    speculator-k{K}: with the drafter at a smaller K), the one place its settings are made. Over several
    nodes (bench's --nnodes) it is node rank 0's server, whose engine arguments the other nodes'
    `speculators follow` take."""

    k = role_k(role, settings)
    return ServerSettings(
        verifier=settings.verifier,
        speculator=settings.speculator if k else None,
        num_speculative_tokens=k or settings.num_speculative_tokens,
        port=0,
        dtype=settings.dtype,
        quantization=settings.quantization,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        kv_cache_gib=settings.kv_cache_gib,
        tensor_parallel_size=settings.tensor_parallel_size,
        log_path=role_dir / "vllm.log",
        startup_timeout=settings.startup_timeout,
        extra_args=settings.vllm_args,
        nodes=node_group_of(settings),
        # The baseline reports the verifier's raw logits where asked (the lossless judge reads them);
        # requests that ask for none, GuideLLM's, run as without it.
        logprobs_mode="raw_logits" if role == "baseline" else None,
        request_spec_metrics=True,  # the per-category pass reads each reply's own (the speculator's)
        dev_endpoints=True,  # each measurement starts from an empty prefix cache (measure_prompts)
    )


def run_role(
    role: str, settings: BenchSettings, folder: Path, prompts: BenchPrompts, mt_bench: BenchPrompts | None = None
) -> dict[str, Any]:
    """Start one server, measure the main prompts against it (measure_prompts), run the load sweep
    (measure_load), take each prompt's greedy output with token ids, then measure MT-Bench's questions
    beside them (`--mt-bench`) on the same server.
    MT-Bench's prompts are completed by the first server started, the baseline (complete_mt_bench)."""

    with started_server(role, settings, folder) as server:
        results: dict[str, Any] = {"server": server.describe()}
        results.update(measure_prompts(role, server, settings, folder, prompts, settings.profiles()))
        results["load"] = measure_load(
            role, server, settings, folder, len(prompts.conversations), single_stream_profile(settings, results)
        )
        results["outputs"] = served_greedy_outputs(role, server, settings, folder, len(prompts.conversations))
        if mt_bench is not None:
            results["mt_bench"] = measure_prompts(
                role, server, mt_bench_settings(settings), folder, mt_bench, [mt_bench_profile(settings)], MT_BENCH_DIR
            )
    return results


def run_sweep_role(role: str, settings: BenchSettings, folder: Path, prompts: BenchPrompts) -> dict[str, Any]:
    """A speculator server at a smaller K (sweep_role): the load sweep alone, on the prompt files the main
    servers read."""
    with started_server(role, settings, folder) as server:
        load = measure_load(role, server, settings, folder, len(prompts.conversations))
        return {"server": server.describe(), "load": load}


@contextmanager
def started_server(role: str, settings: BenchSettings, folder: Path) -> Iterator[VllmServer]:
    """One role's vLLM server, started, ready and warmed up (its log in the role's folder); stopped after."""
    role_dir = folder / role
    role_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"[{role}] starting vLLM (log {role_dir / 'vllm.log'})", flush=True)
    with VllmServer(role_server_settings(role, settings, role_dir)) as server:
        print(f"[{role}] ready at {server.url} after {time.perf_counter() - started:.0f} s", flush=True)
        warm_up(server.url, server.model_name)
        yield server


def served_greedy_outputs(
    role: str, server: VllmServer, settings: BenchSettings, folder: Path, requests: int
) -> list[dict[str, Any]]:
    """Each prompt's greedy output with token ids, one at a time (the lossless comparison's input), also
    written to the role's outputs.jsonl."""
    started_outputs = time.perf_counter()
    compared = min(settings.lossless_prompts or requests, requests)
    outputs = greedy_outputs(
        server.url,
        server.model_name,
        folder / "prompts.jsonl",
        settings.output_tokens,
        compared,
        top_logits=JUDGE_TOP_LOGITS if role == "baseline" else 0,
    )
    lines = "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs)
    write_text_atomic(folder / role / "outputs.jsonl", lines)
    print(
        f"[{role}] greedy outputs of {len(outputs)} prompts, one at a time, with token ids "
        f"({time.perf_counter() - started_outputs:.0f} s)",
        flush=True,
    )
    return outputs


# A load-sweep point keeps what the analysis and the report read of a GuideLLM run's summary.
LOAD_POINT_KEYS = (
    *("output_tokens_per_s", "tpot_ms", "itl_ms", "ttft_ms", "output_tokens_mean"),
    *("requests", "spec_decode", "machine_load"),
)


def load_point(summary: dict[str, Any], k: int) -> dict[str, Any]:
    """A load-sweep point: what the analysis and the report read of a GuideLLM run's summary (the
    spec-decode counters on a drafting server only)."""
    return {key: summary[key] for key in LOAD_POINT_KEYS if k or key != "spec_decode"}


def single_stream_profile(settings: BenchSettings, results: dict[str, Any]) -> dict[str, Any] | None:
    """The main synchronous profile at the sweep's length, which the sweep's c = 1 point reuses where it
    measured the same prompts (n(1) = every prompt): one GuideLLM run fewer on each main server."""
    return results["profiles"].get("synchronous-natural" if settings.load_natural() else "synchronous")


def measure_load(
    role: str,
    server: VllmServer,
    settings: BenchSettings,
    folder: Path,
    prompts: int,
    single_stream: dict[str, Any] | None = None,
) -> dict[int, Any]:
    """The load sweep on one server: one GuideLLM run per concurrency (synchronous at 1, else that many
    streams) on the first n(c) prompts (BenchSettings.load_points), at the headline length, the counters,
    prefix cache and machine load taken around it as for every profile (run_profile). c -> the point.
    `single_stream`: the server's main synchronous profile at this length, taken as the c = 1 point when
    it sent the same prompts (n(1) = all of them)."""
    role_dir = folder / role
    natural = settings.load_natural()
    data = folder / ("prompts-natural.jsonl" if natural else "prompts.jsonl")
    k = role_k(role, settings)
    points: dict[int, Any] = {}
    for c, requests in settings.load_points(prompts):
        if c == 1 and single_stream is not None and requests == prompts:
            points[c] = load_point(single_stream, k)
            print(f"[{role}] load c=1: the main synchronous profile's {requests} requests", flush=True)
            continue
        paths = {kind: role_dir / f"guidellm-load-c{c}.{kind}" for kind in ("json", "html", "log")}
        profile = {"kind": "synchronous"} if c == 1 else {"kind": "concurrent", "streams": c}
        run_started = time.perf_counter()
        cap, label = settings.natural_max_tokens if natural else None, f"[{role}] load c={c}"
        summary = guidellm_run(role, server, settings, folder, data, profile, requests, paths, cap, label)
        points[c] = load_point(summary, k)
        acceptance = summary["spec_decode"]["acceptance_length"]
        print(
            f"[{role}] load c={c}: {requests} requests, {summary['output_tokens_per_s']:.1f} output tokens/s, "
            f"TPOT {summary['tpot_ms']:.2f} ms"
            + (f", acceptance length {acceptance:.2f}" if k and acceptance else "")
            + f" ({time.perf_counter() - run_started:.0f} s)"
            + load_note(summary["machine_load"]),
            flush=True,
        )
    return points


def guidellm_run(
    role: str,
    server: VllmServer,
    settings: BenchSettings,
    folder: Path,
    data: Path,
    profile: dict[str, Any],
    requests: int,
    paths: dict[str, Path],
    max_tokens: int | None,
    label: str,
) -> dict[str, Any]:
    """One GuideLLM run of `requests` rows of `data` against the server (run_profile, with what moved
    around it); `max_tokens` caps answers of natural length. A failed request fails bench."""
    command = guidellm_command(
        server.url,
        server.model_name,
        server.model_dir,
        data,
        guidellm_profile(profile),
        requests,
        paths["json"],
        paths["html"],
        max_tokens,
    )
    summary = run_profile(server, command, paths, requests, folder, settings, label)
    refuse_errored_requests(summary, role, paths["json"], folder / role)
    return summary


def refuse_errored_requests(summary: dict[str, Any], role: str, json_path: Path, role_dir: Path) -> None:
    if summary["requests"].get("errored"):
        raise SpeculatorsError(
            f"{summary['requests']['errored']} GuideLLM requests failed against the "
            f"{role} server; see {json_path} and {role_dir / 'vllm.log'}"
        )


MT_BENCH_DIR = "mt-bench"  # the report folder's subfolder for MT-Bench beside the main prompts (--mt-bench)


def mt_bench_settings(settings: BenchSettings) -> BenchSettings:
    """The settings MT-Bench beside the main prompts runs with: its questions, the same profile otherwise."""

    return settings.model_copy(update={"prompts": MT_BENCH, "requests": settings.mt_bench, "mt_bench": 0})


def mt_bench_profile(settings: BenchSettings) -> dict[str, Any]:
    """MT-Bench beside the main prompts runs one GuideLLM profile: synchronous, at natural length where
    that profile is on (what users decode, and how the field reports MT-Bench), else fixed length."""
    return {"kind": "synchronous", "natural": bool(settings.natural_max_tokens)}


def measure_prompts(
    role: str,
    server: VllmServer,
    settings: BenchSettings,
    folder: Path,
    prompts: BenchPrompts,
    profiles: list[dict[str, Any]],
    subfolder: str = "",
) -> dict[str, Any]:
    """One set of prompts against one server: MT-Bench's turn 2 built first where needed (baseline),
    every GuideLLM profile with the counters scraped around each run, then the per-category pass
    (prompts with a category). `subfolder`: where a second set's prompt files go, its GuideLLM files
    named after it in the role's folder."""

    role_dir = folder / role
    data_dir = folder / subfolder if subfolder else folder
    data_dir.mkdir(parents=True, exist_ok=True)
    label = f"{role}{'/' + subfolder if subfolder else ''}"
    if not prompts.conversations:
        complete_mt_bench(prompts, server, settings, data_dir)
    results: dict[str, Any] = {"profiles": {}}
    requests = len(prompts.conversations)
    for profile in profiles:
        name = profile_name(profile)
        stem = f"guidellm-{subfolder + '-' if subfolder else ''}{name}"
        paths = {kind: role_dir / f"{stem}.{kind}" for kind in ("json", "html", "log")}
        natural = profile["natural"]
        length = (
            f"answers of natural length (at most {settings.natural_max_tokens} tokens)"
            if natural
            else f"{settings.output_tokens} output tokens each"
        )
        print(f"[{label}] {name}: GuideLLM sends {requests} requests, {length} (log {paths['log']})", flush=True)
        run_started = time.perf_counter()
        data = data_dir / ("prompts-natural.jsonl" if natural else "prompts.jsonl")
        cap = settings.natural_max_tokens if natural else None
        summary = guidellm_run(role, server, settings, folder, data, profile, requests, paths, cap, f"[{label}] {name}")
        results["profiles"][name] = summary
        acceptance = summary["spec_decode"]["acceptance_length"]
        print(
            f"[{label}] {name}: TPOT {summary['tpot_ms']:.2f} ms, TTFT {summary['ttft_ms']:.1f} ms, "
            f"{summary['output_tokens_per_s']:.1f} output tokens/s, {summary['output_tokens_mean']:.0f} tokens "
            f"per answer"
            + (f", acceptance length {acceptance:.2f}" if acceptance else "")
            + f" ({time.perf_counter() - run_started:.0f} s)"
            + load_note(summary["machine_load"]),
            flush=True,
        )
    if prompt_groups(prompts.conversations):
        results["categories"] = measure_categories(server, prompts.conversations, settings, label)
    return results


def run_profile(
    server: VllmServer,
    command: list[str],
    paths: dict[str, Path],
    requests: int,
    folder: Path,
    settings: BenchSettings,
    label: str,
) -> dict[str, Any]:
    """One GuideLLM run of a profile against the server (read_guidellm_report's summary), with what moved
    around it: the spec-decode counters, the prefix cache and the machine's load. Taken again, up to
    GUIDELLM_ATTEMPTS times, when GuideLLM recorded fewer requests than it was given (none: it then fails
    with GuideLLMRecordedNothing)."""

    for attempt in range(1, GUIDELLM_ATTEMPTS + 1):
        wait_until_idle(server.url)  # (a request an earlier attempt left in flight is not counted)
        # The baseline has answered MT-Bench's first turns (complete_mt_bench) and every server its
        # earlier runs' prompts: cached prefixes would cut one server's TTFT (and GuideLLM's TPOT,
        # which counts it) for prompts the other prefills.
        server.reset_prefix_cache()
        before, load_before = server.metrics(), load_snapshot(server.process_groups())
        try:
            run_guidellm(command, paths["log"], folder, settings.guidellm_timeout)
        except GuideLLMRecordedNothing:
            if attempt == GUIDELLM_ATTEMPTS:
                raise
            print(f"{label}: GuideLLM ended the run before recording any request; running it again", flush=True)
            continue
        load = other_load(load_before, load_snapshot(server.process_groups()))
        summary = read_guidellm_report(paths["json"])
        after = server.metrics()
        summary["spec_decode"] = acceptance_from_counters(before, after)
        summary["prefix_cache"] = {
            "query_tokens": after["prefix_cache_queries"] - before["prefix_cache_queries"],
            "hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        }
        summary["machine_load"] = load
        recorded = summary["requests"].get("successful", 0) + summary["requests"].get("errored", 0)
        if recorded >= requests or attempt == GUIDELLM_ATTEMPTS:
            break
        # GuideLLM 0.8.1 now and then ends a run with its last request still in flight (its
        # scheduler's end state: 3 processed of 4 created, 1 processing); the run is taken again.
        print(f"{label}: GuideLLM recorded {recorded} of {requests} requests; running it again", flush=True)
    return summary


def measure_categories(
    server: VllmServer, conversations: list[Conversation], settings: BenchSettings, label: str
) -> dict[str, Any]:
    """The per-category pass (category_pass) from an empty prefix cache, with its progress line."""

    started = time.perf_counter()
    server.reset_prefix_cache()
    categories = category_pass(server, conversations, settings)
    print(
        f"[{label}] per-category pass: {sum(g['prompts'] for g in categories['groups'])} prompts in "
        f"{len(categories['groups'])} groups (category, turn), "
        f"{CATEGORY_STREAMS} requests in flight, answers of natural length (at most "
        f"{answer_cap(settings)} tokens) ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return categories


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Both servers, every profile, the report folder; returns report.json's content."""
    settings = with_compute_dtype(settings, on_vllm=True)  # (the CLI resolved it already)

    if settings.prompts == MT_BENCH and settings.mt_bench:
        raise SpeculatorsError(
            f"--mt-bench {settings.mt_bench} adds MT-Bench beside other prompts, and --prompts is mt-bench already; "
            "drop --mt-bench and set --requests to the number of questions"
        )
    folder = Path(settings.output)
    config = read_speculator_checkpoint(settings.speculator).config  # fails early on a bad checkpoint
    k = settings.num_speculative_tokens or config.speculative_tokens
    sweep_ks = smaller_ks(settings, k)
    vllm_quantization_args(settings.quantization)  # as does a scheme this vLLM cannot run

    # (the node group: bench's own flags, which the other nodes follow; over several nodes, only what they accept)
    refuse_node_flags(settings.vllm_args, node_group_of(settings))
    if any(arg.split("=")[0] == "--quantization" for arg in settings.vllm_args):
        raise SpeculatorsError(
            "pass the verifier's quantization as bench's own --quantization (not after --), so the lossless "
            "judge re-scores with the same FP8 verifier the servers run"
        )

    check_vision_serving(settings.verifier)
    folder.mkdir(parents=True, exist_ok=True)
    settings = settings.model_copy(update={"num_speculative_tokens": k})
    prompts = bench_prompts(settings, folder)
    if not prompts.questions:  # (MT-Bench's `requests` count questions)
        settings = settings.model_copy(update={"requests": len(prompts.conversations)})
    mt_bench = None
    if settings.mt_bench:
        mt_bench = BenchPrompts(MT_BENCH_DIR, questions=mt_bench_questions(settings.mt_bench))
    started = time.perf_counter()
    runs = {role: run_role(role, settings, folder, prompts, mt_bench) for role in ROLES}
    for smaller in sweep_ks:  # (after the main servers: their prompt files, MT-Bench's included, are written)
        runs[sweep_role(smaller)] = run_sweep_role(sweep_role(smaller), settings, folder, prompts)
    report = measurements_report(settings, prompts, runs, mt_bench, started)
    judge = OutputJudge(settings.verifier, settings.dtype, quantization=settings.quantization, max_chunk=k + 1)
    report = judge_and_write(report, folder, lambda: compare_served_outputs(*served_outputs(runs), judge))
    # acceptance_profile.json beside report.json, and with --attach-profile in the checkpoint
    write_bench_profile(report, folder, settings.speculator, settings.verifier, attach=settings.attach_profile)
    return report


def smaller_ks(settings: BenchSettings, k: int) -> list[int]:
    """The smaller K the load sweep serves beside the main K (`sweep_k`; default every K from 1 to K - 1)."""
    chosen = list(range(1, k)) if settings.sweep_k is None else settings.sweep_k
    wrong = [each for each in chosen if not 1 <= each < k]
    if wrong:
        raise SpeculatorsError(
            f"--sweep-k {','.join(map(str, chosen))}: {wrong[0]} is not a smaller K than the main K = {k}; "
            f"pick values in 1..{k - 1} (or --sweep-k= for none)"
        )
    return sorted(set(chosen))


def served_outputs(runs: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return runs["baseline"]["outputs"], runs["speculator"]["outputs"]


def measurements_report(
    settings: BenchSettings,
    prompts: BenchPrompts,
    runs: dict[str, Any],
    mt_bench: BenchPrompts | None,
    started: float,
) -> dict[str, Any]:
    """report.json's content from both servers' measurements, the lossless comparison not yet made."""
    report = {
        "settings": settings.model_dump(),
        "prompts": prompts.info,
        "versions": versions(),
        "hardware": hardware(),
        "servers": {role: run["server"] for role, run in runs.items()},
        **prompt_set_report(runs["baseline"], runs["speculator"], settings),
        "outputs": {"not_judged": "the lossless comparison runs after the measurements are written"},
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    if mt_bench is not None:
        report["mt_bench"] = {
            "prompts": mt_bench.info,
            **prompt_set_report(
                runs["baseline"]["mt_bench"], runs["speculator"]["mt_bench"], mt_bench_settings(settings)
            ),
        }
    report["load_sweep"] = load_sweep_report(settings, prompts, runs, report["acceptance"])
    report["machine_load"] = machine_load_summary(report)
    return report


def load_sweep_report(
    settings: BenchSettings, prompts: BenchPrompts, runs: dict[str, Any], acceptance: dict[str, Any]
) -> dict[str, Any]:
    """report.json's `load_sweep`: every server's points (k -> c) and their analysis against the headline
    acceptance profile (speculators.eval.load_sweep)."""
    points = {role_k(role, settings): run["load"] for role, run in runs.items()}
    length = acceptance.get("length", "fixed")
    profile = "synchronous-natural" if length == "natural" else "synchronous"
    return load_sweep_section(
        length="natural" if settings.load_natural() else "fixed",
        requests=dict(settings.load_points(len(prompts.conversations))),
        k=settings_k(settings),
        serving_concurrency=settings.serving_concurrency,
        acceptance=acceptance,
        source=f"the main K's {profile} profile on the {prompts.info.get('count')} prompts of {prompts.source}",
        points=points,
    )


def judge_and_write(report: dict[str, Any], folder: Path, compare: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Write the measurements (report.json, report.md, plots), then make the lossless comparison and write
    them again with it: a judge that fails (a verifier that will not load, a bug) loses no measurement, and
    the report says why it holds no comparison."""
    write_report(report, folder)
    try:
        report["outputs"] = compare()
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0][:300]
        report["outputs"] = {"not_judged": f"the lossless comparison failed ({type(error).__name__}: {first})"}
        write_report(report, folder)
        print(f"[bench] the measurements are in {folder / 'report.json'}; the lossless comparison failed", flush=True)
        raise
    write_report(report, folder)
    return report


def write_report(report: dict[str, Any], folder: Path) -> None:
    write_text_atomic(folder / "report.json", json.dumps(report, indent=2) + "\n")
    write_text_atomic(folder / "report.md", render_markdown(report))
    plot_report(report, folder)
