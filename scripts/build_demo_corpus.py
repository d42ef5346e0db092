"""Build the bundled demo corpus and tokenizer: three real-text sources and a small BPE vocabulary.

Sources (written to `upcycler/data/demo/corpus/`):
- code:  Python standard-library source files (a fixed list of modules, from the running Python),
- prose: the English documentation topics shipped with Python (`pydoc_data.topics`),
- math:  generated arithmetic problems with worked answers (seeded).
Each source is split into a train file and a held-out file (the last 5% of its documents).
The tokenizer (`tokenizer.json`) is a byte-level BPE trained on the train files.

Reproducible: `python scripts/build_demo_corpus.py --seed 0` gives the same files for the same Python.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
from pathlib import Path

CODE_MODULES = (
    "textwrap", "json.decoder", "json.encoder", "json.scanner", "string", "heapq", "bisect", "fractions",
    "statistics", "difflib", "csv", "configparser", "argparse", "dataclasses", "functools", "enum",
    "pathlib", "shlex", "fnmatch", "glob", "colorsys", "calendar", "copy", "pprint", "reprlib", "queue",
    "sched", "graphlib", "operator", "numbers", "contextlib", "abc", "base64", "quopri", "uu", "netrc",
    "html.parser", "gettext", "locale", "tokenize", "ast", "dis", "inspect", "typing", "random", "datetime",
)
EOS = "<|endoftext|>"
OUT = Path(__file__).resolve().parents[1] / "upcycler" / "data" / "demo"


def code_documents() -> list[str]:
    docs = []
    for name in CODE_MODULES:
        try:
            docs.append(inspect.getsource(importlib.import_module(name)))
        except (ImportError, OSError, TypeError):
            continue
    return docs


def prose_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def math_documents(rng: random.Random, count: int = 6000) -> list[str]:
    docs = []
    for _ in range(count):
        a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 9)
        kind = rng.choice(("add", "mul", "mix", "sub"))
        if kind == "add":
            docs.append(f"Question: What is {a} + {b}?\nAnswer: {a} + {b} = {a + b}. The answer is {a + b}.")
        elif kind == "sub":
            docs.append(f"Question: What is {a} - {b}?\nAnswer: {a} - {b} = {a - b}. The answer is {a - b}.")
        elif kind == "mul":
            docs.append(f"Question: What is {b} * {c}?\nAnswer: {b} * {c} = {b * c}. The answer is {b * c}.")
        else:
            docs.append(
                f"Question: What is {a} + {b} * {c}?\nAnswer: First {b} * {c} = {b * c}. "
                f"Then {a} + {b * c} = {a + b * c}. The answer is {a + b * c}."
            )
    return docs


def split(docs: list[str], held_out: float = 0.05) -> tuple[list[str], list[str]]:
    n = max(1, int(len(docs) * held_out))
    return docs[:-n], docs[-n:]


def train_tokenizer(files: list[Path], vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    tok.save(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()
    corpus = OUT / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    sources = {
        "code": code_documents(),
        "prose": prose_documents(),
        "math": math_documents(random.Random(args.seed)),
    }
    train_files = []
    for name, docs in sources.items():
        train, held = split(docs)
        for part, chunk in (("train", train), ("heldout", held)):
            path = corpus / f"{name}.{part}.jsonl"
            path.write_text("".join(json.dumps({"text": d}) + "\n" for d in chunk))
            if part == "train":
                train_files.append(path)
        print(f"{name}: {len(train)} train / {len(held)} held-out documents")
    plain = [corpus / f"{n}.tmp.txt" for n in sources]
    for name, path in zip(sources, plain):
        path.write_text("\n".join(split(sources[name])[0]))
    train_tokenizer(plain, args.vocab_size, OUT / "tokenizer.json")
    for path in plain:
        path.unlink()
    (OUT / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
         "unk_token": None, "pad_token": EOS, "model_max_length": 1024}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
