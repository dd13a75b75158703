"""The token layout with templates other than the built tokenizer's."""

from __future__ import annotations

import pytest

from astraflow.agents.chat import ChatRenderer
from astraflow.models import build_tokenizer

#: a template in the style of tool-using chat models: a default system prompt when none is
#: given (listing the tools when there are some), tool results folded into a user turn
SYSTEM_DEFAULT = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou help."
    "{% if tools %} Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tok():
    t = build_tokenizer()
    t.chat_template = SYSTEM_DEFAULT
    return t


def test_pieces_concatenate_to_the_full_rendering(tok):
    r = ChatRenderer(tok)
    first = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    answer = "ok"
    ids = r.start(first, tools=tools) + r.encode(answer) + [tok.eos_token_id] + r.close_turn(True)
    ids += r.observation([{"role": "tool", "content": "found"}])
    full = tok.apply_chat_template(first + [{"role": "assistant", "content": answer},
                                            {"role": "tool", "content": "found"}],
                                   tokenize=False, add_generation_prompt=True, tools=tools)
    assert tok.decode(ids) == full
    assert full.count("You help. Tools: search") == 1  # the default system prompt appears once


def test_a_cut_turn_gets_the_whole_closing(tok):
    r = ChatRenderer(tok)
    assert tok.decode(r.close_turn(False)) == "<|im_end|>\n"
    assert tok.decode(r.close_turn(True)) == "\n"


def test_a_template_that_does_not_render_turn_by_turn_is_refused():
    t = build_tokenizer()
    t.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="one by one"):
        ChatRenderer(t)
