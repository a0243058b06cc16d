"""The reasoning parser (engine/reasoning_parsers.py): Qwen3-style outputs with thinking and tool
calls split into reasoning / content / calls, whole and streamed at random split points, the tool
parser fed the content only; where the output starts, from the prompt's tail, for both parsers."""
from __future__ import annotations

import json
import random

import pytest

from cuttle.engine.reasoning_parsers import AWAIT, CONTENT, OPENING, ReasoningParser, split_reasoning, start_state
from cuttle.engine.tool_parsers import StreamingToolParser, parse_tool_calls

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

# Outputs in the exact shape Qwen3 writes them (thinking block, blank line, answer / calls), as
# (start state, output, reasoning, content after the tool parser, calls as (name, arguments)).
CASES = [
    # thinking, then one Hermes call
    (AWAIT, '<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "\nThe user wants the weather in Paris. I should call get_weather.\n", "", [("get_weather", {"city": "Paris"})]),
    # a call written inside the thinking is thinking: never parsed as a call
    (AWAIT, '<think>\nI could emit <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> '
            'but the user asked for no tools.\n</think>\n\nIt is probably cold in Oslo.',
     '\nI could emit <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> but the user asked '
     'for no tools.\n', "\n\nIt is probably cold in Oslo.", []),
    # thinking, text, two calls
    (AWAIT, '<think>\nTwo cities.\n</think>\n\nLet me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Rome", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>',
     "\nTwo cities.\n", "Let me check both.", [("get_weather", {"city": "Rome", "days": 2}), ("get_weather", {"city": "Lyon"})]),
    # the model ran out of tokens while thinking: all reasoning, even a tag cut in half
    (AWAIT, "<think>\nStill weighing <tool_call> against plain text </thi", "\nStill weighing <tool_call> against plain text </thi",
     "", []),
    # no thinking block (a non-thinking reply of a hybrid model): all content
    (AWAIT, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>', None, "Sure.",
     [("get_weather", {"city": "Bern"})]),
    # the template closed an empty block (enable_thinking: false): a later <think> is just text
    (CONTENT, "No thinking here, only the word <think> in prose.", None, "No thinking here, only the word <think> in prose.", []),
    # the template opened the block (DeepSeek-R1 / Qwen3-Thinking-2507): the output starts in reasoning
    (OPENING, "Okay, 2 + 2.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2.\n", "\n\nThe answer is 4.", []),
    # ... and a model that writes <think> again anyway has it dropped
    (OPENING, "\n<think>\nhm\n</think>\nok", "\nhm\n", "\nok", []),
    # blanks before the model's own <think> are not content
    (AWAIT, "\n\n<think>a</think>b", "a", "b", []),
]


def _stream(state: str, text: str, cuts: list[int]) -> tuple[str, str, list]:
    """Feed `text` in pieces, as the chat route does: the reasoning parser reads the output,
    the tool parser the content the reasoning parser lets through."""
    rp, tp = ReasoningParser(state), StreamingToolParser("hermes", WEATHER)
    so_far = content_so_far = reasoning = content = ""
    calls = []
    bounds = [0, *cuts, len(text)]
    for k in range(1, len(bounds)):
        final = k == len(bounds) - 1
        so_far += text[bounds[k - 1]:bounds[k]]
        r, c = rp.feed(so_far, final=final)
        reasoning += r
        content_so_far += c
        d, new = tp.feed(content_so_far, final=final)
        content += d
        calls += new
    return reasoning, content, calls


@pytest.mark.parametrize("case", range(len(CASES)))
def test_recorded_outputs_split_whole_and_streamed_at_random_points(case):
    state, text, want_reasoning, want_content, want_calls = CASES[case]
    reasoning, content = split_reasoning(text, state)
    assert reasoning == want_reasoning
    visible, calls = parse_tool_calls(content or "", "hermes", WEATHER)
    assert visible == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    rng = random.Random(case)
    for trial in range(60):
        if trial < len(text):  # every single split point, then random multi-way splits
            cuts = [trial]
        else:
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, min(12, len(text) - 1))))
        r, c, streamed_calls = _stream(state, text, cuts)
        assert r == (want_reasoning or ""), cuts
        assert c.strip() == want_content.strip(), cuts  # whole parsing strips content around calls
        assert [(x.name, json.loads(x.arguments)) for x in streamed_calls] == want_calls, cuts
    # one character at a time
    r, c, streamed_calls = _stream(state, text, list(range(1, len(text))))
    assert r == (want_reasoning or "") and [(x.name, json.loads(x.arguments)) for x in streamed_calls] == want_calls


def test_nothing_that_could_be_a_tag_is_released_early():
    """A streamed delta never holds text that the next piece could turn into a tag."""
    rp = ReasoningParser(AWAIT)
    assert rp.feed("\n<th") == ("", "")  # could still be <think>
    assert rp.feed("\n<think>abc</th") == ("abc", "")  # "</th" held: could be </think>
    assert rp.feed("\n<think>abc</thx") == ("</thx", "")
    assert rp.feed("\n<think>abc</thx</think>tail") == ("", "tail")
    assert ReasoningParser(AWAIT).feed("<b") == ("", "<b")  # cannot become <think>: content at once


@pytest.mark.parametrize("parser,tail,enable_thinking,want", [
    ("qwen3", "<|im_start|>assistant\n", None, AWAIT),  # Qwen3 hybrid: the model opens <think> itself, or not
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, CONTENT),  # enable_thinking: false
    ("qwen3", "<|im_start|>assistant\n", False, CONTENT),  # thinking off, template without the empty block
    ("qwen3", "<|im_start|>assistant\n<think>\n", None, OPENING),  # Qwen3-Thinking-2507 / Qwen3.5 templates
    ("deepseek_r1", "<｜Assistant｜><think>\n", None, OPENING),
    ("deepseek_r1", "<｜Assistant｜>", None, OPENING),  # vLLM's deepseek_r1: no </think> means all reasoning
    ("deepseek_r1", "<｜Assistant｜></think>", None, CONTENT),
    ("qwen3", "", None, AWAIT),
    # Seed-OSS: qwen3's rule over its own tags (a <think> of another family is no block of its)
    ("seed_oss", "<seed:bos>assistant\n", None, AWAIT),
    ("seed_oss", "<seed:bos>assistant\n<seed:think>", None, OPENING),
    ("seed_oss", "<seed:bos>assistant\n<seed:think></seed:think>", None, CONTENT),
    ("seed_oss", "<seed:bos>assistant\n<think>", None, AWAIT),
])
def test_start_state_from_the_prompt_tail(parser, tail, enable_thinking, want):
    assert start_state(parser, tail, enable_thinking).state == want


def test_seed_oss_splits_its_own_tags_whole_and_streamed():
    """`<seed:think>...</seed:think>` is the reasoning; a `<think>` inside it is text; every split
    point of the stream adds up to the whole split."""
    start = start_state("seed_oss", "assistant\n")
    text = "<seed:think>plan <think>a</think> more</seed:think>The answer."
    assert split_reasoning(text, start) == ("plan <think>a</think> more", "The answer.")
    for cut in range(1, len(text)):
        rp = ReasoningParser(start)
        a = rp.feed(text[:cut])
        b = rp.feed(text, final=True)
        assert (a[0] + b[0], a[1] + b[1]) == ("plan <think>a</think> more", "The answer."), cut
        assert "<seed:" not in a[0] + a[1]


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        start_state("granite", "")
