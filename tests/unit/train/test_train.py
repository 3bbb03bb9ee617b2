"""EAGLE-3 training: TTT loss against a plain computation, overfitting, kill-and-resume, DDP on CPU, errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from speculators.checkpoint.validation import validate_checkpoint
from speculators.errors import SpeculatorsError
from speculators.models.eagle3 import Eagle3Drafter
from speculators.models.ttt import expected_acceptance_length, ttt_loss
from speculators.train.trainer import TrainConfig, train
from tests.conftest import PEAKED_AUX, one_torch_thread
from tests.paths import ROOT_DIR

ROOT = ROOT_DIR
AUX = PEAKED_AUX


def config_for(store, verifier, output, **overrides) -> TrainConfig:
    options = dict(
        store=str(store),
        verifier=str(verifier),
        output=str(output),
        token_budget=128,
        lr=2e-3,
        precision="fp32",
        log_every=2,
        eval_every=4,
        checkpoint_every=4,
        progress=False,
        validation_share=0.15,
    )
    options.update(overrides)
    return TrainConfig(**options)


def test_ttt_loss_equals_a_plain_loop():
    torch.manual_seed(0)
    B, T, D, steps = 2, 9, 11, 3
    step_logits = [torch.randn(B, T, D) for _ in range(steps)]
    targets = torch.randn(B, T, D)
    mask = torch.rand(B, T) > 0.3
    documents = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
    gamma = 0.8
    loss, sums = ttt_loss(step_logits, targets, mask, documents, decay=gamma)

    expected_loss = 0.0
    chain_ok = {(b, t): True for b in range(B) for t in range(T)}
    for s in range(steps):
        kl_sum, count, correct, cond_correct, cond_count = 0.0, 0, 0, 0, 0
        for b in range(B):
            for t in range(T - s):
                if not (mask[b, t + s] and documents[b, t] == documents[b, t + s]):
                    chain_ok[(b, t)] = False  # an unscored step breaks the chain
                    continue
                p = F.softmax(targets[b, t + s], -1)
                log_q = F.log_softmax(step_logits[s][b, t], -1)
                kl_sum += float((p * (p.log() - log_q)).sum())
                count += 1
                hit = bool(step_logits[s][b, t].argmax() == targets[b, t + s].argmax())
                correct += hit
                if chain_ok[(b, t)]:
                    cond_count += 1
                    cond_correct += hit
                chain_ok[(b, t)] = chain_ok[(b, t)] and hit
        expected_loss += gamma**s * kl_sum / count
        assert sums["count"][s] == count and sums["correct"][s] == correct
        assert sums["cond_correct"][s] == cond_correct and sums["cond_count"][s] == cond_count
        assert sums["kl"][s].item() == pytest.approx(kl_sum, rel=1e-5)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    # Normed outputs + lm_head (logits only where scored) give the same loss and counts.
    head = torch.nn.Linear(5, D, bias=False)
    hidden = [torch.randn(B, T, 5) for _ in range(steps)]
    full, full_sums = ttt_loss([head(h) for h in hidden], targets, mask, documents, decay=gamma)
    sparse, sparse_sums = ttt_loss(hidden, targets, mask, documents, decay=gamma, lm_head=head)
    assert sparse.item() == pytest.approx(full.item(), rel=1e-6)
    assert all(torch.equal(full_sums[k], sparse_sums[k]) for k in full_sums if k != "kl")
    torch.testing.assert_close(full_sums["kl"], sparse_sums["kl"], rtol=1e-6, atol=0)  # sums of fp32 values


def test_first_step_mask_scores_every_position_at_step_zero_only():
    """`first_step_mask` (loss_positions: first-step) makes step 0 score what `loss_positions: all`
    scores there, and the later steps what the answers-only loss scores; a later step's conditional
    counts follow the step-0 hits of every chain start, scored now where the prompt ends."""
    torch.manual_seed(1)
    B, T, D, steps, gamma = 2, 9, 11, 3, 0.8
    step_logits = [torch.randn(B, T, D) for _ in range(steps)]
    targets = torch.randn(B, T, D)
    mask = torch.rand(B, T) > 0.4
    documents = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
    every = torch.ones_like(mask)
    loss, sums = ttt_loss(step_logits, targets, mask, documents, decay=gamma, first_step_mask=every)
    _, all_sums = ttt_loss(step_logits, targets, every, documents, decay=gamma)
    _, answer_sums = ttt_loss(step_logits, targets, mask, documents, decay=gamma)
    for key in ("count", "correct"):
        assert sums[key][0] == all_sums[key][0] and torch.equal(sums[key][1:], answer_sums[key][1:])
    assert sums["count"][0] == B * T > answer_sums["count"][0]
    torch.testing.assert_close(sums["kl"][0], all_sums["kl"][0])
    torch.testing.assert_close(sums["kl"][1:], answer_sums["kl"][1:])
    expected = sum(gamma**s * sums["kl"][s] / sums["count"][s] for s in range(steps))
    assert loss.item() == pytest.approx(float(expected), rel=1e-6)
    # Step 1's conditional counts: chains scored at step 1 whose step-0 draft (always scored) agreed.
    hit0 = step_logits[0].argmax(-1) == targets.argmax(-1)
    scored1 = mask[:, 1:] & (documents[:, :-1] == documents[:, 1:])
    assert sums["cond_count"][1] == int((scored1 & hit0[:, :-1]).sum())
    # Targets given only at the needed rows (every position here) give the same loss.
    head = torch.nn.Linear(5, D, bias=False)
    hidden = [torch.randn(B, T, 5) for _ in range(steps)]
    dense, _ = ttt_loss([head(h) for h in hidden], targets, mask, documents, decay=gamma, first_step_mask=every)
    sparse, _ = ttt_loss(hidden, targets[every], mask, documents, decay=gamma, lm_head=head, first_step_mask=every)
    assert sparse.item() == pytest.approx(dense.item(), rel=1e-6)


def test_expected_acceptance_length():
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.0, 1.0]) == 1.0
    assert expected_acceptance_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_a_tiny_drafter_overfits_and_writes_a_valid_checkpoint(store, peaked_verifier, tmp_path):
    verifier = peaked_verifier
    summary = train(
        config_for(
            store,
            verifier,
            tmp_path / "run",
            epochs=80,
            lr=1e-2,
            warmup=0.05,
            validation_share=0.0,
            token_budget=512,
            eval_every=1000,
            checkpoint_every=1000,
            log_every=5,
        )
    )
    assert summary.final_train["full_acc"][0] > 0.9
    assert validate_checkpoint(tmp_path / "run" / "drafter", verifier=str(verifier)).ok
    config = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and config["draft_vocab_size"] == 128
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] in ("train", "validation") and summary.tokens_per_second > 0
    # lm_head stays the verifier's rows (frozen by default).
    from speculators.train.vocab import load_draft_vocab
    from speculators.verifier.loading import load_verifier

    rows_expected = load_verifier(verifier, dtype="float32").lm_head_weight[load_draft_vocab(store)["selected_ids"]]
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "run" / "drafter", dtype="float32")
    torch.testing.assert_close(drafter.lm_head.weight, rows_expected.bfloat16().float())


TRAIN_SCRIPT = """
import sys
from speculators.train.trainer import TrainConfig, train
import speculators.train.checkpoints as module
original = module.save_checkpoint
def slow_save(*args, **kwargs):
    original(*args, **kwargs)
    import time; time.sleep(0.5)  # widen the window in which the test kills us
