"""The prompt that continues an answer (``continue_final_message``): the chat template's text up to
where the final assistant message's content begins, then that content as sent, with no end of
turn after it. Rendered as Hugging Face renders chat templates (a sandboxed Jinja environment,
``trim_blocks`` and ``lstrip_blocks``), with the templates of SmolLM2 and of Qwen2.5 (as its
Coder models ship it), copied verbatim into ``chat_templates/``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agent.runtime.tokenizer import NotContinuable, open_final_message

# the templates as the models ship them (SmolLM2-135M-Instruct's; Qwen2.5-Coder-0.5B-Instruct's)
HERE = Path(__file__).parent / "chat_templates"
SMOLLM2 = (HERE / "smollm2.jinja").read_text(encoding="utf-8")
QWEN25 = (HERE / "qwen2.5.jinja").read_text(encoding="utf-8")
TEMPLATES = {"smollm2": SMOLLM2, "qwen2.5": QWEN25}


def renderer(template: str, add_generation_prompt: bool = False) -> Callable[[list[dict[str, str]]], str]:
    """The template applied to messages, as Hugging Face applies it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    compiled = env.from_string(template)
    return lambda msgs: compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt)


ASKED = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And another?"},
    ],
]
PARTIALS = ["The capital of", "Here:\n\n```python\n", " leading space and trailing space ", ""]


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("asked", ASKED, ids=["one question", "a later turn"])
@pytest.mark.parametrize("partial", PARTIALS)
def test_the_answer_is_left_open_where_a_new_one_would_begin(
    name: str, asked: list[dict[str, str]], partial: str
) -> None:
    template = TEMPLATES[name]
    prefix, content = open_final_message(renderer(template), [*asked, {"role": "assistant", "content": partial}])
    # the text before the answer is the prompt the answer was asked with (ending with the
    # generation prompt), and the answer follows as it was: the model goes on with it
    assert prefix == renderer(template, add_generation_prompt=True)(asked)
    assert prefix.endswith("<|im_start|>assistant\n") and content == partial
    # and nothing closes it: a whole turn would end with the end-of-turn marker
    whole = renderer(template)([*asked, {"role": "assistant", "content": partial}])
    assert whole == prefix + content + "<|im_end|>\n"


@pytest.mark.parametrize("last", ["user", "system"])
def test_only_an_assistant_message_is_continued(last: str) -> None:
    with pytest.raises(NotContinuable, match="assistant"):
        open_final_message(renderer(SMOLLM2), [{"role": last, "content": "Hi."}])
    with pytest.raises(NotContinuable):
        open_final_message(renderer(SMOLLM2), [])


def test_a_template_that_leaves_the_answer_out_cannot_continue_it() -> None:
    users_only = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% endif %}{% endfor %}"
    with pytest.raises(NotContinuable, match="does not show"):
        open_final_message(renderer(users_only), [*ASKED[0], {"role": "assistant", "content": "He"}])
