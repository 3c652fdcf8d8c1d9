"""Bad input is a one-line ValueError that names the file, flag or field."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

from pd_serve import Engine, SamplingParams


@pytest.fixture
def checkpoint(tmp_path, tiny_checkpoints):
    dst = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama3"], dst)
    return dst


def load(path, **kwargs):
    return Engine(path, device="cpu", max_total_tokens=256, **kwargs)


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=r"--model .*nope: no such directory"):
        load(tmp_path / "nope")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json: missing"):
        load(checkpoint)


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load(checkpoint)


def test_corrupt_weights_name_the_file(checkpoint):
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: cannot read safetensors"):
        load(checkpoint)


def test_missing_shard_names_it(tmp_path, tiny_checkpoints):
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_checkpoints["qwen2"], dst)
    shard = sorted(dst.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load(dst)


def test_tensor_shape_mismatch_names_tensor(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["intermediate_size"] = 96
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .*mlp\.\w+_proj\.weight. has shape .* config\.json implies"):
        load(checkpoint)


def test_unsupported_architecture(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: architecture 'GPT2LMHeadModel' is not supported"):
        load(checkpoint)


def test_unsupported_dtype_and_flags(checkpoint):
    with pytest.raises(ValueError, match=r"--dtype 'int3' is not supported"):
        load(checkpoint, dtype="int3")
    with pytest.raises(ValueError, match=r"--page-size 0 must be >= 1"):
        load(checkpoint, page_size=0)
    with pytest.raises(ValueError, match=r"--schedule-policy 'lifo'"):
        load(checkpoint, schedule_policy="lifo")


def test_prompt_longer_than_context_and_bad_params(checkpoint):
    engine = load(checkpoint, context_length=64)
    with pytest.raises(ValueError, match="prompt has 64 tokens; the context length is 64"):
        engine.add_request(list(range(10, 74)))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"token id 999999 is outside the vocabulary"):
        engine.add_request([5, 999999])
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p=0 must be in \(0, 1\]"):
        SamplingParams(top_p=0)


def test_cli_prints_one_line_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pd_serve.cli", "chat", "hi", "--model",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("pd-serve: error: --model ") and "no such directory" in lines[0]


def test_attention_backend_choice_follows_head_dim(monkeypatch):
    """flashinfer's kernels exist for head_dim 64/128/256: auto picks triton for other models,
    and asking for flashinfer there is a clear error (checked without a GPU: only the names)."""
    import importlib.util

    import torch

    from pd_serve.engine.attention import resolve_backend_name

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("flashinfer", "triton") else real(name, *a))
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert resolve_backend_name("auto", cuda, bf16, head_dim=128) == "flashinfer"
    assert resolve_backend_name("auto", cuda, bf16, head_dim=16) == "triton"
    with pytest.raises(ValueError, match="head_dim 64, 128, 256, not this model's 16"):
        resolve_backend_name("flashinfer", cuda, bf16, head_dim=16)


def test_engine_without_a_tokenizer_takes_token_ids_only(tmp_path, tiny_checkpoints):
    """A bare config.json with --load-format dummy (benchmarks): ids in, ids out; text is a
    clear error."""
    (tmp_path / "config.json").write_text((tiny_checkpoints["llama3"] / "config.json").read_text())
    engine = Engine(tmp_path, device="cpu", load_format="dummy", max_total_tokens=256)
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="has no tokenizer.json: pass token ids, not text"):
        engine.add_request("hello")


def test_launch_picks_ipc_on_gpus_and_spreads_workers_over_them(monkeypatch):
    import torch

    from pd_serve.launch import launch_gpu_ids, launch_transfer_args

    ipc = ["--transfer-backend", "ipc"]
    assert launch_transfer_args(["--device", "cuda"]) == ipc
    assert launch_transfer_args(["--device=cuda:1"]) == ipc
    assert launch_transfer_args(["--device", "cuda", "--transfer-backend", "torch"]) == []  # chosen
    assert launch_transfer_args(["--device", "cpu"]) == []
    assert launch_gpu_ids(["--device", "cpu"], None) is None
    assert launch_gpu_ids(["--device", "cuda"], ["3"]) == ["3"]  # --gpu-ids wins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launch_transfer_args([]) == ipc  # --device auto on a GPU machine
    assert launch_gpu_ids([], None) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")  # launch's own visible GPUs, by their ids
    assert launch_gpu_ids([], None) == ["4", "6"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch_transfer_args([]) == []
    assert launch_gpu_ids([], None) is None


def test_launch_hands_each_tp_worker_its_own_gpus():
    from pd_serve.launch import flag_value, worker_gpus

    ids = ["0", "1", "2", "3"]
    assert [worker_gpus(2 * i, ids, 2) for i in range(3)] == ["0,1", "2,3", "0,1"]
    assert [worker_gpus(i, ids, 1) for i in range(2)] == ["0", "1"]
    assert [worker_gpus(0, ids, 2), worker_gpus(2, ids, 1)] == ["0,1", "2"]  # TP 2, then TP 1
    assert worker_gpus(0, None, 2) is None
    assert flag_value(["--tp", "2", "--device=cuda", "--tp=4"], "--tp", "1") == "4"
    assert flag_value([], "--device", "auto") == "auto"


def test_a_gpu_warmup_runs_the_largest_prefill_step_and_names_the_flags_when_it_runs_out(
        checkpoint, monkeypatch):
    """On a GPU the warm-up prompt is --chunked-prefill-size tokens (within the context and the
    pool), so a step that cannot fit beside the KV cache fails at start, saying what to lower."""
    from pd_serve.config import EngineConfig
    from pd_serve.engine.core import EngineCore

    core = EngineCore(EngineConfig.from_flat(model=str(checkpoint), device="cpu",
                                             max_total_tokens=256, chunked_prefill_size=48))
    prompts = []

    def out_of_memory():
        prompts.append(len(core.scheduler.waiting[0].prompt_token_ids))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(core, "device", torch.device("cuda"))
    monkeypatch.setattr(core, "step", out_of_memory)
    with pytest.raises(ValueError, match=r"a 48-token prefill step runs out of GPU memory beside "
                       r"the KV cache \(256 tokens\): lower --mem-fraction-static \(now 0\.88\) "
                       r"or --chunked-prefill-size"):
        core.warmup()
    assert prompts == [48]
    unchunked = dataclasses.replace(core.config.scheduler, chunked_prefill_size=-1)
    monkeypatch.setattr(core, "config", dataclasses.replace(core.config, scheduler=unchunked))
    # (the whole context, within the pool, less the decode step's token)
    assert core._largest_prefill_step() == 254


def test_the_gpu_kv_pool_budget_counts_what_the_allocator_keeps_reserved(monkeypatch):
    """A model quantized at load frees its dense copy into the allocator's cache: that cache
    goes back to the driver before the pool is sized, and the budget subtracts what stays
    reserved (more than what is allocated), so --mem-fraction-static's rest is really free."""
    from types import SimpleNamespace

    from pd_serve.cache.pool import KVLayout
    from pd_serve.config import CacheConfig
    from pd_serve.engine.executor import _num_kv_pages

    gib = 2**30
    state = {"reserved": 26 * gib}  # 9 GiB of FP8 weights allocated, their dense copy cached
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 9 * gib)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: state.update(reserved=10 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    layout = KVLayout(num_layers=32, page_size=16, num_kv_heads=8, head_dim=128,
                      dtype="float8_e4m3fn")
    pages = _num_kv_pages(CacheConfig(mem_fraction_static=0.5), layout, torch.device("cuda"))
    assert pages == (40 - 10) * gib // layout.bytes_per_page
    state["reserved"] = 45 * gib  # and empty_cache gives nothing back
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(ValueError, match=r"--mem-fraction-static 0\.5 leaves no room"):
        _num_kv_pages(CacheConfig(mem_fraction_static=0.5), layout, torch.device("cuda"))