module.save_checkpoint = slow_save
train(TrainConfig.model_validate_json(sys.argv[1]))
"""


class Interrupted(Exception):
    """What stops a run right after one of its checkpoints, as a kill there would."""


def interrupt_at_checkpoint(config: TrainConfig, step: int) -> None:
    """Train `config` until checkpoints/last holds step `step`, and stop there: what a kill just after
    that checkpoint leaves (the real save_checkpoint wrote it; nothing after it is written)."""
    import speculators.train.checkpoints as checkpoints

    save = checkpoints.save_checkpoint

    def save_then_stop(directory, drafter, optimizer_states, state):
        save(directory, drafter, optimizer_states, state)
        if state.step == step:
            raise Interrupted

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Interrupted):
        patch.setattr(checkpoints, "save_checkpoint", save_then_stop)
        train(config)


def run_folder_files(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder and its bytes (the lock file left out)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


def test_kill_and_resume_equals_an_uninterrupted_run(store, peaked_verifier, tmp_path):
    """With aux-state noise on: a resumed run draws the same noise for the packs it has left."""
    verifier = peaked_verifier
    reference = config_for(store, verifier, tmp_path / "reference", max_steps=16, aux_noise=0.1)
    train(reference)
    resumed = config_for(store, verifier, tmp_path / "resumed", max_steps=16, aux_noise=0.1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", TRAIN_SCRIPT, resumed.model_dump_json()], env=env)
    state_file = tmp_path / "resumed" / "checkpoints" / "last" / "trainer_state.json"
    deadline = time.time() + 180
    while time.time() < deadline and not (state_file.is_file() and json.loads(state_file.read_text())["step"] >= 8):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = json.loads(state_file.read_text())["step"]
    assert 8 <= killed_at < 16
    summary = train(resumed)
    assert summary.steps == 16
    a = Eagle3Drafter.from_pretrained(tmp_path / "reference" / "checkpoints" / "last" / "drafter").state_dict()
    b = Eagle3Drafter.from_pretrained(tmp_path / "resumed" / "checkpoints" / "last" / "drafter").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_every_train_setting_is_classified_for_resumes():
    """A field added to TrainConfig / TrainRecipe must say whether a resume may change it."""
    from speculators.train.resume import BY_CONTENT, MAY_CHANGE, NOT_COMPARED, SHAPES_THE_RUN

    classes = [SHAPES_THE_RUN, BY_CONTENT, MAY_CHANGE, NOT_COMPARED]
    classified = [name for names in classes for name in names]
    assert len(classified) == len(set(classified)), "a setting is in two classes"
    assert set(classified) == set(TrainConfig.model_fields), (
        f"unclassified: {sorted(set(TrainConfig.model_fields) - set(classified))}; "
        f"gone: {sorted(set(classified) - set(TrainConfig.model_fields))} (speculators/train/resume.py)"
    )


def resume_refusal(output: Path, trained: str, asks: str, fix: str) -> str:
    import re

    last = output / "checkpoints" / "last"
    return (
        rf"^{re.escape(str(last))} was trained {re.escape(trained)}, this run {re.escape(asks)}; {re.escape(fix)}, "
        rf"or pass --restart to train {re.escape(str(output))} afresh$"
    )


def test_a_resume_that_would_change_the_run_is_refused_and_writes_nothing(
    store, peaked_verifier, tmp_path, monkeypatch
):
    output = tmp_path / "run"
    config = config_for(store, peaked_verifier, output, max_steps=6, checkpoint_every=2)
    interrupt_at_checkpoint(config, 2)
    before = run_folder_files(output)
    assert "checkpoints/last/trainer_state.json" in before and "train_log.jsonl" in before
    changed = {
        "lr": ("with --lr 0.002", "asks for --lr 0.004", "resume with --lr 0.002", 4e-3),
        "token_budget": (
            "with --token-budget 128",
            "asks for --token-budget 256",
            "resume with --token-budget 128",
            256,
        ),
        "max_steps": ("with --max-steps 6", "asks for --max-steps 8", "resume with --max-steps 6", 8),
        "epochs": ("with --epochs 1.0", "asks for --epochs 2.0", "resume with --epochs 1.0", 2.0),
        "fc_norm": ("with --no-fc-norm", "asks for --fc-norm", "resume with --no-fc-norm", True),
        "warm_start": (
            "with no --warm-start",
            f"asks for --warm-start {tmp_path}",
            "resume with no --warm-start",
            str(tmp_path),
        ),
    }
    for name, (trained, asks, fix, value) in changed.items():
        with pytest.raises(SpeculatorsError, match=resume_refusal(output, trained, asks, fix)):
            train(config.model_copy(update={name: value}))
    # Another store: a sample less (the same store elsewhere resumes: see the test below).
    other = tmp_path / "other-store"
    shutil.copytree(store, other, ignore=shutil.ignore_patterns(".lock"))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["samples"] = manifest["samples"][:-1]
    (other / "manifest.json").write_text(json.dumps(manifest))
    recorded = json.loads(before["checkpoints/last/trainer_state.json"])["run"]["store_content"]
    with pytest.raises(SpeculatorsError) as refused:
        train(config.model_copy(update={"store": str(other)}))
    content = str(refused.value).split("(content ")[-1][:24]
    assert re.fullmatch(r"[0-9a-f]{24}", content) and content != recorded
    expected = resume_refusal(
        output,
        f"on the data of --store {store} (content {recorded})",
        f"reads other data from --store {other} (content {content}: samples or draft vocabulary changed)",
        "resume on the data it was trained on",
    )
    assert re.match(expected, str(refused.value)), refused.value
    # Another number of packs per step: 2 processes (torchrun) where 1 trained (refused before any process group).
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        SpeculatorsError,
        match=resume_refusal(
            output,
            "on 1 packs per step (1 process(es) x --grad-accumulation 1)",
            "takes 2 (2 x 1)",
            "resume with processes (torchrun --nproc-per-node) x --grad-accumulation = 1",
        ),
    ):
        train(config)
    monkeypatch.delenv("WORLD_SIZE")
    assert run_folder_files(output) == before  # the checkpoint and train_log.jsonl untouched, nothing added


def test_packs_per_step_decide_whether_another_world_size_may_resume(store, peaked_verifier, tmp_path):
    """2 processes with --grad-accumulation 1 take the packs (and noise draws) 1 process takes with 2:
    that resume is a change to note; 2 processes with 2 are refused."""
    from speculators.train.resume import check_resume, run_record

    last, output = tmp_path / "run" / "checkpoints" / "last", str(tmp_path / "run")
    two_ranks = run_record(config_for(store, peaked_verifier, output), 2, "fp32")
    one_rank = run_record(config_for(store, peaked_verifier, output, grad_accumulation=2), 1, "fp32")
    # A checkpoint from before a setting existed trained at its default.
    older = two_ranks.model_copy(update={"settings": {k: v for k, v in two_ranks.settings.items() if k != "aux_noise"}})
    assert check_resume(last, older, two_ranks, output) == {}
    with pytest.raises(SpeculatorsError, match=r"trained with --aux-noise 0.0, this run asks for --aux-noise 0.1;"):
        check_resume(
            last, older, run_record(config_for(store, peaked_verifier, output, aux_noise=0.1), 2, "fp32"), output
        )
    changes = check_resume(last, two_ranks, one_rank, output)
    assert changes == {"--grad-accumulation": [1, 2], "WORLD_SIZE": [2, 1]}
    doubled = run_record(config_for(store, peaked_verifier, output, grad_accumulation=2), 2, "fp32")
    with pytest.raises(SpeculatorsError, match=r"trained on 2 packs per step .* this run takes 4 \(2 x 2\)"):
        check_resume(last, two_ranks, doubled, output)
    # --precision auto and bf16 compute alike where bf16 is native: a change of name only; fp32 is refused.
    auto = run_record(config_for(store, peaked_verifier, output, precision="auto"), 1, "bf16")
    bf16 = run_record(config_for(store, peaked_verifier, output, precision="bf16"), 1, "bf16")
    assert check_resume(last, auto, bf16, output) == {"--precision": ["auto", "bf16"]}
    with pytest.raises(
        SpeculatorsError,
        match=r"trained with --precision auto \(computing in bf16\), this run asks for --precision fp32 \(computing in "
        r"fp32\); resume with --precision bf16, or pass --restart",
    ):
        check_resume(last, auto, run_record(config_for(store, peaked_verifier, output), 1, "fp32"), output)


def test_a_run_of_one_process_resumes_on_two_with_the_same_packs_per_step(store, peaked_verifier, tmp_path):
    """Interrupted in one process with --grad-accumulation 2, resumed by torchrun on 2 processes with 1:
    the same packs per step, so the same run as one uninterrupted process (to DDP's rounding)."""
    from speculators.flags import to_argv

    single = config_for(
        store, peaked_verifier, tmp_path / "single", max_steps=4, checkpoint_every=2, grad_accumulation=2
    )
    output = tmp_path / "resumed"
    with one_torch_thread():  # as each torchrun process below runs (OMP_NUM_THREADS=1)
        train(single)
        interrupt_at_checkpoint(single.model_copy(update={"output": str(output)}), 2)
    on_two = single.model_copy(update={"output": str(output), "grad_accumulation": 1, "progress": False})
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "speculators.cli", "train", *to_argv(on_two)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "at step 2; changed since: --grad-accumulation 2 -> 1, WORLD_SIZE 1 -> 2" in result.stdout
    summary = json.loads((output / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed"][0]["changes"]["WORLD_SIZE"] == [1, 2]
    a = Eagle3Drafter.from_pretrained(tmp_path / "single" / "drafter").state_dict()
    b = Eagle3Drafter.from_pretrained(output / "drafter").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)


def test_a_resume_may_change_the_log_schedule_and_the_store_path_and_equals_an_uninterrupted_run(
    store, peaked_verifier, tmp_path, capsys
):
    reference = train(config_for(store, peaked_verifier, tmp_path / "reference", max_steps=6, checkpoint_every=2))
    output = tmp_path / "resumed"
    interrupt_at_checkpoint(config_for(store, peaked_verifier, output, max_steps=6, checkpoint_every=2), 4)
    moved = tmp_path / "moved-store"
    shutil.copytree(store, moved, ignore=shutil.ignore_patterns(".lock"))
    capsys.readouterr()
    summary = train(config_for(moved, peaked_verifier, output, max_steps=6, checkpoint_every=2, log_every=3))
    out = capsys.readouterr().out
    last = output / "checkpoints" / "last"
    assert f"resuming from {last} at step 4; changed since: --log-every 2 -> 3, --store {store} -> {moved}\n" in out
    assert [r.model_dump() for r in summary.resumed] == [
        {"step": 4, "changes": {"--log-every": [2, 3], "--store": [str(store), str(moved)]}, "settings_checked": True}
    ]
    assert json.loads((output / "summary.json").read_text())["resumed"][0]["step"] == 4
    assert reference.resumed == [] and summary.steps == reference.steps == 6
    a = Eagle3Drafter.from_pretrained(tmp_path / "reference" / "drafter").state_dict()
    b = Eagle3Drafter.from_pretrained(output / "drafter").state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    # the next resume compares with the settings this one trained under
    assert json.loads((last / "trainer_state.json").read_text())["run"]["settings"]["log_every"] == 3


def test_restart_trains_afresh_and_a_killed_restart_resumes_itself(store, peaked_verifier, tmp_path, capsys):
    output = tmp_path / "run"
    earlier = config_for(store, peaked_verifier, output, max_steps=4, checkpoint_every=2)
    train(earlier)
    assert (output / "summary.json").is_file() and (output / "checkpoints" / "best").is_dir()
    afresh = config_for(store, peaked_verifier, output, max_steps=4, checkpoint_every=2, lr=4e-3, restart=True)
    # Killed just after its step-0 checkpoint replaced the earlier run's (the earlier run's summary is gone):
    # a plain rerun resumes the restart, refusing the earlier run's settings.
    interrupt_at_checkpoint(afresh, 0)
    state = json.loads((output / "checkpoints" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 0 and state["run"]["settings"]["lr"] == 4e-3
    assert not (output / "summary.json").exists()
    with pytest.raises(
        SpeculatorsError,
        match=resume_refusal(output, "with --lr 0.004", "asks for --lr 0.002", "resume with --lr 0.004"),
    ):
        train(earlier)
    capsys.readouterr()
    resumed = train(afresh.model_copy(update={"restart": False}))
    assert f"resuming from {output / 'checkpoints' / 'last'} at step 0\n" in capsys.readouterr().out
    fresh = train(config_for(store, peaked_verifier, tmp_path / "fresh", max_steps=4, checkpoint_every=2, lr=4e-3))
    a = Eagle3Drafter.from_pretrained(tmp_path / "fresh" / "drafter").state_dict()
    b = Eagle3Drafter.from_pretrained(output / "drafter").state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a) and resumed.steps == fresh.steps == 4
    a = Eagle3Drafter.from_pretrained(tmp_path / "fresh" / "checkpoints" / "best").state_dict()
    b = Eagle3Drafter.from_pretrained(output / "checkpoints" / "best").state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)  # the restart's best, not the earlier run's
    log = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "train"] == [2, 4]  # from step 0, the earlier run's lines gone
    # --restart again, uninterrupted: from step 0 under a changed --lr, nothing resumed
    again = train(afresh.model_copy(update={"lr": 3e-3}))
    assert again.steps == 4 and again.resumed == [] and again.config["lr"] == 3e-3
    log = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "train"] == [2, 4]


