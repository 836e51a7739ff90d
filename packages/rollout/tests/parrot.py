"""A model that says one thing, with a tokenizer that writes "Answer:" in three pieces, both built here.

`bpe_tokenizer()` is a byte-level BPE trained on text that has "Ans", "wer" and ":" often and never
"Answer", so "Answer:" encodes as Ans, wer, :. `build_parrot(path)` trains a tiny Llama (a few dozen
steps) until its greedy completion of PROMPT is TEXT then </s>, and saves it with that tokenizer: a
model folder that the embedded engine and vLLM load. In TEXT, the ":" of "Ans:" (one piece of the
stop string) comes before "Answer:".
"""

from __future__ import annotations

from pathlib import Path

PROMPT = "Q"
TEXT = "x Ans: y Answer: 42\n"


def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["x Ans y power tower: 42", "Ans wer Ans: x y 42 power", "x Ans y wer tower: 42\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def build_parrot(path: str | Path) -> Path:
    import json

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = bpe_tokenizer()
    # head size 32: the least vLLM's CPU attention takes
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prompt, completion = tok.encode(PROMPT), [*tok.encode(TEXT), tok.eos_token_id]
    ids = torch.tensor([prompt + completion])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}))
    return path
