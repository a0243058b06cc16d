"""What a tool-call token program costs the mask stage per row (engine/token_calls.py; docs/server.md
"Tool calls"): Mistral v11 required calls over mistral_common's 131k Tekken vocabulary (its v11
special tokens added), 1 / 8 / 32 tools. Reports the program's compile (the first one also builds
xgrammar's view of the vocabulary), the call's first row (every tool's matcher made and alive: the
name) and a row inside the arguments (one tool alive), medians of 20. The rows are filled on the
mask worker thread while the forward runs. Needs mistral_common (a test dependency).

    .venv/bin/python benchmarks/token_calls.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, markdown_table  # noqa: E402

from cuttle.engine.sampling_params import SamplingParams  # noqa: E402
from cuttle.engine.structured_output import StructuredOutput, tool_call_structure  # noqa: E402
from cuttle.engine.tokenizer import Tokenizer  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
            "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"]
OPEN, ARGS, CALL_ID = 9, 20, 21


def tekken_dir() -> str:
    import mistral_common

    data = json.load(open(os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")))
    data["config"]["version"] = "v11"
    data["special_tokens"] = [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(SPECIALS)]
    d = tempfile.mkdtemp()
    json.dump(data, open(os.path.join(d, "tekken.json"), "w"))
    return d


def median_ms(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1000


def main() -> None:
    tok = Tokenizer(tekken_dir())
    stage = StructuredOutput(tok, 131072, {tok.eos_token_id})
    bitmask = torch.full((1, stage.width), -1, dtype=torch.int32)
    bits = bitmask.numpy().view(np.uint32)
    prompt = [1, 3, 100, 4, OPEN]  # the server's opening of a required call: [TOOL_CALLS]
    rows = []
    for ntools in (1, 8, 32):
        tools = [{"type": "function", "function": {"name": f"tool_number_{i}", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}, "required": ["path"]}}}
            for i in range(ntools)]
        so = tool_call_structure("mistral", "required", None, tools, tok, True, "[TOOL_CALLS]{{n}}[CALL_ID]{{i}}[ARGS]")
        t0 = time.perf_counter()
        ctl = stage.prepare(SamplingParams(structured_outputs=so))
        compile_ms = (time.perf_counter() - t0) * 1000

        def first_row() -> None:
            ctl.call_states.clear()
            stage.fill_row(ctl, 0, prompt, len(prompt), len(prompt), bitmask, bits, 0)

        ids = (prompt + tok.encode("tool_number_0", add_special_tokens=False) + [CALL_ID]
               + tok.encode("abc123def", add_special_tokens=False) + [ARGS] + tok.encode('{"path": "a', add_special_tokens=False))

        def argument_row() -> None:  # caught up to the row before, then the row itself
            ctl.call_states.clear()
            stage.fill_row(ctl, 0, ids[:-1], len(prompt), len(ids) - 1, bitmask, bits, 0)
            stage.fill_row(ctl, 0, ids, len(prompt), len(ids), bitmask, bits, 0)

        catch_up = median_ms(lambda: (ctl.call_states.clear(), stage.fill_row(ctl, 0, ids[:-1], len(prompt), len(ids) - 1,
                                                                                bitmask, bits, 0)))
        rows.append([ntools, f"{compile_ms:.0f}", f"{median_ms(first_row):.2f}", f"{max(0.0, median_ms(argument_row) - catch_up):.2f}"])
    print(machine_info())
    print(markdown_table(["tools", "compile (ms)", "first row (ms)", "argument row (ms)"], rows))


if __name__ == "__main__":
    main()
