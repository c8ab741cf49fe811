"""The tokenizer of the builtin models: byte-level BPE, trained by `tokenizers`' BpeTrainer on
a built-in text.

Its special tokens sit at the ids they have in the 9B, so chat prompts and stop tokens take the
same paths as with the real model. The training text is at the end of this file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _Backend

from salabatch.engine.tokenizer import byte_symbols
from salabatch.engine.tokenizer_files import TOKENIZER_FILE
from salabatch.errors import TokenizerError
from salabatch.files import write_text_atomic

# Ids shared with the 9B: <unk> <s> </s> first, these 8 last (73440..73447 there).
HEAD_TOKENS = ("<unk>", "<s>", "</s>")
TAIL_TOKENS = (
    "<|im_end|>",
    "<|im_start|>",
    "<|tool_call|>",
    "<|execute_start|>",
    "<|execute_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
)
MIN_DEMO_VOCAB = len(HEAD_TOKENS) + 256 + len(TAIL_TOKENS)


def build_byte_tokenizer(dest_dir: str | Path, vocab_size: int = 1024) -> int:
    """Write the tokenizer of the builtin models into `dest_dir`; return its vocabulary size.

    It is small and trained on a built-in text: enough for the builtin models' synthetic
    documents, offline.

    Byte-level BPE: ids 0..2 are `<unk> <s> </s>`, then the 256 bytes (id 3 + byte), then the
    merges BpeTrainer learns from a small built-in English text, and the 8 chat/tool/FIM special
    tokens of the 9B as the last 8 ids (`<|im_end|>` = vocab_size - 8). Writes
    `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` (eos = [2, <|im_end|>]),
    byte-for-byte the same on every run. The returned size is `vocab_size` unless the training
    text ran out of pairs first; the model config must use the returned value.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TokenizerError("bad vocab size", field="vocab_size", expected="int", got=vocab_size)
    if vocab_size < MIN_DEMO_VOCAB:
        raise TokenizerError(
            "vocab too small", field="vocab_size", expected=f">= {MIN_DEMO_VOCAB}", got=vocab_size
        )
    backend = _trained_backend(vocab_size - len(TAIL_TOKENS))
    specials = (*HEAD_TOKENS, *TAIL_TOKENS)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # Like MiniCPM's: the backend would prepend <s>; salabatch never lets it (BOS policy in
    # salabatch.engine.tokenizer).
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    final = backend.get_vocab_size(with_added_tokens=True)
    for i, tok in enumerate(HEAD_TOKENS):
        assert backend.token_to_id(tok) == i, tok  # construction invariant, not user input
    for i, tok in enumerate(TAIL_TOKENS):
        assert backend.token_to_id(tok) == final - len(TAIL_TOKENS) + i, tok

    im_end = backend.token_to_id("<|im_end|>")
    tok_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(backend.token_to_id(t)): {"content": t, "special": True} for t in specials
        },
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 1048576,
        "salabatch_note": "tokenizer of salabatch's builtin models (builtin:tiny, builtin:random)",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }
    gen_config = {"bos_token_id": 1, "eos_token_id": [2, im_end], "pad_token_id": 2}

    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    write_text_atomic(dest / TOKENIZER_FILE, backend.to_str(pretty=True) + "\n")
    write_text_atomic(dest / "tokenizer_config.json", _json_text(tok_config))
    write_text_atomic(dest / "generation_config.json", _json_text(gen_config))
    return final


def _trained_backend(size: int) -> _Backend:
    """A byte-level BPE of at most `size` entries (<unk> <s> </s>, the bytes, merges).

    BpeTrainer is deterministic here: it numbers the alphabet in code-point order and breaks
    ties between equally frequent pairs by those numbers (only continuing-subword prefixes,
    unused here, get numbers in hash-map order). Its numbering is then replaced by byte order,
    so byte b is id 3 + b whatever the training text; merges keep their order.
    """
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    symbols = byte_symbols()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=list(HEAD_TOKENS),
        initial_alphabet=symbols,
        show_progress=False,
    )
    trained = _Backend(models.BPE())
    trained.pre_tokenizer = pre
    trained.train_from_iterator([_DEMO_CORPUS], trainer)
    model = json.loads(trained.to_str())["model"]
    base = {*HEAD_TOKENS, *symbols}
    learned = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in base]
    vocab = {t: i for i, t in enumerate([*HEAD_TOKENS, *symbols, *learned])}
    merges = [(a, b) for a, b in model["merges"]]

    backend = _Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    return backend


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# Training text for the demo merges; written for this file. Changing it changes the tokenizer.
_DEMO_CORPUS = """\
The archive opened at nine in the morning, and the first readers were already waiting on the
steps with their notebooks. Each of them had a question, and each question needed a document.
Some documents were short letters of a single page; others were reports of several hundred
pages, with tables, footnotes and appendices that nobody had read in years.

A good reader does not start at the first page and hope for the best. She looks at the table of
contents, finds the chapter that matters, and reads the summary before the details. When the
question is about money, she turns to the accounts. When the question is about people, she
looks for names, dates and places. When the question is about a promise, she reads the
contract, and she reads it twice, because the important words are often the small ones.

The river runs past the old library on its way to the sea. In spring the water is high and
brown; in summer it is low and clear, and children walk across the stones to the island in the
middle. The library has stood there for two hundred years. Its walls are thick, its windows are
tall, and its rooms are quiet even when the market outside is loud.

What is a summary? A summary keeps what matters and leaves out what does not. It answers the
questions a reader would ask first: who did what, when, where, and why. It is shorter than the
original, but it should not be vague. A summary that says "several issues were discussed" tells
the reader nothing; a summary that says "the parties agreed to pay the invoice within thirty
days" tells the reader something they can use.

Questions come in many forms. Some ask for a fact: the date of a meeting, the name of a
company, the amount of a payment. Some ask for a list: the risks of a project, the duties of a
tenant, the steps of a process. Some ask for an opinion, and those are the hardest, because the
answer must say where the opinion comes from and how strong the evidence is.

Numbers deserve special care. A report may say that sales grew by 12 percent in 2021, fell by
3 percent in 2022 and recovered in 2023. A careful reader checks whether the numbers add up,
whether the units are the same, and whether a table on page 40 agrees with the text on page 12.
Errors hide in the places where two parts of a document meet.

The weather was changing. Clouds came in from the west, the wind turned cold, and by the
afternoon the first drops of rain were falling on the windows of the reading room. The readers
did not notice. They were busy with their documents, turning pages, writing notes, and asking
the librarian for one more box from the basement.

Every answer should be honest about what it does not know. If the document does not say who
signed the agreement, the answer should say so, rather than guess. If two pages disagree, the
answer should point to both. A short answer that is right is worth more than a long answer that
is only partly right, and an answer that names its sources is worth more than one that does not.

Machines that read documents face the same problems as people. They must find the part of a
long text that answers the question, keep track of names and numbers across many pages, and
write an answer that is clear and complete. They read faster than people, but they can also be
wrong faster, so their answers should be checked, especially when a decision depends on them.

At the end of the day the librarian closed the windows, switched off the lamps and locked the
door. The rain had stopped. The river was louder than in the morning, and the streets were wet
and bright under the lights. Tomorrow there would be new readers, new questions and new
documents, and the archive would open again at nine.

Lists help readers: first, second, third; yes or no; before and after; cause and effect; north,
south, east and west; Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday;
January, February, March, April, May, June, July, August, September, October, November and
December. Code, too, has its words: def, return, import, class, for, while, if, else, print.
"""
