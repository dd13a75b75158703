"""The simulated engine's tokenizer: bytes for prompts, opaque ids for generated tokens.

Enough of the ``transformers`` tokenizer surface for the workflows (``encode``, ``decode``,
the special token ids, no chat template). Prompt text encodes to its UTF-8 bytes shifted past
the special ids; a generated id decodes to one printable character, so texts have the length of
their token lists.
"""

from __future__ import annotations

EOS_ID, PAD_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
#: the first id that is not a special token
FIRST_ORDINARY_ID = 4


class SimTokenizer:
    chat_template = None
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    unk_token_id = UNK_ID
    all_special_ids = [EOS_ID, PAD_ID, BOS_ID, UNK_ID]

    def __init__(self, vocab_size: int = 32000):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + FIRST_ORDINARY_ID for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        special = set(self.all_special_ids)
        return "".join("" if (skip_special_tokens and int(i) in special) else chr(33 + int(i) % 94) for i in ids)

    def convert_tokens_to_ids(self, token: str) -> int:
        return UNK_ID
