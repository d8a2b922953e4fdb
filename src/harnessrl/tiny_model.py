"""Build a tiny Qwen2-style model and tokenizer locally, with no model hub.

Tests, examples and first-time users need a model that vLLM serves and the learner trains on a laptop CPU in
seconds, and nothing may be downloaded at run time. The model is random, but the *loading code* is the real
one: it is written with ``save_pretrained`` and read back by vLLM and transformers exactly like a hub model.

Shape constraints (measured, see ENVIRONMENT.md): vLLM's CPU attention needs head_dim in {32, 64, ...}, and
real harness prompts run to thousands of tokens, so the position limit is long (RoPE costs no weights).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import click

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's tool markers and Qwen3's reasoning markers: ordinary (non-special) added tokens, so they survive
# `skip_special_tokens` in the server's output text, where vLLM's `hermes` tool parser and `deepseek_r1` /
# `qwen3` reasoning parsers look for them (they refuse a vocabulary without them).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
THINK_TOKENS = ["<think>", "</think>"]

# ChatML as Qwen2.5 renders it, tools included: with ``tools`` the system message lists them in <tools></tools>
# and says how to call them; an assistant's ``tool_calls`` render as <tool_call> JSON blocks (``arguments`` as
# sent: a JSON string, as OpenAI clients send it, is written as is; an object, as transformers users pass it,
# through ``tojson``); ``tool`` results are <tool_response> blocks in one user turn. Without tools and tool
# calls this is plain ChatML (no default system message, unlike Qwen's), so plain chat renders as before.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] or '' }}{{- '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a an and or not to of in on for with from by as is are was be this that it its we you they "
    "file line code test run call tool read write open close list find search patch diff error fix bug "
    "python function class def return import if else while for try except raise yield async await "
    "user system assistant answer question task reward model token prompt step policy agent harness "
    "data value key name path size count index item result output input status ok fail pass done"
).split()


@dataclass(frozen=True)
class TinyModelConfig:
    """Knobs for the tiny model; the defaults are what the tests and the example run use."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4  # head_dim = hidden_size / num_heads = 32, the smallest vLLM CPU supports
    num_kv_heads: int = 2
    max_position_embeddings: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        if rest or head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
            raise ValueError(
                f"hidden_size/num_heads = {self.hidden_size}/{self.num_heads} must be a head size vLLM's CPU "
                "attention supports (32, 64, 80, 96, 112, 128, ...): change hidden_size or num_heads"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


def _corpus(rng: random.Random, lines: int) -> list[str]:
    """Text that looks a little like agent traffic: words, code, numbers and punctuation."""
    out: list[str] = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(3, 20)):
            roll = rng.random()
            if roll < 0.7:
                words.append(rng.choice(_WORDS))
            elif roll < 0.85:
                words.append(str(rng.randint(0, 99999)))
            else:
                words.append(rng.choice(["()", "[]", "{}", "=", "==", ":", ",", ".", "->", "#", '"', "'", "_"]))
        sep = rng.choice([" ", " ", " ", "\n", "\t"])
        out.append(sep.join(words))
    return out


def build_tokenizer(path: Path, cfg: TinyModelConfig):
    """Train a byte-level BPE tokenizer on generated text and save it as a transformers fast tokenizer
    (``cfg.vocab_size`` tokens in all: the trained ones, the chat tokens, the tool and reasoning markers)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size - len(TOOL_TOKENS) - len(THINK_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(cfg.seed), 4000), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS + THINK_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=cfg.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path: str | Path, cfg: TinyModelConfig | None = None) -> Path:
    """Write a loadable model directory (config, safetensors weights, tokenizer, chat template) to ``path``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    cfg = cfg or TinyModelConfig()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, cfg)
    vocab = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10000.0,
        # Untied on purpose: vLLM 0.32's in-place `reload_weights` replaces the embedding parameter but leaves a
        # tied LM head pointing at the old tensor, so a synced policy would be served with its initial head.
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(path, safe_serialization=True)
    (path / "harnessrl_tiny_model.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return path


@click.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Seed for the tokenizer corpus and the weights.")
@click.option("--max-position", default=8192, show_default=True, help="Longest sequence the model accepts.")
@click.option("--layers", default=2, show_default=True)
@click.option("--hidden-size", default=128, show_default=True)
def tiny_model_command(directory: Path, seed: int, max_position: int, layers: int, hidden_size: int) -> None:
    """Build a tiny random Qwen2-style model + tokenizer in DIRECTORY (no download)."""
    try:
        cfg = TinyModelConfig(seed=seed, max_position_embeddings=max_position, num_layers=layers,
                              hidden_size=hidden_size, intermediate_size=2 * hidden_size)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    out = build_tiny_model(directory, cfg)
    click.echo(f"tiny model written to {out}")
