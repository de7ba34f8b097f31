"""LoRA on a real pretrained Llama-architecture folder lowers its held-out loss.

The folder is made once per session: a small Llama (tied embeddings, grouped-query
attention) whose weights are really pretrained, on the built-in corpus (the standard
library's sources) with a tokenizer of its own, and saved as a Hugging Face folder. Most of
its parameters are in the attention and MLP layers LoRA adapts, not in the embedding. The
engine then loads it a tensor at a time, wraps it with adapters and fine-tunes them on text
of another kind, and the held-out loss of that text goes down.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine import Engine, EngineConfig
from engine.data.corpus import default_corpus
from engine.data.tokenizer import train_tokenizer
from engine.models.lora import Lora, LoraWeights, apply_lora, parameter_counts
from engine.models.zoo import meta_build

VOCAB = 512
SEQ_LEN = 64
PRETRAIN_CHARS = 400_000  # of the built-in corpus: about 2600 blocks of SEQ_LEN tokens
PRETRAIN_STEPS = 40
DOMAIN = "chunk device host budget margin policy gradient optimizer memory step".split()


def corpus_text(chars: int) -> str:
    """The first `chars` characters of the built-in corpus's documents."""
    text = "".join(itertools.islice(default_corpus().documents(), 200))
    return text[:chars]


def blocks(ids: list[int], n: int | None = None) -> torch.Tensor:
    whole = len(ids) // SEQ_LEN * SEQ_LEN
    out = torch.tensor(ids[:whole]).view(-1, SEQ_LEN)
    return out if n is None else out[:n]


def mean_loss(model: torch.nn.Module, data: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=data, labels=data).loss)


@pytest.fixture(scope="session")
def pretrained_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama pretrained on the built-in corpus, in a Hugging Face folder with its
    tokenizer. A few seconds, once per session."""
    folder = tmp_path_factory.mktemp("pretrained-llama")
    text = corpus_text(PRETRAIN_CHARS)
    tokenizer = train_tokenizer([text], vocab_size=VOCAB)
    data = blocks(tokenizer(text, add_special_tokens=False)["input_ids"])
    train, held_out = data[:-16], data[-16:]
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        fresh = mean_loss(model, held_out)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(PRETRAIN_STEPS):
            batch = train[torch.randint(0, len(train), (16,))]
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    # Pretrained for real: far better than chance on source code it never saw.
    assert mean_loss(model, held_out) < fresh - 1.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prose(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(DOMAIN) for _ in range(rng.randint(4, 10))) + ".\n"
                   for _ in range(sentences))


def test_lora_through_the_engine_lowers_the_held_out_loss_of_a_pretrained_folder(
        pretrained_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrained_llama, local_files_only=True)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    train = blocks(encode(prose(1, 600)))
    held_out = blocks(encode(prose(2, 200)), 16)

    built = meta_build(str(pretrained_llama), seed=0)
    embedding = built.model.get_input_embeddings().weight.numel()
    model = apply_lora(built.model, Lora(rank=8), seed=0)
    trainable, frozen = parameter_counts(model)
    assert embedding < 0.3 * frozen  # the layers LoRA adapts hold most of the weights
    config = EngineConfig(policy="cpu", device_budget="256MiB", precision="fp32", lr=1e-2,
                          weight_decay=0.0)
    with Engine(model, config, weights=LoraWeights(model, built.weights, 0)) as eng:
        before = eng.evaluate({"input_ids": held_out, "labels": held_out})
        generator = torch.Generator().manual_seed(0)
        for _ in range(20):
            batch = train[torch.randint(0, len(train), (8,), generator=generator)]
            eng.step({"input_ids": batch, "labels": batch})
        after = eng.evaluate({"input_ids": held_out, "labels": held_out})

    # The engine's starting point is the folder's model, as transformers loads it.
    plain = AutoModelForCausalLM.from_pretrained(pretrained_llama, local_files_only=True)
    assert before == pytest.approx(mean_loss(plain.eval(), held_out), rel=1e-5)
    assert after < before - 0.5, (before, after)
