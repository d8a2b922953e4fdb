"""The tiny model loads through the real transformers code paths and fits vLLM's CPU constraints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.tiny_model import TinyModelConfig, build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_loads_with_auto_classes_and_generates(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert cfg.max_position_embeddings >= 8192
    ids = tok.apply_chat_template([{"role": "user", "content": "fix the bug in file 42"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nfix the bug in file 42<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    assert out.shape[1] == len(ids) + 5 or int(out[0, -1]) == tok.eos_token_id


def test_tokenizer_round_trips_text_and_has_chat_tokens(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    sample = "def f(x):\n    return x == 12345  # ok"
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.eos_token == "<|im_end|>"
    assert len(tok) == TinyModelConfig().vocab_size


def test_same_seed_same_weights(tmp_path: Path, tiny: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert json.loads((again / "tokenizer.json").read_text()) == json.loads((tiny / "tokenizer.json").read_text())


def test_unsupported_head_size_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head size vLLM"):
        TinyModelConfig(hidden_size=64, num_heads=4)  # head_dim 16 kills vLLM's CPU server
    proc = subprocess.run([sys.executable, "-m", "harnessrl.cli", "tiny-model", str(tmp_path / "m"),
                           "--hidden-size", "48"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "head size" in proc.stderr and "Traceback" not in proc.stderr


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]
TOOL_HISTORY = [
    {"role": "system", "content": "you are a coding agent"},
    {"role": "user", "content": "read file 42"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "def f(): pass"},
    {"role": "tool", "tool_call_id": "c2", "content": "second"},
]


def test_chat_template_renders_tools_tool_calls_and_results_like_qwen(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    plain = tok.apply_chat_template(TOOL_HISTORY[:2], add_generation_prompt=True, tokenize=False)
    with_tools = tok.apply_chat_template(TOOL_HISTORY[:2], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>system\nyou are a coding agent<|im_end|>\n<|im_start|>user\nread file 42<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert with_tools != plain
    assert with_tools.startswith("<|im_start|>system\nyou are a coding agent\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in with_tools
    full = tok.apply_chat_template(TOOL_HISTORY, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert full.endswith(
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.py\"}}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\ndef f(): pass\n</tool_response>\n"
        "<tool_response>\nsecond\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # arguments as an object (transformers users) render as the JSON string OpenAI clients send
    as_dict = [dict(m) for m in TOOL_HISTORY]
    as_dict[2] = {**as_dict[2], "tool_calls": [{"type": "function", "function": {"name": "read_file",
                                                                                 "arguments": {"path": "a.py"}}}]}
    assert tok.apply_chat_template(as_dict, tools=TOOLS, add_generation_prompt=True, tokenize=False) == full


def test_tool_markers_are_single_tokens_kept_in_decoded_text(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok.encode('<tool_call>\n{"name": "f"}\n</tool_call>')
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>") and ids[-1] == tok.convert_tokens_to_ids("</tool_call>")
    assert tok.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "f"}\n</tool_call>'
    ids = tok.encode("<think>plan</think>answer")
    assert ids[0] == tok.convert_tokens_to_ids("<think>") and tok.convert_tokens_to_ids("</think>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>plan</think>answer"
