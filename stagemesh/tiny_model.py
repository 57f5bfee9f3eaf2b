"""Write a tiny, randomly initialised causal-LM checkpoint to a local directory.

Tests and demos of stagemesh need real Hugging Face checkpoints (config, safetensors
weights, tokenizer) that load with ``AutoModelForCausalLM`` / ``AutoTokenizer``, but
they must run without network access to a model hub. This script builds such a
checkpoint from scratch: a Llama, Mistral or Qwen2 architecture with random weights
and a small byte-level BPE tokenizer trained on an inline corpus. Output is
deterministic for a given seed.

From the command line: ``python scripts/make_tiny_model.py OUT --family llama|mistral|qwen2 ...``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16")
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
BOS, EOS, PAD, UNK = SPECIAL_TOKENS
# 4 special tokens + 256 byte-level symbols must fit into the vocabulary.
MIN_VOCAB = len(SPECIAL_TOKENS) + 256
# Copied from transformers' Qwen2Tokenizer (see _build_tokenizer).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox
ran into the forest before anyone could follow. In the morning the village woke
to the sound of rain on the roofs, and the baker opened his shop at six o'clock
as he had done every day for the last thirty years.

Hello world! This is a small corpus of plain English text, used to train a tiny
tokenizer. It contains sentences about weather, travel, cooking and computers.
When the train left the station at 9:45, there were 128 passengers on board and
3 dogs. The journey took 2 hours and 17 minutes, which was 12% longer than usual.
The conductor apologised for the delay and offered everyone a cup of tea.

To make bread you need flour, water, salt and yeast. Mix 500 grams of flour with
350 millilitres of warm water, add 10 grams of salt and 7 grams of dried yeast.
Knead the dough for ten minutes, let it rise for one hour, shape it, and bake it
at 230 degrees for about 35 minutes. The crust should be golden and crisp, and
the loaf should sound hollow when you tap the bottom.

Distributed systems are hard because networks are unreliable, clocks drift, and
machines fail at the worst possible moment. A good design accepts that failure
is normal: it retries with backoff, it times out slow requests, and it keeps
enough state to recover after a crash. Large language models can be split into
stages, where each stage holds a contiguous range of transformer layers and
sends its hidden states to the next stage over the network.

def greet(name: str) -> str:
    \"\"\"Return a friendly greeting.\"\"\"
    if not name:
        raise ValueError("name must not be empty")
    return f"Hello, {name}!"

for i in range(10):
    print(i, i * i, [x for x in range(i) if x % 2 == 0])

class Stage:
    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end

    def forward(self, hidden_states, attention_mask=None):
        for layer in self.layers[self.start:self.end]:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return hidden_states

config = {"layers": 8, "hidden": 256, "heads": 8, "vocab": 1000, "dtype": "float32"}
values = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024, 65536, 3.14159, -1e-6]
if (a + b) * c >= 0 and not done: result = {"ok": True, "items": [a, b, c]}

The numbers one, two, three, four, five, six, seven, eight, nine and ten are the
first words many children learn to count with. In 1969 people walked on the moon
for the first time; in 2024 there were more than 8,000,000,000 people on Earth.
Prices rose from $1.99 to $2.49, and the temperature fell to -5 degrees at night.

She opened the old letter carefully. "Dear friend," it began, "I hope this finds
you well. The garden is full of roses this year, and the apple tree has finally
given fruit." She smiled, folded the paper, and put it back into the drawer,
thinking about the summer when they were both young and the world seemed simple.

Questions and answers: What is the capital of France? Paris. How many days are in
a week? Seven. Why is the sky blue? Because air scatters short wavelengths of
sunlight more than long ones. Who wrote this text? Nobody important; it is only
here so that the tokenizer sees a little bit of everything, including symbols
such as @, #, &, *, <, >, =, +, ~, ^, |, \\, /, and brackets ( ) [ ] { }.
"""


def _validate(
    family: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_position: int,
    dtype: str,
) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("intermediate", intermediate),
        ("max_position", max_position),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if (hidden // heads) % 2:
        raise ValueError(f"head dim ({hidden // heads}) must be even for rotary embeddings")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab must be >= {MIN_VOCAB} (4 special tokens + 256 bytes), got {vocab}")


def _build_tokenizer(family: str, vocab: int, max_position: int) -> Any:
    """Train a byte-level BPE on ``CORPUS`` and wrap it for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE covers every byte, so the model itself never needs an unk token.
    backend = Tokenizer(models.BPE())
    if family == "qwen2":
        # AutoTokenizer always loads qwen2 checkpoints as Qwen2Tokenizer, which rebuilds
        # this exact normalizer/pre-tokenizer pipeline; train with it so that the saved
        # tokenizer.json and the loaded tokenizer agree.
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert backend.token_to_id(token) == i, (token, backend.token_to_id(token))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=max_position,
        clean_up_tokenization_spaces=False,
    )
    if len(tokenizer) > vocab:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, more than vocab={vocab}")
    return tokenizer


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    *,
    layers: int = 8,
    hidden: int = 256,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int = 688,
    vocab: int = 1000,
    max_position: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    sliding_window: int | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random ``family`` checkpoint plus tokenizer into ``out_dir``; return its path.

    ``sliding_window``: every layer attends to at most this many positions (mistral and qwen2; the
    default is full attention). ``tie_word_embeddings``: the LM head is the embedding matrix (the
    checkpoint then has no ``lm_head.weight``)."""
    _validate(family, layers, hidden, heads, kv_heads, intermediate, vocab, max_position, dtype)
    if sliding_window is not None:
        if family == "llama":
            raise ValueError("sliding_window: llama has none; use mistral or qwen2")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")

    import torch
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(family, vocab, max_position)
    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_position,
        "tie_word_embeddings": tie_word_embeddings,
        **special_ids,
    }
    if family == "llama":
        config = LlamaConfig(**common)
    elif family == "mistral":
        config = MistralConfig(**common, sliding_window=sliding_window)
    else:  # qwen2: q/k/v projections carry a bias by design; a window, if any, on every layer
        window = {} if sliding_window is None else {"use_sliding_window": True, "max_window_layers": 0}
        config = Qwen2Config(**common, **({"use_sliding_window": False} | window), sliding_window=sliding_window)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "qwen2":
        # Default init zeros the biases; make them non-zero so the bias path matters.
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    assert proj.bias is not None
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen) * 0.02)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.config.dtype = dtype
    model.eval()

    model.generation_config = GenerationConfig(**special_ids)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)

    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {family} model to {out} ({n_params:,} parameters, {dtype})")
    return out
