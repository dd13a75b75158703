"""Small causal language models built offline, and one loader for any HF causal-LM directory.

AstraFlow's embedded default (CPU, no network) still needs a real model and tokenizer to run
end to end: no pretrained causal LM is installable without a hub download. This module builds
them from scratch: a byte-level BPE tokenizer with the 256 byte symbols and no merges (every
string round-trips), four special tokens, the two tool-call tags and a chat template, plus a Qwen2 or Llama config of
a chosen size with randomly initialised weights, saved in the ordinary HF layout
(``config.json`` + ``model.safetensors`` + tokenizer files). ``load_model`` reads such a
directory the same way it reads a real checkpoint, so nothing downstream knows the difference.
Loading and checking a model directory live in ``astraflow.model_loading`` (re-exported here).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterable

import torch

from astraflow.model_loading import (  # noqa: F401  (the package's model API)
    WEIGHT_FILES, check_model_dir, load_model, load_tokenizer)

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
    # ~3.2M parameters (tiny's width x2; the main example)
    "mini": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~10M parameters
    "small": dict(hidden_size=320, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4),
    # ~47M parameters
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
    """The byte a ByteLevel symbol stands for (GPT-2's remapping of 0..255: printable bytes stand for
    themselves, the others, in order, for chr(256), chr(257), ...)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return ord(sym) if ord(sym) in printable else [b for b in range(256) if b not in printable][ord(sym) - 256]


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


#: the file in which a model directory built from a config's ``policies[].init`` records that init
INIT_RECORD = "astraflow_init.json"
#: the key of ``INIT_RECORD`` that says which workload a warm start trained on (name, params, seed)
WARM_STARTED_ON = "warm_started_on"


def record_init(model_dir: str | Path, init: dict[str, Any]) -> None:
    """Record in ``model_dir`` the ``init`` section it was built from (``ModelInit.model_dump``):
    a config whose ``init`` asks for another model is then refused (``preflight``), instead of
    this directory being trained as if it were that model."""
    from storage.atomic import write_atomically

    write_atomically(Path(model_dir) / INIT_RECORD, json.dumps(init, indent=1, sort_keys=True) + "\n")


def recorded_init(model_dir: str | Path) -> dict[str, Any] | None:
    """The ``init`` section ``model_dir`` records it was built from (`record_init`); None where it
    records none (a user's checkpoint, a directory built by ``astraflow model init`` or by an
    AstraFlow that kept no record) or the record cannot be read."""
    try:
        found = json.loads((Path(model_dir) / INIT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


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


def pad_id(tokenizer) -> int:
    """The id to pad with: the pad token, else eos (as most causal LMs without one pad), else 0 (padding
    is masked out, so any id does)."""
    for i in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if i is not None:
            return i
    return 0


@torch.no_grad()
def greedy_complete(model, tokenizer, prompts: list[str], max_new_tokens: int = 8,
                    batch_size: int = 256) -> list[str]:
    """Greedy completions of ``prompts`` (text, special tokens dropped), batched with left
    padding (``pad_id``: a tokenizer need not have a pad token). Used for held-out evaluation by
    warm starts and benchmarks."""
    was_training = model.training
    model.eval()
    stop = [i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")) if i is not None]
    pad = pad_id(tokenizer)
    out: list[str] = []
    for s in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[s : s + batch_size])["input_ids"]
        T = max(len(e) for e in enc)
        ids = torch.tensor([[pad] * (T - len(e)) + list(e) for e in enc], dtype=torch.long)
        att = torch.tensor([[0] * (T - len(e)) + [1] * len(e) for e in enc], dtype=torch.long)
        gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop or None, pad_token_id=pad)
        out.extend(tokenizer.batch_decode(gen[:, T:], skip_special_tokens=True))
    model.train(was_training)
    return out
