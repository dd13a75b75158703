"""``astraflow export`` holding one copy of the model at a time: the version read and cast tensor
by tensor, the written copy checked against digests of the cast tensors, the probe run in fp32
one decoder layer at a time. Each of these must check exactly what holding every copy did."""

import pytest
import torch

import astraflow.model_export as mx
from astraflow.model_export import ExportError, export_version
from astraflow.models import init_model
from astraflow.probe import compute_in_fp32
from storage.paths import RunPaths
from storage.weights import WeightStore
from tests.test_model_export import _one_version, _run_dir, _trained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_version_read_tensor_by_tensor_is_the_version_cast(tiny_model, tmp_path, dtype):
    run = _one_version(tmp_path, tiny_model)
    store = WeightStore(RunPaths(run).weights)
    whole = store.load("solver", 1, verify=True)
    one_by_one = dict(mx._tensors(store, "solver", 1, store.manifest("solver", 1)["meta"], dtype))
    assert one_by_one.keys() == whole.keys()
    for name, tensor in whole.items():
        assert one_by_one[name].dtype == dtype and torch.equal(one_by_one[name], tensor.to(dtype)), name


@pytest.mark.parametrize("dtype", ["auto", "bf16"])
def test_a_tensor_changed_in_the_written_files_is_caught(tiny_model, tmp_path, monkeypatch, dtype):
    """One value of one tensor differs after the write (a bad disk, a writer's bug): the copy
    loaded back no longer matches the digests taken as the version was read, and OUT stays unmade."""
    from safetensors.torch import load_file, save_file

    run = _one_version(tmp_path, tiny_model)
    real = mx.copy_model_files

    def and_a_bit_flips(source, staging, tok):
        real(source, staging, tok)
        shard = staging / "model.safetensors"
        state = load_file(shard)
        w = state["model.layers.1.mlp.up_proj.weight"]
        w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(1.0, dtype=w.dtype))
        save_file(state, shard, metadata={"format": "pt"})

    monkeypatch.setattr(mx, "copy_model_files", and_a_bit_flips)
    with pytest.raises(ExportError, match=r"model.layers.1.mlp.up_proj.weight differs from the version's"):
        export_version(run, tmp_path / "out", dtype=dtype, say=print)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_weights_past_fp16s_range_are_still_refused(tiny_model, tmp_path):
    run = _run_dir(tmp_path, tiny_model)
    be = _trained(tiny_model)
    with torch.no_grad():
        be.model.model.layers[2].mlp.down_proj.weight[0, 0] = 1e6
    be.publish(WeightStore(RunPaths(run).weights), "solver", 1)
    with pytest.raises(ExportError, match=r"1 tensors \(first model.layers.2.mlp.down_proj.weight\) exceed fp16"):
        export_version(run, tmp_path / "out", dtype="fp16", say=print)
    assert not (tmp_path / "out").exists()
    assert export_version(run, tmp_path / "out", dtype="bf16", say=print)["dtype"] == "bf16"


@pytest.mark.parametrize("tied", [True, False])
def test_the_probe_in_fp32_one_layer_at_a_time_scores_as_the_whole_model_upcast(tmp_path, tied):
    """``compute_in_fp32`` gives the log-probs ``model.float()`` gives, bit for bit, and afterwards the
    layers hold the very tensors they were loaded with (only one layer was upcast at a time)."""
    from astraflow.model_loading import load_model
    from astraflow.probe import probe_tokens, teacher_forced_logprobs

    model_dir = init_model(tmp_path / "m", preset="tiny", arch="qwen2" if tied else "llama", seed=3,
                           tie_word_embeddings=tied)
    tokens = probe_tokens(320, n=24)
    whole = load_model(model_dir, dtype=torch.bfloat16)[0].float()
    model = load_model(model_dir, dtype=torch.bfloat16)[0]
    layers = model.model.layers
    loaded = {name: p.data_ptr() for name, p in layers.named_parameters()}
    compute_in_fp32(model)
    assert teacher_forced_logprobs(model, tokens) == teacher_forced_logprobs(whole, tokens)
    assert all(p.data_ptr() == loaded[name] and p.dtype == torch.bfloat16 for name, p in layers.named_parameters())
    assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_memory_running_out_while_reading_is_named_as_such(tiny_model, tmp_path, monkeypatch):
    """torch's allocator failing mid-read is a node with too little memory, not a damaged version."""
    import torch.distributed.checkpoint as dcp

    run = _one_version(tmp_path, tiny_model)

    def no_memory(*_a, **_k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes")

    monkeypatch.setattr(dcp, "load", no_memory)
    with pytest.raises(ExportError, match="not enough memory to export the model"):
        export_version(run, tmp_path / "out", say=print)
    assert not (tmp_path / "out").exists()


def test_an_architecture_that_keeps_tensors_in_fp32_exports_as_bf16(tiny_model, tmp_path):
    """DeepSeek-V3 keeps its router's bias in fp32 (``_keep_in_fp32_modules``): the copy loaded
    back holds it upcast, equal in value to what was written, and the export goes through."""
    import shutil

    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    from astraflow.training.torch_backend import TorchBackend

    kw = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, vocab_size=320, n_routed_experts=4, num_experts_per_tok=2,
              n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **kw))
    assert model._keep_in_fp32_modules_strict or model._keep_in_fp32_modules
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    for f in tiny_model.iterdir():  # the tiny model's tokenizer (its vocabulary fits)
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, model_dir / f.name)
    run = tmp_path / "run"
    RunPaths(run).make()
    RunPaths(run).config.write_text(yaml.safe_dump({"policies": [{"name": "solver", "model": str(model_dir)}]}))
    TorchBackend(str(model_dir), lr=1e-3, publish_dtype="bf16").publish(WeightStore(RunPaths(run).weights), "solver", 1)
    record = export_version(run, tmp_path / "out", say=print)
    assert record["dtype"] == "bf16" and record["probe_error_nats"] <= mx.ARCH_TOLERANCE


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory")])
def test_memory_running_out_inside_the_checkpoint_read_is_said_so(tiny_model, tmp_path, monkeypatch, failure):
    """DCP wraps what fails in its read: running out of memory there is not a damaged version."""
    from torch.distributed.checkpoint import FileSystemReader

    def no_memory(self, *args, **kwargs):
        raise failure

    monkeypatch.setattr(FileSystemReader, "read_data", no_memory)
    with pytest.raises(ExportError, match="not enough memory to export the model"):
        export_version(_one_version(tmp_path, tiny_model), tmp_path / "out", say=print)


def test_fp32_compute_covers_modules_shared_between_the_layers_and_the_rest():
    """A module the layers share with the model's top runs in fp32 outside the layers' forward
    too, and a block listed twice (shared across depth) comes back to its loaded tensors."""
    shared, block = torch.nn.Linear(8, 8).bfloat16(), torch.nn.Linear(8, 8).bfloat16()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.own = shared, torch.nn.Linear(8, 8).bfloat16()

        def forward(self, x):
            return self.own(self.shared(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer(), block, block])
            self.head = shared

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    import copy

    model = Model()
    reference = copy.deepcopy(model).float()  # its sharing kept, in copies of its own
    loaded = block.weight.data_ptr()
    compute_in_fp32(model)
    x = torch.randn(2, 8)
    assert torch.equal(model(x), reference(x))
    assert block.weight.data_ptr() == loaded and block.weight.dtype == torch.bfloat16