def test_a_checkpoint_from_before_run_records_resumes_with_a_warning(store, peaked_verifier, tmp_path, capsys):
    output = tmp_path / "run"
    config = config_for(store, peaked_verifier, output, max_steps=4, checkpoint_every=2)
    interrupt_at_checkpoint(config, 2)
    state_file = output / "checkpoints" / "last" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["run"]  # what the trainer wrote before it recorded its run (an unresumed run has no "resumes")
    assert "resumes" not in state
    state_file.write_text(json.dumps(state, indent=1))
    capsys.readouterr()
    summary = train(config.model_copy(update={"lr": 4e-3}))  # (a change that cannot be seen)
    err = capsys.readouterr().err
    assert (
        f"warning: {output / 'checkpoints' / 'last'} was written before checkpoints recorded their run's settings; "
        "resuming at step 2 without checking that the settings, the store's data, the warm start and WORLD_SIZE are "
        "the ones it was trained with (pass --restart to train afresh if any changed)\n"
    ) in err
    assert [r.model_dump() for r in summary.resumed] == [{"step": 2, "changes": {}, "settings_checked": False}]
    assert json.loads(state_file.read_text())["run"]["settings"]["lr"] == 4e-3  # checked from now on


def test_a_refused_resume_is_one_error_line_on_the_command_line(store, peaked_verifier, tmp_path, capsys):
    from speculators.cli import main
    from speculators.flags import to_argv

    output = tmp_path / "run"
    config = config_for(store, peaked_verifier, output, max_steps=4, checkpoint_every=2)
    interrupt_at_checkpoint(config, 2)
    before = run_folder_files(output)
    capsys.readouterr()
    code = main(["train", *to_argv(config.model_copy(update={"token_budget": 256}))])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [
        f"error: {output / 'checkpoints' / 'last'} was trained with --token-budget 128, this run asks for "
        f"--token-budget 256; resume with --token-budget 128, or pass --restart to train {output} afresh"
    ]
    assert run_folder_files(output) == before
    assert main(["train", *to_argv(config), "--restart"]) == 0
    assert json.loads((output / "summary.json").read_text())["resumed"] == []


