"""The token layout of a multi-turn conversation.

A multi-turn episode is stored as one token sequence: the first observation, the model's
turn, the environment's reply, the next turn, ... The context the model continues from is
always exactly the tokens stored so far; nothing is re-tokenised, so the stored tokens are what
was generated and what was observed.

``ChatRenderer`` gives the pieces, each as token ids:

* ``start(messages)``: the first observation plus the opening of the model's first turn;
* ``close_turn(ended_on_eos)``: what the template writes after a model turn's content that the
  model did not generate (for ``<|im_end|>\\n`` templates: the ``\\n``, or the whole closing
  when the turn was cut by its token budget);
* ``observation(messages)``: new messages plus the opening of the next model turn.

With a chat template the pieces are differences of rendered conversations (a dummy first
message cancels a default system prompt), so any template that renders each message on its
own works. Without one (a plain language model) messages are their contents, one per line.
"""

from __future__ import annotations

from typing import Any

from astraflow.agents.env import Message

_DUMMY = [{"role": "user", "content": "\x1e"}]
_PROBE = "\x1f"


class ChatRenderer:
    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = tokenizer.eos_token_id
        if self.templated:
            base = self._render(_DUMMY)
            turn = self._render(_DUMMY + [{"role": "assistant", "content": _PROBE}])
            if not turn.startswith(base) or _PROBE not in turn:
                raise ValueError("the tokenizer's chat template does not render messages one by one; "
                                 "set the tokenizer's chat_template to one that does")
            self._closing = turn[turn.rindex(_PROBE) + len(_PROBE):]
        else:
            self._closing = "\n"

    def _render(self, messages: list[Message], gen: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def start(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Tokens of the first observation, ending where the model's first turn begins. The
        tools' JSON schemas go to the template (a tool-using model's template lists them in its
        system prompt; a template that does not use them ignores them)."""
        if not self.templated:
            return self.encode("".join(m["content"] + "\n" for m in messages))
        return self.encode(self._render(messages, gen=True, tools=tools))

    def observation(self, messages: list[Message]) -> list[int]:
        """Tokens of ``messages`` following a closed model turn, ending where the next turn begins."""
        if not self.templated:
            return self.encode("".join(m["content"] + "\n" for m in messages))
        base = self._render(_DUMMY)
        full = self._render(_DUMMY + list(messages), gen=True)
        if not full.startswith(base):
            raise ValueError("the tokenizer's chat template does not render messages one by one")
        return self.encode(full[len(base):])

    def close_turn(self, ended_on_eos: bool) -> list[int]:
        """Tokens the template puts after a model turn that the model did not generate."""
        ids = self.encode(self._closing)
        if ended_on_eos and ids and ids[0] == self.eos_id:
            ids = ids[1:]
        return ids



def prompt_ids(tokenizer: Any, workload: Any, payload: Any) -> list[int]:
    """Token ids of a single-turn prompt: the workload's chat messages (``render_messages``)
    rendered with the tokenizer's chat template and its generation prompt when both exist,
    else the workload's plain text (``render_prompt``) as the model's tokenizer encodes it."""
    render = getattr(workload, "render_messages", None)
    messages = render(payload) if render is not None and getattr(tokenizer, "chat_template", None) else None
    if messages is not None:  # (a mixture returns None for its plain-text sources)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(workload.render_prompt(payload)))


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The tokens that end a model turn: the end-of-sequence token and, with a chat template,
    the special token the template closes an assistant message with (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``), which need not be the tokenizer's eos."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if getattr(tokenizer, "chat_template", None):
        try:
            closing = ChatRenderer(tokenizer)._closing
        except Exception:  # a template that cannot render the probe conversation: eos only
            closing = ""
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        first = list(tokenizer.encode(closing.lstrip(), add_special_tokens=False))[:1]
        ids += [i for i in first if i in special and i not in ids]
    return ids
