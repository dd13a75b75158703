"""The token layout of a multi-turn conversation.

A multi-turn episode is stored as one token sequence: the first observation, the model's
turn, the environment's reply, the next turn, ... The context the model continues from is
always exactly the tokens stored so far; nothing is re-tokenised, so the stored tokens are what
was generated and what was observed.

``ChatRenderer`` gives the pieces, each as token ids:

* ``start(messages)``: the first observation plus the opening of the model's first turn;
* ``close_turn(ended)``: what the template writes after a model turn's content that the model
  did not generate (for ``<|im_end|>\\n`` templates: the ``\\n`` after the stop token the model
  ended with, or the whole closing when the turn was cut by its token budget);
* ``observation(messages)``: new messages plus the opening of the next model turn.

With a chat template the pieces are differences of rendered conversations (a dummy first
exchange cancels a default system prompt and keeps roles alternating), so any template that
renders each message on its own works, one that trims contents too. For a template that
insists on alternating user and assistant roles (it cannot render tool messages, or two in a
row), each observation goes as one user message, its messages' contents joined; so does an
observation that a template would render without a message's content (a role it skips), and a
first observation's system messages go at the head of the first user message.
Without one (a plain language model) messages are their contents, one per line.

An environment's text never becomes control tokens: a special token's text inside a message
(a web page quoting ``<|im_end|><|im_start|>assistant``) is broken by a zero-width space
before it is rendered, so it cannot end the message or forge a model turn.

A turn ends when the engine stops on one of ``stop_ids``: the tokens the engines stop on (the
eos token, the template's closing token, ``<|im_end|>``, ``<|endoftext|>``), which need not be
the tokenizer's eos.
"""

from __future__ import annotations

import json
from typing import Any

from astraflow.agents.env import EpisodeError, Message

# printable, not whitespace (templates ``| trim`` contents), unlikely in any real message
_DUMMY = [{"role": "user", "content": "AstraFlowDummyQuestion"}]
_DUMMY_TURN = _DUMMY + [{"role": "assistant", "content": "AstraFlowDummyAnswer"}]
_PROBE = "AstraFlowProbe"
_NAMED_TOKENS = ("<|im_end|>", "<|endoftext|>")
_FIX = "set the tokenizer's chat_template (tokenizer_config.json) to one that does, or remove it"