def test_the_trained_drafter_step_resumes_a_killed_attempt_and_restarts_a_forced_one(store, peaked_verifier, tmp_path):
    """The Dagster step trains into a folder keyed by its inputs, not by its warm start: a forced retrain
    that now starts from the last accepted drafter passes --restart (a resume would be refused), and a
    retry of an attempt that left no summary resumes the attempt's checkpoint."""
    from speculators_assets.variants import load_variant
    from speculators_assets.workload import Step, train_command, trained_drafter
    from tests.conftest import write_tiny_variant

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"conversations": [{"role": "user", "content": "hi"}]}\n')
    write_tiny_variant(tmp_path / "variants", peaked_verifier, prompts)
    yaml = tmp_path / "variants" / "tiny_llama.yaml"
    recipe = "{max_steps: 4, checkpoint_every: 2, lr: 0.002, token_budget: 128, validation_share: 0.0, precision: fp32}"
    yaml.write_text(
        yaml.read_text().replace(
            "{epochs: 40, lr: 0.01, token_budget: 512, validation_share: 0.0, precision: fp32}", recipe
        )
    )
    variant = load_variant(yaml)
    assert variant.training.max_steps == 4
    command = train_command(variant, store, tmp_path / "out", None)
    assert "--restart" not in command and "--restart" in train_command(variant, store, tmp_path / "out", None, True)
    root = tmp_path / "root"
    shutil.copytree(
        store, root / "tiny_llama" / "verifier_hidden_states" / "store", ignore=shutil.ignore_patterns(".lock")
    )
    first, key = trained_drafter(Step(variant, root))
    assert first["warm_start"] == "none" and not first["reused"]
    out = root / "tiny_llama" / "trained_drafter" / key
    # The drafter accepted and published (what speculator_checkpoint does when the gates pass).
    published = root / "tiny_llama" / "speculator_checkpoint" / key
    published.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(out / "drafter" / name, published / name)
    (published / "accepted.json").write_text(json.dumps({"key": key, "acceptance_length": 1.0}))
    (published.parent / "latest").symlink_to(key)
    # Not forced: reused. Forced: retrained afresh from the accepted drafter, into the same folder.
    assert trained_drafter(Step(variant, root))[0]["reused"]
    forced, same_key = trained_drafter(Step(variant, root, force=True))
    assert same_key == key and forced["warm_start"] == str(published) and not forced["reused"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"] == [] and summary["config"]["warm_start"] == str(published)
    # A retry after a kill that left no summary: resumed (same settings and warm start), not restarted.
    (out / "summary.json").unlink()
    retried, _ = trained_drafter(Step(variant, root))
    assert not retried["reused"] and [r["step"] for r in json.loads((out / "summary.json").read_text())["resumed"]] == [
        4
    ]


def test_aux_noise_is_relative_to_each_state_and_seeded_by_draw():
    from speculators.train.data import Pack, with_aux_noise

    scales = torch.tensor([0.01, 1.0, 100.0]).view(1, 1, 3, 1)  # aux layers of very different sizes
    aux = torch.randn(1, 400, 3, 64) * scales
    tokens = torch.zeros(1, 400, dtype=torch.long)
    pack = Pack(tokens, aux, torch.zeros(1, 400, 64), tokens == 0, torch.arange(1, 401)[None], tokens)
    noisy = with_aux_noise(pack, 0.2, seed=3, draw=5).aux_hidden_states
    relative = (noisy - aux) / aux.pow(2).mean(-1, keepdim=True).sqrt()
    for layer in range(3):
        assert relative[:, :, layer].std().item() == pytest.approx(0.2, rel=0.05)
    assert torch.equal(noisy, with_aux_noise(pack, 0.2, seed=3, draw=5).aux_hidden_states)
    assert not torch.equal(noisy, with_aux_noise(pack, 0.2, seed=3, draw=6).aux_hidden_states)
    assert torch.equal(pack.aux_hidden_states, aux)  # the pack itself is left as it was


def test_aux_noise_changes_training(store, peaked_verifier, tmp_path):
    plain = train(config_for(store, peaked_verifier, tmp_path / "plain", max_steps=4))
    noisy = train(config_for(store, peaked_verifier, tmp_path / "noisy", max_steps=4, aux_noise=0.3))
    assert plain.final_train["loss"] != noisy.final_train["loss"]
    assert noisy.config["aux_noise"] == 0.3


def test_loss_on_all_positions_scores_prompts_in_training_only(store, peaked_verifier, tmp_path):
    """`loss_positions: all` scores every training position (prompts and chat markup too) on the
    verifier's distribution, with the same tokens and states; validation still scores answers alone."""
    from speculators.train.data import PackedStore

    answers = PackedStore(store, 128, "train", validation_share=0.15, seed=0)
    every = PackedStore(store, 128, "train", validation_share=0.15, seed=0, loss_positions="all")
    plan = answers.pack_plan(0)
    assert plan == every.pack_plan(0)
    for indices in plan:
        plain, full = answers.load_pack(indices), every.load_pack(indices)
        assert torch.equal(plain.input_ids, full.input_ids)
        assert torch.equal(plain.aux_hidden_states, full.aux_hidden_states)
        assert torch.equal(plain.target_hidden_states, full.target_hidden_states)
        assert bool(full.loss_mask.all())
    scored = sum(int(answers.load_pack(i).loss_mask.sum()) for i in plan)
    assert 0 < scored < sum(every.load_pack(i).num_tokens for i in plan)  # the store's prompts were unscored

    from speculators.train.run import packed_stores

    train_packs, val_packs = packed_stores(config_for(store, peaked_verifier, tmp_path, loss_positions="all"))
    assert train_packs.score_all and not val_packs.score_all and val_packs.entries
    plain = train(config_for(store, peaked_verifier, tmp_path / "answers", max_steps=4))
    full = train(config_for(store, peaked_verifier, tmp_path / "all", max_steps=4, loss_positions="all"))
    assert full.config["loss_positions"] == "all" and plain.config["loss_positions"] == "answers"
    assert full.final_train["loss"] != plain.final_train["loss"]
    # first-step: every position at step 0 only, so its packs are the answers' and its loss a third one.
    first_packs, _ = packed_stores(config_for(store, peaked_verifier, tmp_path, loss_positions="first-step"))
    assert not first_packs.score_all
    first = train(config_for(store, peaked_verifier, tmp_path / "first", max_steps=4, loss_positions="first-step"))
    assert first.config["loss_positions"] == "first-step"
    assert first.final_train["loss"] not in (plain.final_train["loss"], full.final_train["loss"])


def test_loss_positions_reaches_train_and_the_drafter_key_only_when_set():
    """A variant's `training.loss_positions: all` becomes --loss-positions all and changes the trained
    drafter's key; a variant without it keeps the key it had before the field existed."""
    from speculators.cli import build_parser
    from speculators_assets.variants import load_variants
    from speculators_assets.workload import RECIPE_FIELDS_ADDED_LATER, key_of, train_command, trained_drafter_key

    demo = load_variants()["smollm2_135m"]
    assert demo.training.loss_positions == "answers"
    # what the key hashed before loss_positions (and the parallel drafters' fields, at their defaults here)
    earlier = {k: v for k, v in demo.training.model_dump().items() if k not in RECIPE_FIELDS_ADDED_LATER}
    assert trained_drafter_key(demo, "store") == key_of("store", earlier, demo.drafter.model_dump(), demo.verifier)
    every = demo.model_copy(update={"training": demo.training.model_copy(update={"loss_positions": "all"})})
    assert trained_drafter_key(every, "store") != trained_drafter_key(demo, "store")
    command = train_command(every, Path("store"), Path("out"), None)
    assert command[command.index("--loss-positions") + 1] == "all"
    assert build_parser().parse_args(command).loss_positions == "all"
    assert "--loss-positions" not in train_command(demo, Path("store"), Path("out"), None)


@pytest.mark.parametrize(("sharding", "optimizer"), [("ddp", "adamw"), ("fsdp", "adamw"), ("fsdp", "muon")])
def test_two_cpu_processes_equal_one_process(store, peaked_verifier, tmp_path, sharding, optimizer):
    """torchrun with 2 ranks (gloo): DDP, and FSDP2 sharding, match one process with the same global batch.
    Under FSDP2 each rank holds half of a matrix's rows; Muon (iterating in fp32 here) must orthogonalise it whole."""
    verifier = peaked_verifier
    train(config_for(store, verifier, tmp_path / "single", max_steps=6, grad_accumulation=2, optimizer=optimizer))
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "speculators.cli",
        "train",
        "--store",
        str(store),
        "--verifier",
        str(verifier),
        "--output",
        str(tmp_path / sharding),
        "--token-budget",
        "128",
        "--lr",
        "2e-3",
        "--precision",
        "fp32",
        "--max-steps",
        "6",
        "--log-every",
        "2",
        "--eval-every",
        "4",
        "--checkpoint-every",
        "4",
        "--validation-share",
        "0.15",
        "--no-progress",
        "--optimizer",
        optimizer,
        *(["--fsdp"] if sharding == "fsdp" else []),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    multi = json.loads((tmp_path / sharding / "summary.json").read_text())
    assert multi["world_size"] == 2 and multi["train_tokens"] == single["train_tokens"]
    assert multi["best_validation"]["full_acc"] == pytest.approx(single["best_validation"]["full_acc"], abs=1e-6)
    a = Eagle3Drafter.from_pretrained(tmp_path / "single" / "checkpoints" / "last" / "drafter").state_dict()
    b = Eagle3Drafter.from_pretrained(tmp_path / sharding / "checkpoints" / "last" / "drafter").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)


