import pytest
import torch

from astraflow.models import PRESETS, build_tokenizer, init_model, load_model, make_config, num_parameters


def test_tokenizer_roundtrip_and_specials():
    tok = build_tokenizer()
    text = "12+34= héllo\n\t€"
    ids = tok(text)["input_ids"]
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert tok.pad_token_id == tok.convert_tokens_to_ids("<|pad|>")
    assert tok.padding_side == "left"
    assert len(tok) == 262  # 256 bytes, 4 specials, 2 tool-call tags
    call = tok.encode("<tool_call>{}</tool_call>", add_special_tokens=False)
    assert len(call) == 4 and tok.decode(call, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


def test_chat_template():
    tok = build_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "1+2"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n"


def test_init_save_load_roundtrip(tmp_path):
    d = init_model(tmp_path / "m", preset="tiny", arch="llama", seed=3)
    model, tok = load_model(d)
    assert model.config.model_type == "llama"
    assert tok.padding_side == "left"
    assert (d / "model.safetensors").is_file()
    assert 0.5e6 < num_parameters(model) < 1.2e6
    # same seed, same weights; different seed, different weights
    d2 = init_model(tmp_path / "m2", preset="tiny", arch="llama", seed=3)
    d3 = init_model(tmp_path / "m3", preset="tiny", arch="llama", seed=4)
    m2, _ = load_model(d2)
    m3, _ = load_model(d3)
    k = "model.embed_tokens.weight"
    assert torch.equal(model.state_dict()[k], m2.state_dict()[k])
    assert not torch.equal(model.state_dict()[k], m3.state_dict()[k])


def test_presets_sizes():
    # parameter counts from the config alone (no allocation of the big presets' optimiser)
    from transformers import AutoModelForCausalLM

    want = {"tiny": (0.5e6, 1.2e6), "mini": (1.5e6, 4e6), "small": (8e6, 12e6), "50m": (40e6, 60e6)}
    for name in PRESETS:
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(make_config(name, "qwen2"))
        lo, hi = want[name]
        assert lo < num_parameters(m) < hi, name


def test_bad_preset_and_dir(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="known presets"):
        make_config("huge")
    with pytest.raises(ValueError, match="known archs"):
        make_config("tiny", arch="gpt9")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_device_auto_is_the_cpu_here_and_a_missing_gpu_is_a_clear_error():
    import torch

    from astraflow.rollout.config import EngineConfig

    from astraflow.training.config import TrainerConfig
    from astraflow.models import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no GPU"):
            resolve_device("cuda")
    assert TrainerConfig(device="cuda:1").device == "cuda:1"
    for bad in ("gpu", "cuda:x"):
        with pytest.raises(ValueError):
            EngineConfig(device=bad)
