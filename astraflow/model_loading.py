"""Loading a user's HF model directory, and checking it first: ``check_model_dir`` reads no
more than config.json, the weight files' headers and the tokenizer, and a directory it cannot
use (no config, an architecture this transformers does not know or that is no causal LM,
missing, truncated or incomplete weights, no tokenizer, one with more tokens than the model's
vocabulary, or one that needs a package that is not installed) is a ``ValueError`` that names
the directory and the fix. ``load_model`` reads a built model (``astraflow.models.init_model``)
the same way as a real checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

#: the weight files ``from_pretrained`` reads: a model directory has one of them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

#: import name -> pip package, where they differ
_PIP_NAMES = {"google": "protobuf", "sklearn": "scikit-learn", "yaml": "pyyaml"}


def check_model_dir(path: str | Path, tokenizer: bool = True, against_model: bool = True) -> None:
    """Check, reading no more than the weight files' headers, that ``path`` is an HF causal-LM
    directory this transformers loads: a ``config.json`` of a causal-LM ``model_type`` it knows (and
    causal-LM ``architectures``), readable weight files that hold every weight the model needs, and
    (``tokenizer``) a tokenizer that loads, encodes and fits the model's vocabulary. ``ValueError``
    naming the directory and the fix. ``against_model=False`` leaves out comparing the weights'
    names and shapes with the model the config describes: building that model imports the
    architecture's modelling code, most of a check's time, which a process that will not load the
    model itself (a node whose engine process does, and checks there) need not spend."""
    p = Path(path)
    _check_architecture(p)
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"{p} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)}); copy the "
                         "checkpoint's weight files into it, or save the model there with save_pretrained")
    _check_weight_files(p, against_model)
    _check_generation_config(p)
    if tokenizer:
        load_tokenizer(p)


def _check_generation_config(p: Path) -> None:
    """A ``generation_config.json`` is JSON holding an object: the engines read the model's end
    tokens from it (transformers would ignore a damaged one and stop on fewer tokens; vLLM and
    ``astraflow export`` fail on it)."""
    f = p / "generation_config.json"
    if not f.is_file():
        return
    try:
        data = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        data = err
    if not isinstance(data, dict):
        why = f"not JSON ({data})" if isinstance(data, Exception) else f"a JSON {type(data).__name__}, not an object"
        raise ValueError(f"{f} is {why}: restore the checkpoint's own file, or remove it (its end tokens are then "
                         "read from config.json)")


_WEIGHTS_FIX = ("copy the checkpoint's weight files into it again (every shard), "
                "or save the model there with save_pretrained")


def _check_weight_files(p: Path, against_model: bool = True) -> None:
    """The weight files ``from_pretrained`` reads (the first of ``WEIGHT_FILES``; an index's shards)
    exist and are not empty, each safetensors header parses and covers its whole file (a truncated one
    does not) and (``against_model``) their tensors name every weight the model needs
    (``_missing_weights``), in its shapes: caught here, not once a run's workers load them."""
    from safetensors import SafetensorError, safe_open

    first = next(p / f for f in WEIGHT_FILES if (p / f).is_file())
    files = [first]
    if first.name.endswith(".index.json"):  # every shard it names must be there
        try:
            files = [p / s for s in sorted({str(s) for s in json.loads(first.read_text())["weight_map"].values()})]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{first} is not a weight index (no readable weight_map: {type(err).__name__}: "
                             f"{err}); {_WEIGHTS_FIX}") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing or not files:
            raise ValueError(f"{first} names weight shards that are missing from {p} "
                             f"({', '.join(missing) or 'it names none'}); {_WEIGHTS_FIX}")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"{f} is empty; {_WEIGHTS_FIX}")
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), "pt") as st:
                    shapes.update((k, tuple(st.get_slice(k).get_shape())) for k in st.keys())
            except (SafetensorError, OSError) as err:
                raise ValueError(f"{f} cannot be read as safetensors ({err}): the file is truncated or damaged; "
                                 f"{_WEIGHTS_FIX}") from None
        elif f.suffix == ".bin":
            shapes.update(_bin_shapes(f))
    if against_model and shapes and all(f.suffix in (".safetensors", ".bin") for f in files):
        _check_against_model(p, shapes)