def test_warm_start_continues_from_an_earlier_drafter(store, peaked_verifier, tmp_path):
    verifier = peaked_verifier
    train(config_for(store, verifier, tmp_path / "first", max_steps=8))
    warm = train(
        config_for(
            store, verifier, tmp_path / "second", max_steps=1, lr=1e-9, warm_start=str(tmp_path / "first" / "drafter")
        )
    )
    cold = train(config_for(store, verifier, tmp_path / "cold", max_steps=1, lr=1e-9))
    assert sum(warm.final_train["loss"]) < sum(cold.final_train["loss"])


def test_clear_errors(store, peaked_verifier, tmp_path):
    from speculators.verifier.tiny import make_tiny_verifier

    other = make_tiny_verifier("llama", tmp_path / "other", seed=3)
    with pytest.raises(SpeculatorsError, match="whose weights differ"):
        train(config_for(store, other, tmp_path / "x"))
    wide = make_tiny_verifier("llama", tmp_path / "wide", hidden_size=96)
    with pytest.raises(SpeculatorsError, match="hidden 64 / vocab 512, not 96 / 512"):
        train(config_for(store, wide, tmp_path / "y"))
    with pytest.raises(SpeculatorsError, match="fewer training packs"):
        train(config_for(store, peaked_verifier, tmp_path / "z", grad_accumulation=10_000))
    with pytest.raises(SpeculatorsError, match="--fsdp shards over several processes"):
        train(config_for(store, peaked_verifier, tmp_path / "w", fsdp=True))


