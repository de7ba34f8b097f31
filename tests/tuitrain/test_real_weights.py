"""Fine-tuning real weights end to end: a small pretrained Llama in a local folder (tied
embeddings, a 32k vocabulary, a tokenizer of its own), fine-tuned by `tuitrain run FOLDER
--headless`, and its checkpoint judged by plain transformers on held-out text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine.data.tokenizer import train_tokenizer
from tuitrain.cli import main

pytestmark = pytest.mark.slow  # a pretraining loop and a worker process: tens of seconds

VOCAB = 32_000
SEQ_LEN = 32
BATCH = 4
EVAL_BATCHES = 8  # the run scores up to EVAL_BATCHES x BATCH held-out sequences
GENERAL = "the a of and to in is was for on with as by at from that this it".split()
DOMAIN = "chunk device host budget margin policy gradient optimizer memory step".split()


def prose(seed: int, words: list[str], sentences: int) -> str:
    rng = random.Random(seed)
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))) + "."
             for _ in range(sentences))
    return "\n".join(lines) + "\n"


def blocks(ids: list[int]) -> torch.Tensor:
    whole = len(ids) // SEQ_LEN * SEQ_LEN
    return torch.tensor(ids[:whole]).view(-1, SEQ_LEN)


def pretrained_model(folder: Path) -> None:
    """A Llama with tied embeddings, trained a little on general text, and its tokenizer,
    saved as a Hugging Face model folder."""
    texts = [prose(i, GENERAL + DOMAIN, 100) for i in range(10)]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)  # as many tokens as the text gives
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    data = blocks(tokenizer("".join(texts), add_special_tokens=False)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        batch = data[torch.randint(0, len(data), (8,))]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def held_out_loss(model_folder: Path, tokenizer_folder: Path, text: str) -> float:
    """The mean loss of plain transformers on every whole block of `text`, tokenised as a
    run tokenises a document (ended by the end-of-sequence token)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_folder, local_files_only=True).eval()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    sequences = blocks(ids)
    assert len(sequences) <= EVAL_BATCHES * BATCH  # the run scores the same blocks
    with torch.no_grad():
        return float(model(input_ids=sequences, labels=sequences).loss)


def test_fine_tuning_a_pretrained_folder_lowers_its_held_out_loss(tmp_path, monkeypatch, capsys):
    start = tmp_path / "pretrained"
    pretrained_model(start)
    train = tmp_path / "train.txt"
    train.write_text("".join(prose(100 + i, DOMAIN, 60) for i in range(10)))
    held_out = prose(999, DOMAIN, 80)
    (tmp_path / "held.txt").write_text(held_out)

    monkeypatch.chdir(tmp_path)
    status = main(["run", str(start), "--headless", "--steps", "12",
                   "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN), "--lr", "3e-3",
                   "--precision", "fp32", "--data", "train.txt", "--eval-data", "held.txt",
                   "--eval-every", "6", "--eval-batches", str(EVAL_BATCHES),
                   "--checkpoint-dir", "ck", "--metrics", "m.jsonl"])
    done = capsys.readouterr()
    assert status == 0, done.out + done.err
    assert "held-out loss" in done.out

    checkpoint = tmp_path / "ck" / "step-000012" / "model"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] is True
    before = held_out_loss(start, start, held_out)
    after = held_out_loss(checkpoint, start, held_out)
    assert after < before - 0.5, (before, after)

    # The run's own evaluation measured the same thing on the same blocks.
    evals = [json.loads(line)["eval"] for line in (tmp_path / "m.jsonl").read_text().splitlines()
             if line.startswith('{"eval"')]
    assert [e["step"] for e in evals] == [6, 12]
    assert evals[-1]["loss"] == pytest.approx(after, rel=1e-4)
