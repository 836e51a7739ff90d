"""A tiny causal LM and a character-level tokenizer, built locally (no hub at run time).

Tests, benchmarks and `tidal demo` need a model that transformers, the embedded engine and vLLM all load
from a plain folder. `build_tiny_model(path)` writes one: a Llama-architecture model (or a Mixtral one
with `experts > 0`) with random weights, and a `tokenizer.json` whose vocabulary is one token per
character, so any text of the task alphabet round-trips exactly.

`arch="gpt_oss"` writes a GPT-OSS-like model instead (transformers' `GptOssForCausalLM`): MoE in every
layer (`experts`, default 4, top-`experts_per_token`) with GPT-OSS's expert layout (router with a bias;
fused, interleaved gate/up projection with biases; the clamped SwiGLU, alpha 1.702, limit 7.0),
attention sinks (one learned logit per head, `self_attn.sinks`, drawn N(0, 1) so they matter) and
biased attention projections. Every layer is `full_attention`: GPT-OSS alternates sliding-window
layers, which neither the embedded engine nor tidal-seqpar implement (both refuse a sliding window
rather than silently attending further), so the tiny model has none. Plain RoPE (no YaRN).

The tokenizer is saved with `tokenizer_class = PreTrainedTokenizerFast` and the model type is `llama`:
in transformers 5.x, `AutoTokenizer` on a `qwen2` folder swaps in a byte-level BPE tokenizer that drops
spaces, so we never depend on that mapping. Load it with `load_tokenizer(path)`.

Importing this module loads neither torch nor transformers (they load when a tokenizer or a model is
built): the rollout worker's module takes `load_tokenizer` from here, and the controller, which must
stay torch-free, imports that module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from tidal.rollout.episodes.renderers import CHATML

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)
# Every character the built-in tasks use; anything else is an error at encode time (no silent UNK).
ARCHS = ("llama", "gpt_oss")
ALPHABET = "0123456789+-*/()=?:;,. \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# The tool tasks' alphabet: the tags parser's `<calc>...</calc>`, `<result>`, `<error>` and `tool_call`.
TOOL_ALPHABET = ALPHABET + "<>_"


def build_char_tokenizer(alphabet: str = ALPHABET):
    """A `PreTrainedTokenizerFast` with one token per character of `alphabet`, plus <pad>, <s>, </s>."""
    # light module: transformers (and torch) load when built (see the module docstring)
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("tokenizer alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *alphabet))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, clean_up_tokenization_spaces=False
    )


def load_tokenizer(path: str | Path):
    """Load the tokenizer a `build_tiny_model` folder (or any folder with a tokenizer.json) carries."""
    # light module: transformers (and torch) load when built (see the module docstring)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def build_tiny_model(
    path: str | Path,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_positions: int = 512,
    experts: int = 0,
    experts_per_token: int = 2,
    tie_embeddings: bool = False,
    seed: int = 0,
    alphabet: str = ALPHABET,
    arch: str = "llama",
) -> Path:
    """Write a randomly initialised tiny causal LM + char tokenizer to `path` and return it.

    `experts > 0` builds a Mixtral-style MoE (so routing can be recorded and replayed); `arch="gpt_oss"`
    a GPT-OSS-like MoE with attention sinks (see the module docstring). Deterministic in `seed`. The folder loads with `AutoModelForCausalLM.from_pretrained(path)` and with vLLM, whose CPU
    attention wants a head size of 32 or more (hidden / heads).
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must split into heads ({heads}), and heads into kv_heads ({kv_heads})")
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    # light module: transformers (and torch) load when built (see the module docstring)
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(alphabet)
    config = _tiny_config(arch, tokenizer, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, max_positions=max_positions, experts=experts,
                          experts_per_token=experts_per_token, tie_embeddings=tie_embeddings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "gpt_oss":
        with torch.no_grad():  # the default init (N(0, 0.02)) leaves the sinks near 0; make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # vLLM and transformers both read the end-of-sequence id from here
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }))
    return path


def _tiny_config(arch: str, tokenizer: Any, *, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int, max_positions: int, experts: int, experts_per_token: int,
                 tie_embeddings: bool) -> Any:
    """The transformers config of `build_tiny_model`'s model: Llama, Mixtral (`experts`) or GPT-OSS-like."""
    # light module: transformers (and torch) load when built (see the module docstring)
    from transformers import GptOssConfig, LlamaConfig, MixtralConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_embeddings,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    if arch == "gpt_oss":
        layer_types = ["full_attention"] * layers  # no sliding window (see the module docstring)
        return GptOssConfig(num_local_experts=experts or 4, num_experts_per_tok=experts_per_token,
                            head_dim=hidden // heads, layer_types=layer_types,
                            # read only by sliding layers (there are none); transformers insists on a value
                            sliding_window=max_positions,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            attention_bias=True, router_aux_loss_coef=0.0, **common)
    if experts:
        return MixtralConfig(num_local_experts=experts, num_experts_per_tok=experts_per_token, **common)
    return LlamaConfig(**common)


CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_BPE_CORPUS = (
    "What is 12*34? Let me compute it with the calculator. The answer is 408.",
    "You may call one or more functions to assist with the user query. Answer: 11",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
    "system user assistant tool function parameters properties type object string description",
)


def build_chatml_tokenizer(corpus: tuple[str, ...] | list[str] = _BPE_CORPUS, vocab_size: int = 400):
    """A byte-level BPE `PreTrainedTokenizerFast`, trained here on `corpus` (no hub), with ChatML's special
    tokens and chat template (`tidal.rollout.episodes.renderers.CHATML`); its EOS is ``<|im_end|>``. Tests use it
    to check renderers against a real BPE the way a Qwen-style model folder would tokenise."""
    # light module: transformers (and torch) load when built (see the module docstring)
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]  # tokenizers' setters are untyped
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]  # tokenizers' setters are untyped
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHATML_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML
    return fast