def test_muon_steps_as_torch_muon_does_and_iterates_in_the_dtype_training_computes_in(store, peaked_verifier):
    from speculators.train.muon import Muon, orthogonalize
    from speculators.train.optim import build_optimizer

    torch.manual_seed(0)
    shapes = [(48, 80), (80, 48), (32, 32)]  # wide, tall (iterated transposed), square
    ours = [torch.nn.Parameter(torch.randn(shape) * 0.05) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    mine = Muon(ours, lr=0.02, weight_decay=0.01, ns_dtype=torch.bfloat16)
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)  # the same update, rounding for rounding

    # fp32: the same singular vectors, singular values pushed into the iteration's band around 1
    matrix = torch.randn(40, 72)
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    fp32 = orthogonalize(matrix, torch.float32)
    assert fp32.dtype == torch.float32 and fp32.shape == matrix.shape
    singular = torch.linalg.svdvals(fp32)
    assert singular.min() > 0.6 and singular.max() < 1.25
    polar = u @ vh
    assert F.cosine_similarity(fp32.flatten(), polar.flatten(), dim=0) > 0.97
    torch.testing.assert_close(fp32, orthogonalize(matrix, torch.bfloat16).float(), atol=3e-2, rtol=0)

    # the trainer iterates in bf16 only where training computes in bf16 (AVX2 CPUs: fp32, ~130x faster there)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))  # a matrix for Muon, the rest AdamW's
    for precision, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        config = config_for(store, peaked_verifier, "unused", optimizer="muon", precision=precision)
        optimizers = build_optimizer(model, config, torch.device("cpu"))
        assert isinstance(optimizers[0], Muon) and optimizers[0].ns_dtype == dtype