def _check_against_model(p: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The weights' names and shapes against the model ``p``'s config describes. Building that
    model imports the architecture's modelling code (seconds): a pass is remembered
    (``astraflow.checked``) for the same config, names, shapes and transformers."""
    import transformers

    from astraflow.checked import check_key, passed_before, remember_pass

    key = check_key("weights-against-model", {"config": (p / "config.json").read_text(errors="replace"),
                                              "shapes": sorted(shapes.items()),
                                              "transformers": transformers.__version__}, __file__)
    if passed_before(key):
        return
    model = _meta_model(p)
    missing = _missing_weights(model, set(shapes)) if model is not None else []
    if missing:
        raise _missing_weights_error(p, missing)
    # a pre-quantized checkpoint stores packed shapes under the same names: not compared
    quantized = "quantization_config" in _read_config(p)
    wrong = _mis_shaped(model, shapes) if model is not None and not quantized else []
    if wrong:
        shown = "; ".join(f"{k}: {list(have)} in the weight files, {list(want)} by config.json"
                          for k, have, want in wrong[:3])
        shown += f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ValueError(f"{p}: config.json does not describe the weights next to it ({len(wrong)} tensor(s) of "
                         f"another shape: {shown}); put the checkpoint's own config.json next to its weights")
    if model is not None:
        remember_pass(key)


def _bin_shapes(f: Path) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a PyTorch weight file, read onto the meta device (no
    memory: the names and shapes only), with the same restricted unpickler ``from_pretrained`` uses."""
    import torch

    try:
        try:
            state = torch.load(f, map_location="meta", weights_only=True, mmap=True)
        except RuntimeError:  # a file of the format before zip archives cannot be mapped
            state = torch.load(f, map_location="meta", weights_only=True)
    except Exception as err:
        raise ValueError(f"{f} cannot be read as PyTorch weights ({type(err).__name__}: {err}): the file is "
                         f"truncated or damaged; {_WEIGHTS_FIX}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{f} holds a {type(state).__name__}, not a dict of weights; {_WEIGHTS_FIX}")
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _meta_model(p: Path) -> Any:
    """The model of ``p``'s config built on the meta device (no memory), or None where this check
    cannot build it (``from_pretrained`` then reports the problem when loading)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(p))
    except Exception:
        return None


def _mis_shaped(model: Any, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple, tuple]]:
    """``(name, shape in the files, shape the config gives)`` of the tensors both name, where they differ."""
    wanted = model.state_dict()
    return [(k, have, tuple(wanted[k].shape)) for k, have in sorted(shapes.items())
            if k in wanted and tuple(wanted[k].shape) != have]


def _missing_weights(model: Any, present: set[str]) -> list[str]:
    """The weights ``model`` (``_meta_model``) needs that the tensor names ``present`` lack; tied
    weights and those transformers initialises itself do not count. A checkpoint with names the model
    does not have (renamed by a conversion transformers applies while loading) is not judged here:
    ``load_model``'s loading report is."""
    expected = set(model.state_dict())
    if not present <= expected:
        return []
    ignored = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    return sorted(k for k in expected - present - tied if not any(re.search(pat, k) for pat in ignored))


def _missing_weights_error(p: Path, missing: list[str]) -> ValueError:
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    tie = (" (a checkpoint whose output head is its input embedding has tie_word_embeddings: true in config.json)"
           if missing == ["lm_head.weight"] else "")
    return ValueError(f"{p}: the weight files lack {len(missing)} tensor(s) the model needs ({shown}), which would "
                      f"start from random values; {_WEIGHTS_FIX}{tie}")


def _read_config(p: Path) -> dict[str, Any]:
    if not (p / "config.json").is_file():
        snapshot = _hub_snapshot(p)
        if snapshot is not None:
            raise ValueError(f"{p} is a Hugging Face hub cache entry, not a model directory (its files are in "
                             f"snapshots/<revision>/): point at the snapshot, {snapshot}")
        raise ValueError(f"{p} is not an HF model directory (no config.json); build one with "
                         "`astraflow model init OUT_DIR` or point at a saved checkpoint")
    try:
        return json.loads((p / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{p / 'config.json'} is not valid JSON ({err}); save the model again with "
                         "save_pretrained") from None


def _hub_snapshot(p: Path) -> Path | None:
    """The model directory inside ``p`` where ``p`` is a hub cache entry (``models--org--name``, as
    ``huggingface-cli download`` without ``--local-dir`` leaves it) or its ``snapshots``: the
    revision ``refs/main`` names, else the newest snapshot holding a config.json; None otherwise."""
    snapshots = p if p.name == "snapshots" else p / "snapshots"
    try:
        found = [d for d in snapshots.iterdir() if (d / "config.json").is_file()]
    except OSError:
        return None
    try:
        main = (snapshots.parent / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        main = ""
    named = [d for d in found if d.name == main]
    return (named or sorted(found, key=lambda d: d.stat().st_mtime))[-1] if found else None


def _check_architecture(p: Path) -> None:
    """``config.json``'s ``model_type`` is a causal LM that this transformers can build, and its
    ``architectures`` (where given) name a causal-LM class."""
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
        raise ValueError(f"{p}: model_type {model_type!r} is an architecture transformers {version} does not know"
                         f"{custom}; upgrade transformers (pip install -U transformers) if the model is newer than "
                         "it, or convert the checkpoint to an architecture it has (a checkpoint's own modelling "
                         "code, trust_remote_code, is not supported)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{p}: model_type {model_type!r} is not a causal language model in transformers "
                         f"{version} (AutoModelForCausalLM cannot build it); AstraFlow trains decoder-only causal "
                         "LMs: point at one")
    # transformers builds a causal LM for some encoder types too (bert -> BertLMHeadModel), but a checkpoint
    # saved as a bare encoder (BertModel) has no LM head: its weights would fail to load, or train from random
    archs = config.get("architectures")
    archs = [archs] if isinstance(archs, str) else archs
    if isinstance(archs, list) and archs and not any(_is_causal_lm_class(a) for a in archs):
        named = ", ".join(str(a) for a in archs)
        raise ValueError(f"{p}: config.json's architectures {named} is not a causal language model class "
                         "(neither *ForCausalLM nor *LMHeadModel, nor one AutoModelForCausalLM builds in transformers "
                         f"{version}), so its weights do not fit the model AstraFlow would build; AstraFlow needs a "
                         "causal (decoder) language model: point at a checkpoint saved as one (architectures a "
                         "*ForCausalLM class)")


def _is_causal_lm_class(name: Any) -> bool:
    """``name`` (an entry of config.json's ``architectures``) is a causal-LM model class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(name, str):
        return False
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return True
    known = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return any(name == v or (isinstance(v, (tuple, list)) and name in v) for v in known)


def _config_error(p: Path) -> str | None:
    """Why transformers cannot load ``p``'s config.json (``"Type: message"``), or None when it can."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(p)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


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
    missing = [n for n in names if not is_installed(inverse.get(n, n))]
    package = _PIP_NAMES.get(missing[0], missing[0]) if missing else None
    # without a tokenizer.json, transformers reads tokenizer.model with sentencepiece and, when
    # that is missing, as a tiktoken file: the tiktoken error then hides the real need
    if package in (None, "tiktoken") and not (p / "tokenizer.json").is_file() \
            and _is_sentencepiece_model(p / "tokenizer.model") and not is_installed("sentencepiece"):
        return "sentencepiece"
    return package


def is_installed(module: str) -> bool:
    """Whether ``module`` (dotted) can be imported here, found without importing it (a missing
    parent package, or a module whose spec is unset, reads as not installed)."""
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


#: files a tokenizer is read from (``vocab.json`` with ``merges.txt``); ``init_model`` writes tokenizer.json
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")

_TOKENIZER_FIX = ("copy the tokenizer files of the checkpoint into it (tokenizer.json and tokenizer_config.json, "
                  "as save_pretrained writes them)")


def load_tokenizer(path: str | Path):
    """The tokenizer of an HF model directory (checked to be one). It must have tokenizer files,
    encode text to tokens (from config.json alone transformers builds an empty tokenizer, with which
    every rollout would fail) and have no more tokens than the model's vocabulary."""
    from transformers import AutoTokenizer

    p = Path(path)
    _read_config(p)
    if not any(any(p.glob(name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{p} has no tokenizer files (none of tokenizer.json, tokenizer.model, vocab.json + "
                         f"merges.txt, vocab.txt); {_TOKENIZER_FIX}")
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except Exception as err:  # whatever transformers raises, the message names the directory and the fix
        import transformers

        config_error = _config_error(p)
        if config_error is not None:  # transformers reads config.json with the tokenizer: the config is at fault
            raise ValueError(f"{p}/config.json cannot be loaded by transformers {transformers.__version__} "
                             f"({config_error}); put the checkpoint's own config.json next to its weights") from err
        cls = _tokenizer_class(p)
        what = f"the tokenizer of {p}" + (f" ({cls})" if cls else "")
        package = _missing_package(err, p)
        if package is not None:
            raise ValueError(f"{what} needs the Python package {package!r}, which is not installed: pip install "
                             f"{package} (or save the tokenizer there as tokenizer.json, which needs no extra package)"
                             ) from err
        raise ValueError(f"{what} cannot be loaded by transformers {transformers.__version__} ({type(err).__name__}: "
                         f"{err}); the directory needs the tokenizer files save_pretrained writes (tokenizer.json "
                         "and tokenizer_config.json)") from err
    if not tok("Hello, world! 12+34=", add_special_tokens=False)["input_ids"]:
        raise ValueError(f"the tokenizer of {p} encodes text to no tokens (its vocabulary has {len(tok)}): its "
                         f"tokenizer files are empty or incomplete; {_TOKENIZER_FIX}")
    _check_vocabulary(p, tok)
    return tok


def _check_vocabulary(p: Path, tok) -> None:
    """Every token a run meets has a row in the model's embeddings: the tokenizer's own vocabulary,
    its eos/bos/pad tokens and those its chat template writes. Past ``vocab_size`` each rollout
    that meets one would fail. Added tokens a run never writes may lie past it (a multimodal
    model's image tokens); a smaller tokenizer is normal (the embeddings are padded)."""
    config = _read_config(p)
    size = config.get("vocab_size")
    if size is None and isinstance(config.get("text_config"), dict):  # a multimodal model's language part
        size = config["text_config"].get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or len(tok) <= size:
        return
    used = {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}
    if getattr(tok, "chat_template", None):
        try:
            chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
            ids = tok.apply_chat_template(chat, tokenize=True)
            used |= set(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        except Exception:  # a template this sample does not fit: its own tokens are not known
            pass
    beyond = sorted(i for i in used if isinstance(i, int) and i >= size)
    if tok.vocab_size > size or beyond:
        which = (f"ids {size} to {tok.vocab_size - 1} of its vocabulary" if tok.vocab_size > size
                 else f"the tokens {beyond} that runs write")
        raise ValueError(f"the tokenizer of {p} has {len(tok)} tokens, more than the model's vocabulary of {size} "
                         f"(vocab_size in config.json), and {which} have no embedding, so the tokenizer does not "
                         "belong to the model; put the model's own tokenizer files next to it "
                         "(tokenizer.json and tokenizer_config.json of the checkpoint)")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load any HF causal-LM directory as ``(model, tokenizer)``, model in eval mode on CPU.
    A directory it cannot use is a ``ValueError`` naming the directory and the fix."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    p = Path(path)
    check_model_dir(p, tokenizer=False)
    tok = load_tokenizer(p)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, output_loading_info=True)
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
    if info["missing_keys"]:  # transformers would train and serve them from their random initialisation
        raise _missing_weights_error(p, sorted(info["missing_keys"]))
    model.eval()
    return model, tok
