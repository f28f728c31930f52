"""Writes the tiny random-weight Llama model; runs inside the runtime's python.

Usage: python _make_model.py OUT_DIR

wedgectl's own environment has no torch or transformers, so this file is run
as a script by the runtime interpreter and imports nothing from wedgectl.
Everything is derived from fixed seeds and the text below, so two runs write
the same tokenizer and the same weights.
"""

import json
import sys
from pathlib import Path

SEED = 20261130

# A few hundred words of plain English: enough for a byte-level BPE to learn
# whole-word merges for the prompts the tests send.
CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital
of Italy is Rome. The capital of Spain is Madrid. The capital of England is
London. Paris is a large city on the river Seine, and many people visit it
every year to see the old streets, the museums and the tower made of iron.
The quick brown fox jumps over the lazy dog. A small dog sleeps in the sun
while the cat watches the birds from the window. The birds sing in the
morning and fly away in the evening when the light grows dim.
Once upon a time there was a little house at the edge of a great forest. In
the house lived an old man, his daughter and a clever black cat. Every day
the old man walked into the forest to gather wood, and every night he told
stories by the fire about kings, rivers, mountains and the sea.
A server answers requests. A request has a prompt and asks for tokens. The
engine schedules the requests, runs the model and returns the tokens to the
client. When the queue is empty the engine waits for new work. When the
memory is full the scheduler must wait until a request finishes and its
blocks are free again. A healthy server keeps making progress; a stuck
server answers health checks but produces nothing.
Water is made of hydrogen and oxygen. The sun is a star, and the earth moves
around it once every year. The moon moves around the earth. Light travels
faster than sound, which is why we see the lightning before we hear the
thunder. Numbers count things: one, two, three, four, five, six, seven,
eight, nine, ten, eleven, twelve, twenty, fifty, one hundred, one thousand.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the
days of the week. January, February, March, April, May, June, July, August,
September, October, November and December are the months of the year.
Red, orange, yellow, green, blue and violet are colours of the rainbow.
Hello, how are you today? I am fine, thank you. What is your name? My name
is Ada. Where do you live? I live in a small town near the sea. What time is
it? It is nine o'clock in the morning. Please write a short story about a
robot who learns to paint. The robot painted the sky, the trees and the
people it met, and it was happy.
"""

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=1,
        special_tokens=[BOS, EOS, PAD, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per iterator item; the trainer is deterministic for fixed input.
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=4096,
    )
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_attention_heads=4,  # head_dim 32: CPU attention rejects 16
        num_key_value_heads=4,
        num_hidden_layers=2,
        intermediate_size=256,
        max_position_embeddings=16384,  # long enough for the starved repro (10k-token contexts)
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    make_model(out, tokenizer)
    prompt_ids = tokenizer("The capital of France is")["input_ids"]
    print(json.dumps({"vocab_size": len(tokenizer), "prompt_tokens": len(prompt_ids)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