def test_muon_optimizer_trains_checkpoints_and_resumes(store, peaked_verifier, tmp_path):
    config = config_for(
        store,
        peaked_verifier,
        tmp_path / "muon",
        optimizer="muon",
        max_steps=4,
        lr=2e-2,
        train_lm_head=True,
        checkpoint_every=2,
    )
    interrupt_at_checkpoint(config, 2)
    from safetensors.torch import load_file

    optimizer_tensors = load_file(str(tmp_path / "muon" / "checkpoints" / "last" / "optimizer.safetensors"))
    # Muon (optimizer 0) holds the hidden matrices; AdamW (1) the output head, norms and biases
    assert "0/drafter.fc.weight/momentum_buffer" in optimizer_tensors
    assert "0/drafter.layers.0.self_attn.q_proj.weight/momentum_buffer" in optimizer_tensors
    assert (
        "1/drafter.lm_head.weight/exp_avg" in optimizer_tensors
        and "0/drafter.lm_head.weight/momentum_buffer" not in optimizer_tensors
    )
    assert "1/drafter.norm.weight/exp_avg" in optimizer_tensors
    resumed = train(config)
    assert resumed.steps == 4 and [r.step for r in resumed.resumed] == [2]
    assert validate_checkpoint(tmp_path / "muon" / "drafter", verifier=str(peaked_verifier)).ok


def test_fc_norm_trains_one_norm_per_aux_state_and_refuses_a_warm_start_without_them(store, peaked_verifier, tmp_path):
    from safetensors import safe_open

    train(config_for(store, peaked_verifier, tmp_path / "per-state", fc_norm=True, max_steps=4, lr=2e-2))
    drafter_dir = tmp_path / "per-state" / "drafter"
    config = json.loads((drafter_dir / "config.json").read_text())
    assert (config["fc_norm"], config["norm_before_fc"]) == (True, False)
    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        norms = [handle.get_tensor(f"fc_norm.{i}.weight") for i in range(3)]
        target_hidden = handle.get_tensor("fc.weight").shape[1] // 3  # fc reads the 3 states concatenated
    assert "input_norm.weight" not in names
    assert all(norm.shape == (target_hidden,) for norm in norms)
    assert all(not torch.equal(norm.float(), torch.ones(target_hidden)) for norm in norms)  # trained from ones
    assert validate_checkpoint(drafter_dir, verifier=str(peaked_verifier)).ok

    train(config_for(store, peaked_verifier, tmp_path / "joint", max_steps=2))
    with pytest.raises(SpeculatorsError, match=r"--fc-norm asks for per-aux-state norms but warm start .*joint"):
        train(
            config_for(
                store, peaked_verifier, tmp_path / "warm", fc_norm=True, warm_start=str(tmp_path / "joint" / "drafter")
            )
        )


def test_fused_kl_matches_autograd_in_value_and_gradient():
    from speculators.models.ttt import ROW_CHUNK, KLFromLogits, target_distribution

    torch.manual_seed(1)
    rows = 2 * ROW_CHUNK + 7  # several row tiles and a partial one
    logits = torch.randn(rows, 13, dtype=torch.float64, requires_grad=True)
    target_logits = torch.randn(rows + 5, 13, dtype=torch.float64)
    target_rows = torch.randperm(rows + 5)[:rows]  # each logits row's target row
    target_logp = F.log_softmax(target_logits, -1)
    p, neg_entropy, ids = target_distribution(target_logits)
    torch.testing.assert_close(p, target_logp.exp().float())
    torch.testing.assert_close(neg_entropy, (target_logp.exp() * target_logp).sum(-1).float())
    assert torch.equal(ids, target_logits.argmax(-1))
    p, neg_entropy = target_logp.exp(), (target_logp.exp() * target_logp).sum(-1)  # float64 for the comparison
    weights = torch.rand(rows, dtype=torch.float64)
    fused, predicted = KLFromLogits.apply(logits, p, neg_entropy, target_rows)
    assert torch.equal(predicted, logits.argmax(-1))
    (fused * weights).sum().backward()
    fused_grad = logits.grad.clone()
    logits.grad = None
    plain = (p[target_rows] * (target_logp[target_rows] - F.log_softmax(logits, -1))).sum(-1)
    (plain * weights).sum().backward()
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(fused_grad, logits.grad)


