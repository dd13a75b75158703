"""Small causal language models built offline, and one loader for any HF causal-LM directory.

AstraFlow's embedded default (CPU, no network) still needs a real model and tokenizer to run
end to end: no pretrained causal LM is installable without a hub download. This module builds
them from scratch: a byte-level BPE tokenizer with the 256 byte symbols and no merges (every
string round-trips), four special tokens, the two tool-call tags and a chat template, plus a Qwen2 or Llama config of
a chosen size with randomly initialised weights, saved in the ordinary HF layout
(``config.json`` + ``model.safetensors`` + tokenizer files). ``load_model`` reads such a
directory the same way it reads a real checkpoint, so nothing downstream knows the difference.
A directory it cannot use (no config, an architecture this transformers does not know, no
weights, a tokenizer that needs a package that is not installed) is a ``ValueError`` that names
the directory and the fix; ``check_model_dir`` checks all of that without loading the weights.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
from pathlib import Path
from typing import Any, Iterable

import torch

#: special tokens, in id order after the 256 byte symbols.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

#: the tool-call tags (``astraflow.agents.tools``) as single tokens, ids after the specials, as
#: tool-using models' tokenizers have them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

#: im_start/im_end chat template (Jinja): one turn per message, and an opened assistant turn
#: when ``add_generation_prompt`` is set.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: vocabulary size of the built models: 256 bytes + 4 specials, rounded up to a multiple of 64.
VOCAB_SIZE = 320

#: model shapes by preset name. Parameter counts are for vocab 320 with tied embeddings (untied
#: adds vocab x hidden for the separate head).
PRESETS: dict[str, dict[str, int]] = {
    # ~0.8M parameters
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~2.4M parameters as qwen2 with tied embeddings, 3.2M as llama (tiny's width x2; the main example)
    "mini": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~10M parameters
    "small": dict(hidden_size=320, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4),
    # ~50M parameters
    "50m": dict(hidden_size=640, intermediate_size=1792, num_hidden_layers=10,
                num_attention_heads=10, num_key_value_heads=5),
}

ARCHS = ("qwen2", "llama")


def build_tokenizer():
    """A byte-level BPE tokenizer (no merges) wrapped as a ``PreTrainedTokenizerFast``.

    Ids 0..255 are the byte symbols, 256.. the ``SPECIAL_TOKENS``; padding is on the left (for
    batched decoding) and ``apply_chat_template`` uses ``CHAT_TEMPLATE``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_symbol)
    vocab = {sym: i for i, sym in enumerate(byte_symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(TOOL_TOKENS))  # plain added tokens: decoding keeps them
    return _wrap(tok)


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """A byte-level BPE tokenizer *trained* on ``texts`` (``tokenizers``' BPE trainer), with
    the same special tokens, tool-call tags and chat template as ``build_tokenizer``: the kind of
    tokenizer real checkpoints have, for exercising the chat path with multi-byte tokens.

    Digits are split one by one before merging (as Llama 3 and Qwen do), so numbers keep their
    digit structure; every string still round-trips through the 256 byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    reserved = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    if vocab_size < 256 + reserved:
        raise ValueError(f"a BPE vocabulary needs at least {256 + reserved} tokens (the bytes and the "
                         f"special tokens), got vocab_size {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TOOL_TOKENS), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    scaffold = ["system\n", "user\n", "assistant\n"] * 200  # the chat template's role lines merge too
    tok.train_from_iterator(itertools.chain(texts, scaffold), trainer)
    tok.add_tokens(list(TOOL_TOKENS))
    return _wrap(tok)


def _wrap(tok):
    """A ``tokenizers.Tokenizer`` with our special tokens as a ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _byte_of_symbol(sym: str) -> int:
    """The byte a ByteLevel symbol stands for (GPT-2's printable remapping of 0..255)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table[sym]


def make_config(preset: str = "tiny", arch: str = "qwen2", tokenizer=None, tie_word_embeddings: bool = True):
    """The HF config of a preset (``PRESETS``) for ``arch`` (``ARCHS``; qwen2 has q/k/v biases,
    llama none). ``tie_word_embeddings=False``: the output head is a separate ``lm_head``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown model arch {arch!r}; known archs: {list(ARCHS)}")
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    common: dict[str, Any] = dict(
        vocab_size=max(VOCAB_SIZE, -(-len(tok) // 64) * 64),  # room for every token, a multiple of 64
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **PRESETS[preset],
    )
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    from transformers import LlamaConfig

    return LlamaConfig(**common)


def init_model(out_dir: str | Path, preset: str = "tiny", arch: str = "qwen2", seed: int = 0,
               tie_word_embeddings: bool = True, tokenizer=None) -> Path:
    """Build a randomly initialised model of ``preset``/``arch`` (tied or separate output
    head) and save model + tokenizer to ``out_dir`` in HF format (safetensors). Deterministic
    in ``seed``. ``tokenizer``: the byte-level ``build_tokenizer()`` unless given
    (``build_bpe_tokenizer``). Returns ``out_dir``."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    config = make_config(preset, arch, tok, tie_word_embeddings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


#: the weight files ``from_pretrained`` reads: a model directory has one of them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

#: import name -> pip package, where they differ
_PIP_NAMES = {"google": "protobuf", "sklearn": "scikit-learn", "yaml": "pyyaml"}


def check_model_dir(path: str | Path, tokenizer: bool = True) -> None:
    """Check, without loading the weights, that ``path`` is an HF causal-LM directory this
    transformers loads: a ``config.json`` of a causal-LM ``model_type`` it knows, weight files
    and (``tokenizer``) a tokenizer that loads. ``ValueError`` naming the directory and the fix."""
    p = Path(path)
    _check_architecture(p)
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(
            f"{p} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)}); copy the "
            "checkpoint's weight files into it, or save the model there with save_pretrained"
        )
    if tokenizer:
        load_tokenizer(p)


def _read_config(p: Path) -> dict[str, Any]:
    if not (p / "config.json").is_file():
        raise ValueError(
            f"{p} is not an HF model directory (no config.json); build one with "
            "astraflow.models.init_model(out_dir) or point at a saved checkpoint"
        )
    try:
        return json.loads((p / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{p / 'config.json'} is not valid JSON ({err}); save the model again with "
                         "save_pretrained") from None


def _check_architecture(p: Path) -> None:
    """``config.json``'s ``model_type`` is a causal LM that this transformers can build."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _read_config(p)
    model_type = config.get("model_type")
    version = transformers.__version__
    if not model_type:
        raise ValueError(f"{p / 'config.json'} has no model_type, so transformers cannot tell the architecture; "
                         "save the model with save_pretrained, which writes it")
    if model_type not in CONFIG_MAPPING:
        custom = " (its config.json points at its own modelling code, auto_map)" if "auto_map" in config else ""
        raise ValueError(
            f"{p}: model_type {model_type!r} is an architecture transformers {version} does not know{custom}; "
            "upgrade transformers (pip install -U transformers) if the model is newer than it, or convert "
            "the checkpoint to an architecture it has (a checkpoint's own modelling code, trust_remote_code, "
            "is not supported)"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{p}: model_type {model_type!r} is not a causal language model in transformers {version} "
            "(AutoModelForCausalLM cannot build it); AstraFlow trains decoder-only causal LMs: point at one"
        )


def _missing_package(err: BaseException, p: Path) -> str | None:
    """The pip package whose absence ``err`` (or an error it was raised from) reports, if it is
    indeed not installed."""
    chain: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = [e.name.split(".")[0] for e in chain if isinstance(e, ImportError) and e.name]
    text = " ".join(str(e) for e in chain)
    names += [m.lower() for m in re.findall(r"requires the (\w+) library", text)]
    names += re.findall(r"`(\w+)` is required", text)
    inverse = {pip: module for module, pip in _PIP_NAMES.items()}
    missing = [n for n in names if not _installed(inverse.get(n, n))]
    package = _PIP_NAMES.get(missing[0], missing[0]) if missing else None
    # without a tokenizer.json, transformers reads tokenizer.model with sentencepiece and, when
    # that is missing, as a tiktoken file: the tiktoken error then hides the real need
    if package in (None, "tiktoken") and not (p / "tokenizer.json").is_file() \
            and _is_sentencepiece_model(p / "tokenizer.model") and not _installed("sentencepiece"):
        return "sentencepiece"
    return package


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _is_sentencepiece_model(path: Path) -> bool:
    """A ``tokenizer.model`` that is not a tiktoken file (text lines ``<base64 token> <rank>``)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(256).split(b"\n", 1)[0]
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", head) is None


def _tokenizer_class(p: Path) -> str | None:
    """``tokenizer_class`` of ``tokenizer_config.json``, if it can be read."""
    try:
        return json.loads((p / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path: str | Path):
    """The tokenizer of an HF model directory (checked to be one)."""
    from transformers import AutoTokenizer

    p = Path(path)
    _read_config(p)
    try:
        return AutoTokenizer.from_pretrained(p)
    except Exception as err:  # whatever transformers raises, the message names the directory and the fix
        import transformers

        cls = _tokenizer_class(p)
        what = f"the tokenizer of {p}" + (f" ({cls})" if cls else "")
        package = _missing_package(err, p)
        if package is not None:
            raise ValueError(
                f"{what} needs the Python package {package!r}, which is not installed: pip install {package} "
                "(or save the tokenizer there as tokenizer.json, which needs no extra package)"
            ) from err
        raise ValueError(
            f"{what} cannot be loaded by transformers {transformers.__version__} ({type(err).__name__}: {err}); "
            "the directory needs the tokenizer files save_pretrained writes (tokenizer.json and tokenizer_config.json)"
        ) from err


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load any HF causal-LM directory as ``(model, tokenizer)``, model in eval mode on CPU.
    A directory it cannot use is a ``ValueError`` naming the directory and the fix."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    p = Path(path)
    check_model_dir(p, tokenizer=False)
    tok = load_tokenizer(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
    except (ValueError, OSError, ImportError, KeyError, TypeError, SafetensorError) as err:
        import transformers

        package = _missing_package(err, p)
        if package is not None:
            raise ValueError(f"the model in {p} needs the Python package {package!r}, which is not installed: "
                             f"pip install {package}") from err
        raise ValueError(
            f"{p}: transformers {transformers.__version__} could not load the model ({type(err).__name__}: {err}); "
            "check that its config.json and weight files belong together (save_pretrained writes both)"
        ) from err
    model.eval()
    return model, tok


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> the process's first visible GPU if there is one, else the CPU; ``"cpu"``,
    ``"cuda"``, ``"cuda:N"`` as given. A GPU asked for on a host without one is a clear error."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no GPU here; use device: auto or cpu")
    return dev


def warn_if_bf16_is_emulated(device: torch.device, setting: str) -> None:
    """Log a warning when bf16 compute is asked for on a CPU that has no native bf16
    (AVX512-BF16 or AMX): torch then emulates it, slower than fp32. ``setting`` names the
    config field to change."""
    if device.type != "cpu":
        return
    # (torch.ops.mkldnn._is_mkldnn_bf16_supported() is true on any AVX512 CPU, emulating or not)
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not any(probe is not None and probe() for probe in probes):
        import logging

        logging.getLogger("astraflow").warning(
            "%s: bf16 on a CPU without native bf16 (AVX512-BF16 or AMX) is emulated and slower than "
            "fp32 here; set %s=fp32", setting, setting)


def num_parameters(model) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def greedy_complete(model, tokenizer, prompts: list[str], max_new_tokens: int = 8,
                    batch_size: int = 256) -> list[str]:
    """Greedy completions of ``prompts`` (text, special tokens dropped), batched with left
    padding. Used for held-out evaluation by warm starts and benchmarks."""
    was_training = model.training
    model.eval()
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    out: list[str] = []
    for s in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[s : s + batch_size], return_tensors="pt", padding=True,
                        padding_side="left")
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
            pad_token_id=tokenizer.pad_token_id,
        )
        out.extend(tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    model.train(was_training)
    return out
