"""The code location: five assets per variant, their checks, jobs, the retraining schedule.

Assets are thin: resolve the variant, hand the step to the runner (Pipes), pass on what the workload
reports. Loads in about a second: no torch, no library import at module level.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from speculators_assets.environment import Settings
from speculators_assets.resources import PipelineRunner, StorageRoot
from speculators_assets.steps import BENCHMARK_REPORT, STEPS, TRAINED_DRAFTER, StepSpec
from speculators_assets.variants import Variant, load_variants

GROUP = "speculators"
OWNERS = ["team:ml-platform"]
CODE_VERSION = "1"


class StepConfig(dg.Config):
    force: bool = Field(default=False, description="recompute even if the inputs did not change")


def run_step(
    context: dg.AssetExecutionContext,
    variants: dict[str, Variant],
    storage: StorageRoot,
    runner: PipelineRunner,
    step: str,
    force: bool,
) -> Iterator[Any]:
    variant = variants[context.partition_key]
    root = str(Path(storage.path).expanduser().resolve()) if runner.mode == "local" else storage.path
    extras = {"step": step, "variant": variant.model_dump(mode="json"), "root": root, "force": force}
    invocation = runner.run(context, variant, step, root, extras=extras)
    yield from invocation.get_results()


def check_specs(step: StepSpec) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(name=c.name, asset=step.name, description=c.description, blocking=c.blocking)
        for c in step.checks
    ]


def step_asset(
    step: StepSpec,
    variants: dict[str, Variant],
    partitions: dg.PartitionsDefinition,
) -> dg.AssetsDefinition:
    @dg.asset(
        name=step.name,
        partitions_def=partitions,
        group_name=GROUP,
        kinds=set(step.kinds),
        owners=OWNERS,
        description=step.description,
        code_version=CODE_VERSION,
        deps=[step.upstream] if step.upstream else [],
        check_specs=check_specs(step),
        pool="gpu" if step.gpu_pool else None,
    )
    def _asset(context: dg.AssetExecutionContext, config: StepConfig, storage: StorageRoot, runner: PipelineRunner):
        yield from run_step(context, variants, storage, runner, step.name, config.force)

    return _asset


# ----- retraining when the data changed ------------------------------------------------------------


def source_fingerprint_of(variant: Variant) -> str:
    """The key raw_prompts records as `source_fingerprint`."""
    from speculators_assets.workload import key_of, source_fingerprints

    return key_of(source_fingerprints(variant))


def last_drafter_fingerprint(instance: dg.DagsterInstance, variant: str) -> str | None:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(TRAINED_DRAFTER), asset_partitions=[variant]), limit=1
    ).records
    if not records:
        return None
    metadata = records[0].asset_materialization.metadata
    value = metadata.get("source_fingerprint")
    return None if value is None else str(value.value)


def retraining_requests(
    instance: dg.DagsterInstance, variants: dict[str, Variant], names: list[str] | None = None
) -> list[dg.RunRequest]:
    """A run of the lineage for each variant whose prompt source changed since its last drafter."""
    requests = []
    for name in names or sorted(variants):
        fingerprint = source_fingerprint_of(variants[name])
        if fingerprint != last_drafter_fingerprint(instance, name):
            requests.append(
                dg.RunRequest(
                    partition_key=name,
                    run_key=f"retrain-{name}-{fingerprint}",
                    tags={"speculators/reason": "prompt source changed"},
                )
            )
    return requests


def automated_variants(variants: dict[str, Variant], settings: Settings | None = None) -> list[str]:
    """SPECULATORS_AUTOMATED_VARIANTS (comma-separated, read at each tick) limits the schedule; default: all."""
    chosen = list((Settings.from_env() if settings is None else settings).automated_variants)
    unknown = sorted(set(chosen) - set(variants))
    if unknown:
        raise ValueError(f"SPECULATORS_AUTOMATED_VARIANTS names unknown variants {unknown}; known: {sorted(variants)}")
    return chosen or sorted(variants)


# ----- the definitions -----------------------------------------------------------------------------


def build_defs(variants: dict[str, Variant] | None = None, settings: Settings | None = None) -> dg.Definitions:
    """The code location; `settings` default: the environment's (environment.py)."""
    settings = Settings.from_env() if settings is None else settings
    variants = load_variants(settings) if variants is None else variants
    partitions = dg.StaticPartitionsDefinition(sorted(variants))
    assets = [step_asset(step, variants, partitions) for step in STEPS]
    lineage = dg.define_asset_job(
        "build_lineage",
        selection=dg.AssetSelection.all(),
        partitions_def=partitions,
        description="Materialize the whole lineage for a variant (partition).",
    )
    refresh = dg.define_asset_job(
        "refresh_benchmark",
        selection=dg.AssetSelection.assets(BENCHMARK_REPORT),
        partitions_def=partitions,
        config={"ops": {BENCHMARK_REPORT: {"config": {"force": True}}}},
        description="Re-run the benchmark of a variant's published checkpoint (CI calls this).",
    )

    @dg.schedule(
        job=lineage,
        cron_schedule="0 3 * * *",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description="Daily: retrain (warm start) the variants whose prompt source changed since their "
        "last drafter; nothing runs otherwise.",
    )
    def retrain_on_new_data(context: dg.ScheduleEvaluationContext):
        requests = retraining_requests(context.instance, variants, automated_variants(variants))
        return requests or dg.SkipReason("no prompt source changed since the last drafter")

    return dg.Definitions(
        assets=assets,
        jobs=[lineage, refresh],
        schedules=[retrain_on_new_data],
        resources={
            "storage": StorageRoot(path=settings.storage_root),
            "runner": PipelineRunner(
                mode=settings.runner,
                namespace=settings.k8s_namespace,
                workload_image=settings.workload_image,
                storage_claim=settings.storage_claim,
                plan_secret=settings.plan_secret,
            ),
        },
    )


defs = build_defs()