@pytest.mark.parametrize("drafter_kind", ["trained", "untrained"])
def test_replayed_acceptance_equals_speculative_decoding_on_the_same_answers(
    store, peaked_verifier, trained_drafter, drafter_kind, tmp_path
):
    """Validation replays decoding on teacher-forced chains: on the verifier's own greedy answers (the
    store's regenerated samples) it counts the same rounds and per-position acceptances as
    `speculators evaluate` decoding those prompts with the same drafter, all in fp32."""
    from speculators.data.store import HiddenStateStore
    from speculators.data.tokenization import turn_end_ids
    from speculators.eval.evaluate import DrafterProposer, evaluate, greedy_generate
    from speculators.train.data import PackedStore
    from speculators.train.distributed import wrap_model
    from speculators.train.objectives import objective_for
    from speculators.train.validation import greedy_in_draft_vocab, run_validation
    from speculators.train.vocab import load_draft_vocab
    from speculators.verifier.loading import VerifierHead, load_verifier

    verifier = load_verifier(peaked_verifier, dtype="float32")
    drafter = Eagle3Drafter.from_pretrained(
        trained_drafter, verifier_embeddings=verifier.embedding_weight, dtype="float32"
    ).eval()
    if drafter_kind == "untrained":  # mostly rejections: rounds start everywhere
        drafter.reset_parameters(seed=3)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(verifier.lm_head_weight[load_draft_vocab(store)["selected_ids"]])
    k = drafter.config.speculative_tokens

    # Replay: every stored sample as validation, one pack each.
    packs = PackedStore(store, 4096, "validation", validation_share=1.0, seed=-1)
    head_source = VerifierHead.from_source(str(peaked_verifier), dtype="float32")
    selected = load_draft_vocab(store)["selected_ids"]
    head = (head_source.final_norm, head_source.lm_head_weight[selected].float())
    cpu = torch.device("cpu")
    in_vocab = greedy_in_draft_vocab(packs, head_source, selected, cpu, 0, 1)
    assert (
        0
        < sum(int(f.sum()) for f in in_vocab.values())
        < sum(int(p.loss_mask.sum()) for p in map(packs.load_pack, packs.pack_plan(0)))
    )  # some greedy tokens lie outside the 128-token draft vocab
    config = config_for(store, peaked_verifier, tmp_path, ttt_steps=k)
    objective = objective_for(config, drafter, head)
    model = wrap_model(objective.forward_module(drafter), drafter, 1, cpu, False)
    metrics = run_validation(model, objective, packs, config, cpu, 0, 1, in_vocab)

    # Decoding: the same prompts (the stored tokens before each answer), with a budget one token past
    # the longest stored answer (an answer cut at the budget ends in the template's end-of-turn token).
    samples = [HiddenStateStore(store).read_sample(entry) for entry in packs.entries]
    prompts, answers = [], []
    for index, sample in enumerate(samples):
        first = int(sample.loss_mask.nonzero()[0])
        prompts.append((f"s{index}", sample.input_ids[:first].tolist()))
        answers.append(sample.input_ids[first:][sample.loss_mask[first:]].tolist())
    budget = max(len(a) for a in answers)
    stops = turn_end_ids(verifier.tokenizer)
    for (_, prompt), answer in zip(prompts, answers, strict=True):  # the stored answers are the greedy ones
        greedy = greedy_generate(verifier, prompt, budget, stops).tokens
        assert greedy[: len(answer) - 1] == answer[:-1]
    report = evaluate(verifier, prompts, DrafterProposer(drafter), k, max_new_tokens=budget, progress=False)
    totals = report.totals()

    assert metrics["replayed_rounds"] == totals["drafts"] > 0
    assert metrics["replayed_acceptance_per_position"] == pytest.approx(totals["acceptance_per_position"])
    assert metrics["replayed_acceptance_length"] == pytest.approx(totals["acceptance_length"])
    if drafter_kind == "trained":
        assert totals["acceptance_length"] > 2.0
        # The per-token estimate assumes every position starts a chain; replay differs from it.
        assert metrics["acceptance_length"] != pytest.approx(metrics["replayed_acceptance_length"])


def test_the_loop_reaches_the_drafter_through_its_objective(store, peaked_verifier, tmp_path, monkeypatch):
    """Training and validation go through the objective the drafter's algorithm names in the registry (where
    a parallel drafter plugs in); an algorithm the registry lacks is refused in one line."""
    from speculators.models import algorithms
    from speculators.train import objectives

    calls = {"loss": 0, "validate_pack": 0}

    class Counted(objectives.TTTObjective):
        def loss(self, model, pack, draw=0):
            calls["loss"] += 1
            return super().loss(model, pack, draw)

        def validate_pack(self, model, pack, in_vocab):
            calls["validate_pack"] += 1
            return super().validate_pack(model, pack, in_vocab)

    monkeypatch.setattr(objectives, "TTTObjective", Counted)  # (the registry names it by import path)
    train(config_for(store, peaked_verifier, tmp_path / "counted", max_steps=4))
    assert calls["loss"] == 4 and calls["validate_pack"] > 0
    monkeypatch.delitem(algorithms.ALGORITHMS, "eagle3")
    with pytest.raises(SpeculatorsError, match="unknown drafting algorithm 'eagle3'"):
        train(config_for(store, peaked_verifier, tmp_path / "unknown", max_steps=4))