class ChatRenderer:
    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = tokenizer.eos_token_id
        #: the texts of the special tokens, longest first (``defused``)
        self._special_texts = sorted({t for t in getattr(tokenizer, "all_special_tokens", ()) if len(t) > 1},
                                     key=len, reverse=True)
        if self.templated:
            try:
                base = self._render(_DUMMY)
                turn = self._render(_DUMMY + [{"role": "assistant", "content": _PROBE}])
            except Exception as err:
                raise ValueError(f"the tokenizer's chat template cannot render a user and an assistant message "
                                 f"({type(err).__name__}: {err}); {_FIX}") from None
            if not turn.startswith(base) or _PROBE not in turn:
                raise ValueError(f"the tokenizer's chat template does not render messages one by one "
                                 f"(a conversation one message longer does not extend its rendering); {_FIX}")
            self._closing = turn[turn.rindex(_PROBE) + len(_PROBE):]
            #: observations go as one user message (tool results and several messages merged):
            #: for a template that insists on alternating user and assistant roles
            self._merge = False
            #: system messages go at the head of the first user message: for a template that skips
            #: the system role without an error (Phi-3's first), which would drop them
            self._fold = False
            try:  # an observation after a model turn, as every multi-turn episode renders one
                self.observation([{"role": "user", "content": _PROBE}])
            except _NotOneByOne as err:
                raise ValueError(str(err)) from None
            except Exception as err:
                raise ValueError(f"the tokenizer's chat template cannot render a user message after an "
                                 f"assistant turn ({type(err).__name__}: {err}); {_FIX}") from None
            tools = [{"role": "tool", "content": f"{_PROBE}{i}"} for i in (1, 2)]
            try:  # tool results, several at once, each rendered (a template may skip a role it does not know)
                self.observation(tools)
                self._merge = not _kept(self._render(_DUMMY_TURN + tools, gen=True), tools)
            except Exception:
                self._merge = True
            system = [{"role": "system", "content": _PROBE}]
            try:
                self._fold = not _kept(self._render(system + _DUMMY, gen=True), system)
            except Exception:  # a template without a system role that says so: ``start`` folds on the error
                pass
        else:
            self._closing = "\n"
        #: the tokens a model turn may end with (module docstring)
        self.stop_ids = frozenset(turn_stop_ids(tokenizer, self._closing))
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        #: the token a scripted (demonstration) turn ends with: the template's closing token
        first = self.encode(self._closing.lstrip())[:1]
        self.end_id = first[0] if first and first[0] in self.stop_ids else self.eos_id

    def _render(self, messages: list[Message], gen: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def defused(self, messages: list[Message]) -> list[Message]:
        """``messages`` with every special token's text in their contents broken by a zero-width
        space after its first character (module docstring); the same list when there is none."""
        if not any(t in m["content"] for m in messages for t in self._special_texts):
            return messages
        out = []
        for m in messages:
            content = m["content"]
            for t in self._special_texts:
                content = content.replace(t, t[0] + "\u200b" + t[1:])
            out.append({**m, "content": content})
        return out

    def start(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Tokens of the first observation, ending where the model's first turn begins. The
        tools' JSON schemas go to the template (a tool-using model's template lists them in its
        system prompt; a template that does not use them ignores them). Without a template the
        tokenizer adds its special tokens (a BOS), as a single-turn prompt gets them; a template
        that has no system role gets the system messages' text at the head of the first user
        message."""
        messages = self.defused(messages)
        if not self.templated:
            return list(self.tok.encode("".join(m["content"] + "\n" for m in messages)))
        try:
            folded = _fold_system(messages) if self._fold else None
            return self.encode(self._render(folded or messages, gen=True, tools=tools))
        except Exception as err:
            folded = _fold_system(messages)
            if folded is not None:
                try:
                    return self.encode(self._render(folded, gen=True, tools=tools))
                except Exception:
                    pass
            raise EpisodeError(f"the chat template cannot render the first observation ({type(err).__name__}: "
                               f"{err}); {_FIX}") from err

    def observation(self, messages: list[Message]) -> list[int]:
        """Tokens of ``messages`` following a closed model turn, ending where the next turn begins:
        what the template renders after the (dummy) turn's closing. Not a difference of whole
        renderings: a template may render the last assistant turn otherwise than one a user
        message follows (Qwen3's empty think block)."""
        messages = self.defused(messages)
        if not self.templated:
            return self.encode("".join(m["content"] + "\n" for m in messages))
        if self._merge or (self._fold and any(m["role"] == "system" for m in messages)):
            messages = _merged(messages)
        full = self._render(_DUMMY_TURN + list(messages), gen=True)
        answer = _DUMMY_TURN[-1]["content"]
        at = full.find(answer) + len(answer)
        if at < len(answer) or not full.startswith(self._closing, at):
            raise _NotOneByOne(f"the tokenizer's chat template does not render messages one by one (the "
                               f"assistant turn is not closed by {self._closing!r} when a message follows "
                               f"it); {_FIX}")
        return self.encode(full[at + len(self._closing):])

    def close_turn(self, ended: bool) -> list[int]:
        """Tokens the template puts after a model turn that the model did not generate;
        ``ended``: the turn ended on a stop token, which stands for the closing's own."""
        ids = self.encode(self._closing)
        # the stop token stands for the closing's own, and what comes before it for nothing the
        # model wrote when it is blank (Llama 2's ' </s>'): the stop token is not written twice
        at = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
        if ended and at is not None and not self.tok.decode(ids[:at]).strip():
            ids = ids[at + 1:]
        return ids

    def ended(self, tokens: list[int], finish_reason: str) -> bool:
        """Whether a model turn of ``tokens`` ended on a stop token (not cut by its budget): one of
        ``stop_ids``, or another special token an engine stopped on (a model's own list of ends)."""
        if finish_reason != "stop" or not tokens:
            return False
        return tokens[-1] in self.stop_ids or tokens[-1] in self._special



class _NotOneByOne(ValueError):
    """The template does not render an observation after a closed turn as the same closing."""


def _merged(messages: list[Message]) -> list[Message]:
    """``messages`` as one user message, their contents joined (none: none)."""
    return [{"role": "user", "content": "\n\n".join(m["content"] for m in messages)}] if messages else []


def _kept(text: str, messages: list[Message], role: str | None = None) -> bool:
    """Whether a rendering ``text`` holds the content of each of ``messages`` (of ``role``, when
    given), as it is or JSON-quoted (``| tojson``): a template may skip a role it does not know
    without an error."""
    def found(content: str) -> bool:
        return content.strip() in text or json.dumps(content.strip(), ensure_ascii=False)[1:-1] in text

    return all(found(m["content"]) for m in messages if role is None or m["role"] == role)


def _fold_system(messages: list[Message]) -> list[Message] | None:
    """``messages`` with the system messages' contents put at the head of the first user
    message (for templates without a system role); ``None`` when there is none or no user."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    first = next((m for m in rest if m["role"] == "user"), None)
    if not system or first is None:
        return None
    first["content"] = "\n\n".join(system + [first["content"]])
    return rest


def prompt_ids(tokenizer: Any, workload: Any, payload: Any) -> list[int]:
    """Token ids of a single-turn prompt: the workload's chat messages (``render_messages``)
    rendered with the tokenizer's chat template and its generation prompt when both exist (a
    template without a system role gets the system text at the head of the first user message,
    as an episode's first observation does), else the workload's plain text (``render_prompt``)
    as the model's tokenizer encodes it."""
    render = getattr(workload, "render_messages", None)
    messages = render(payload) if render is not None and getattr(tokenizer, "chat_template", None) else None
    if messages is not None:  # (a mixture returns None for its plain-text sources)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if not _kept(text, messages, "system"):  # a template that skips the system role without an error
                text = tokenizer.apply_chat_template(_fold_system(messages) or messages, tokenize=False,
                                                     add_generation_prompt=True)
        except Exception:
            folded = _fold_system(messages)
            if folded is None:
                raise
            text = tokenizer.apply_chat_template(folded, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(workload.render_prompt(payload)))


def turn_stop_ids(tokenizer: Any, closing: str | None = None) -> set[int]:
    """The tokens an engine stops a turn on: ``end_of_turn_ids`` and ``<|im_end|>`` and
    ``<|endoftext|>`` where the vocabulary has them (``closing``: the template's text after an
    assistant message, when the caller knows it already)."""
    stops = set(end_of_turn_ids(tokenizer, closing))
    vocab = getattr(tokenizer, "get_vocab", None)
    known = vocab() if callable(vocab) else {}
    stops |= {known[name] for name in _NAMED_TOKENS if name in known}
    return {s for s in stops if s is not None}


def end_of_turn_ids(tokenizer: Any, closing: str | None = None) -> list[int]:
    """The tokens that end a model turn: the end-of-sequence token and, with a chat template,
    the special token the template closes an assistant message with (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``), which need not be the tokenizer's eos."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if getattr(tokenizer, "chat_template", None):
        if closing is None:
            try:
                closing = ChatRenderer(tokenizer)._closing
            except ValueError:  # a template that cannot render the probe conversation: eos only
                closing = ""
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        first = list(tokenizer.encode(closing.lstrip(), add_special_tokens=False))[:1]
        # a closing the vocabulary lacks encodes as unk: no stop (an eos that is unk, as GPT-2's, is one)
        unk = getattr(tokenizer, "unk_token_id", None)
        ids += [i for i in first if i in special and i not in ids and i != unk]
    return ids
