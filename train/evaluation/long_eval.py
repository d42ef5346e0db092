"""Long-context checks of a checkpoint (`upcycle eval`): the tasks' prompts, their scoring, the summary.

Three tasks, each a list of `Item`s (prompt token ids of an exact length, optional answer ids):

- needle (`needle_items`): passkey retrieval. Per length L and prompt i of n, a seeded 5–7 digit key, the
  sentence `NEEDLE` inserted at depth d_i (evenly spread over 10%–90% of the prompt, moved to the nearest
  sentence end at most `MAX_SHIFT` tokens away) in a haystack of shuffled corpus documents (repeated if
  needed), then `QUESTION`. The pieces are tokenised separately and joined at token boundaries, the
  haystack cut so that the prompt is exactly L tokens: every prompt of one length has one shape. The
  answer is the tokenisation of " KEY" that follows the question's tokens (`question_and_answer`).
- perplexity (`perplexity_items`): seeded windows of L tokens of prepared data (`upcycle prepare-data`,
  read with `upcycler.train.data.sources.open_source`), the windows spread over its sources in turn.
- prompts (`read_prompts`): the user's own JSONL prompts, `{"prompt": ..., "answer": ... (optional)}`.

Scoring (`evaluate`) calls a runner with batches of prompts of one shape, `run_batch(ids, answers)` ->
[.last_logits, .answer_logits, .stats] and `next_token_logprobs_batch(ids)` -> [(logprobs, stats)], up to
its `batch_size` at a time (`upcycler.train.evaluation.prefill.PrefillModel`), and keeps per
item what the summary needs: top-1, whether greedy decoding retrieves the answer (`greedy_retrieves`),
the last-token log-distribution when a second model is compared, NLL per position, and the fraction of
key blocks the attention computed. `upcycler.train.evaluation.long_eval_report` turns the outcomes into
the result, the table and the plot.

Pure numpy and tokenizers: JAX is the runner's business, so prompts are built and tested without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe, escape, parse_json, read_bytes, read_text, shown_path

TASKS = ("needle", "perplexity", "prompts")
MAX_LENGTH = 1 << 22  # 4M tokens: far beyond any model, small enough to catch a typo
MAX_LENGTHS = 64  # distinct --lengths: each is a compile and a row
MAX_TOTAL_TOKENS = 1 << 26  # prompt tokens of one run in all (held as int32 until scored): 256 MB
MAX_PROMPT_CHARS = 1 << 22  # characters of one prompt: tokenizing holds ~0.5 kB per token
MAX_PROMPTS = 10_000  # per length, and lines of a prompts file
MAX_PROMPTS_BYTES = 256 * 1024**2
MAX_TOKENIZER_BYTES = 512 * 1024**2
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.1, 0.9)  # the needle's depths spread over this fraction of the prompt
MAX_SHIFT = 64  # tokens the needle may move to start after a sentence end (about one sentence)
MIN_HAYSTACK = 64  # tokens of haystack a needle prompt needs at least
DECILES = 10
_SENTENCE_ENDS = (".", "!", "?", "\n")
_LENGTH = re.compile(r"(\d+)([kK]?)")


@dataclass(frozen=True)
class Item:
    """One prompt: `ids` [length] int32, `answer` [m] int32 or None, `info` what the JSON shows of it."""

    length: int
    ids: np.ndarray
    answer: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)


# --- options ------------------------------------------------------------------------------------------


def parse_lengths(text: str) -> list[int]:
    """`4k,8k,4096` -> [4096, 8192] (k = 1024; order kept, repeats dropped)."""
    out: list[int] = []
    for part in text.split(","):
        match = _LENGTH.fullmatch(part.strip())
        if match is None:
            raise UpcyclerError(f"--lengths: {describe(part.strip())} is not a length; pass token counts "
                                "such as --lengths 4k,8k,16k or 4096 (k = 1024)")
        digits = match[1].lstrip("0") or "0"  # int() of thousands of digits is slow, and refused
        value = int(digits) * (1024 if match[2] else 1) if len(digits) <= 12 else MAX_LENGTH + 1
        if not 2 <= value <= MAX_LENGTH:
            raise UpcyclerError(f"--lengths: {describe(part.strip())} must be between 2 and {MAX_LENGTH:,} tokens; "
                                "pass e.g. --lengths 4k,8k")
        if value not in out:
            out.append(value)
        if len(out) > MAX_LENGTHS:
            raise UpcyclerError(f"--lengths: more than {MAX_LENGTHS} lengths, the limit; pass fewer, e.g. "
                                "--lengths 4k,8k,16k")
    return out


def check_total(tokens: int, what: str, fix: str) -> None:
    """Refuse a run whose prompts hold more than `MAX_TOTAL_TOKENS` tokens in all (unless
    UPCYCLER_LIMITS=off), before any prompt is built."""
    from upcycler.spec import LIMITS_ENV, limits_on

    if tokens > MAX_TOTAL_TOKENS and limits_on():
        raise UpcyclerError(f"{what}: {tokens:,} prompt tokens in all, more than the limit of "
                            f"{MAX_TOTAL_TOKENS:,}; {fix} (or set {LIMITS_ENV}=off)")


def show_length(length: int) -> str:
    """4096 -> "4k", 1000 -> "1000"."""
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


# --- tokenizers -----------------------------------------------------------------------------------------


def tokenizer_file(model: Path) -> Path:
    """MODEL/tokenizer.json, which must exist."""
    path = Path(model) / "tokenizer.json"
    if not path.exists() and not path.is_symlink():  # a directory or FIFO there: `open_regular` says so
        raise UpcyclerError(f"{shown_path(path)}: missing; the eval tasks tokenise with the model's own "
                            "tokenizer, copy its tokenizer.json into the model directory")
    return path


def load_tokenizer(path: Path) -> tuple[Tokenizer, bytes]:
    """The tokenizer in `path` and the bytes it was built from."""
    data = read_bytes(path, max_bytes=MAX_TOKENIZER_BYTES, what="tokenizer.json")
    try:
        return Tokenizer.from_str(data.decode("utf-8")), data
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise UpcyclerError(f"{shown_path(path)}: not a readable tokenizer.json ({escape(str(err))[:120]}); "
                            "re-save it with tokenizers") from None


def special_prefix(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer's post-processor puts before a text (a BOS), if any."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def answer_after(tokenizer: Tokenizer, prompt: str, answer: str, *,
                 special: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the answer is what follows the prompt's own tokens in the tokenisation of
    prompt + answer, so it is what the model would have to produce next. When the two merge across the
    boundary (a prompt ending in a space), the answer is tokenised on its own."""
    ids = tokenizer.encode(prompt, add_special_tokens=special).ids
    both = tokenizer.encode(prompt + answer, add_special_tokens=special).ids
    if both[:len(ids)] == ids and len(both) > len(ids):
        return ids, both[len(ids):]
    return ids, tokenizer.encode(answer, add_special_tokens=False).ids


def question_and_answer(tokenizer: Tokenizer, key: str) -> tuple[list[int], list[int]]:
    """The question's ids and the answer's: the tokens of " KEY" after the question. A tokenizer that spells
    " KEY" as a lone space token and then digits (SmolLM2's) gets the space at the end of the question, so
    the answer is the digits alone: a model is not asked to predict a bare space."""
    question, answer = answer_after(tokenizer, QUESTION, f" {key}", special=False)
    while len(answer) > 1 and not tokenizer.decode([answer[0]]).strip():
        question, answer = question + answer[:1], answer[1:]
    return question, answer


# --- needle ---------------------------------------------------------------------------------------------


def corpus_documents(corpus: Path) -> list[str]:
    """The documents of every `*.jsonl` file (lines `{"text": ...}`) in `corpus`, in file order."""
    from upcycler.train.data.readers import read_documents

    files = sorted(Path(corpus).glob("*.jsonl"))
    documents = [doc for path in files for doc in read_documents(path, "jsonl")]
    if not documents:
        raise UpcyclerError(f"{shown_path(corpus)}: no documents in *.jsonl; reinstall upcycler (the demo "
                            "corpus ships with it)")
    return documents


class Haystack:
    """Token streams of shuffled corpus documents, each document tokenised once, on first use."""

    def __init__(self, tokenizer: Tokenizer, documents: Sequence[str], where: str = "the tokenizer"):
        self.tokenizer, self.where = tokenizer, where
        self.documents = documents
        self.separator = tokenizer.encode("\n\n", add_special_tokens=False).ids
        self._ids: dict[int, list[int]] = {}
        self._ends: dict[int, bool] = {}

    def tokens(self, rng: np.random.Generator, count: int) -> list[int]:
        """`count` tokens: documents in a random order (then another, as often as needed), separated."""
        out: list[int] = []
        while len(out) < count:
            before = len(out)
            for index in rng.permutation(len(self.documents)):
                if index not in self._ids:
                    text = self.documents[index]
                    self._ids[index] = self.tokenizer.encode(text, add_special_tokens=False).ids
                out += self._ids[index] + self.separator
                if len(out) >= count:
                    break
            if len(out) == before:  # a tokenizer that gives no tokens for any document: never fills
                raise UpcyclerError(f"{self.where}: gives no tokens for the needle corpus; the needle task "
                                    "needs a tokenizer that encodes English text")
        return out[:count]

    def ends_sentence(self, token: int) -> bool:
        if token not in self._ends:
            self._ends[token] = self.tokenizer.decode([token]).rstrip(" \t").endswith(_SENTENCE_ENDS)
        return self._ends[token]

    def insertion(self, tokens: Sequence[int], target: int) -> int:
        """The position nearest `target` (at most `MAX_SHIFT` away) after a sentence end, else `target`."""
        target = min(max(target, 0), len(tokens))
        best = target
        for shift in range(MAX_SHIFT + 1):
            found = [j for j in (target - shift, target + shift)
                     if 0 <= j <= len(tokens) and (j == 0 or self.ends_sentence(tokens[j - 1]))]
            if found:
                best = found[0]
                break
        return best


def needle_depths(count: int) -> np.ndarray:
    """The intended depths of `count` needles: evenly spread over `DEPTHS`."""
    return np.linspace(*DEPTHS, count) if count > 1 else np.array([sum(DEPTHS) / 2])


def needle_items(tokenizer: Tokenizer, documents: Sequence[str], lengths: Sequence[int], per_length: int,
                 seed: int, where: str = "the tokenizer") -> list[Item]:
    """`per_length` passkey prompts of exactly L tokens for every L (module docstring); a function of the
    tokenizer, the documents, L, the prompt's index and `seed` alone. `where` names the tokenizer in errors."""
    check_total(sum(lengths) * per_length, "--lengths × --prompts-per-length",
                "pass fewer or shorter lengths or fewer --prompts-per-length")
    haystack = Haystack(tokenizer, documents, where)
    prefix = special_prefix(tokenizer)
    items = []
    for length in lengths:
        rng = np.random.default_rng([seed, length])
        for i, depth in enumerate(needle_depths(per_length)):
            digits = int(rng.integers(5, 8))
            key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
            needle = tokenizer.encode(f" {NEEDLE.format(key=key)}\n", add_special_tokens=False).ids
            question, answer = question_and_answer(tokenizer, key)
            if not answer or tokenizer.decode([int(t) for t in answer]).strip() != key:
                raise UpcyclerError(f"{where}: does not spell the pass key {key} back (its tokens decode to "
                                    f"{describe(tokenizer.decode([int(t) for t in answer]))}); the needle "
                                    "task needs a tokenizer that encodes digits")
            room = length - len(prefix) - len(needle) - len(question)
            if room < MIN_HAYSTACK:
                least = length - room + MIN_HAYSTACK
                raise UpcyclerError(f"--lengths: {length} tokens is too short for the needle task (prompt "
                                    f"{i} needs at least {least}); pass longer lengths")
            hay = haystack.tokens(rng, room)
            cut = haystack.insertion(hay, round(depth * length) - len(prefix))
            ids = prefix + hay[:cut] + needle + hay[cut:] + question
            start = len(prefix) + cut
            items.append(Item(length, np.asarray(ids, np.int32), np.asarray(answer, np.int32), {
                "index": i, "target_depth": float(depth), "depth": start / length,
                "needle_start": start, "needle_tokens": len(needle), "key": key,
                "answer_ids": [int(t) for t in answer],
            }))
    return items


def depth_bucket(depth: float) -> int:
    """The decile (0–9) of a depth in [0, 1]."""
    return min(DECILES - 1, int(round(depth * DECILES, 6)))


# --- perplexity -----------------------------------------------------------------------------------------


def perplexity_items(data: Path, tokenizer_sha256: str, vocab_size: int, lengths: Sequence[int],
                     per_length: int, seed: int) -> list[Item]:
    """`per_length` windows of exactly L tokens per length, from the sources of the prepared directory
    `data` in turn (those long enough), each at a seeded random start."""
    from upcycler.train.data.format import INDEX_SUFFIX
    from upcycler.train.data.sources import open_source, prepared_names

    data = Path(data)
    if not data.is_dir():
        raise UpcyclerError(f"{shown_path(data)}: --data is not a directory; pass a directory written by "
                            "`upcycle prepare-data --tokenizer MODEL …`")
    names = prepared_names(data)
    if not names:
        raise UpcyclerError(f"{shown_path(data)}: no prepared source (no *{INDEX_SUFFIX}); run `upcycle "
                            f"prepare-data --tokenizer MODEL --source NAME=FILES --out {shown_path(data)}`")
    sources = [open_source(data, name) for name in names]
    for source in sources:
        if source.tokenizer_sha256 != tokenizer_sha256:
            raise UpcyclerError(f"{shown_path(data)}: source {source.name!r} was prepared with another "
                                "tokenizer than the model's; prepare the data with MODEL/tokenizer.json")
        if int(source.meta["vocab_size"]) > vocab_size:
            raise UpcyclerError(f"{shown_path(data)}: source {source.name!r} has a vocabulary of "
                                f"{source.meta['vocab_size']}, more than the model's {vocab_size}; prepare "
                                "the data with the model's tokenizer")
    check_total(sum(lengths) * per_length, "--lengths × --prompts-per-length",
                "pass fewer or shorter lengths or fewer --prompts-per-length")
    items = []
    for length in lengths:
        usable = [s for s in sources if len(s.tokens) >= length]
        if not usable:
            most = max(len(s.tokens) for s in sources)
            raise UpcyclerError(f"--lengths: {length} tokens is longer than every source of "
                                f"{shown_path(data)} (at most {most:,}); pass shorter lengths or prepare "
                                "more data")
        rng = np.random.default_rng([seed, length])
        for i in range(per_length):
            source = usable[i % len(usable)]
            start = int(rng.integers(0, len(source.tokens) - length + 1))
            ids = np.asarray(source.tokens[start:start + length], dtype=np.int32)
            items.append(Item(length, ids, None, {"index": i, "source": source.name, "start": start}))
    return items


def decile_means(values: np.ndarray, length: int) -> np.ndarray:
    """[10]: the mean of `values[t]` (the NLL of token t + 1) over the tokens t + 1 in each tenth of the
    window (NaN for a tenth without one)."""
    bucket = np.minimum(DECILES - 1, (np.arange(1, len(values) + 1) * DECILES) // length)
    sums = np.bincount(bucket, weights=values, minlength=DECILES)
    counts = np.bincount(bucket, minlength=DECILES)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


# --- prompts --------------------------------------------------------------------------------------------


def read_prompts(path: Path, tokenizer: Tokenizer) -> list[Item]:
    """The prompts of a JSONL file (lines `{"prompt": "...", "answer": "..."}`, answer optional)."""
    fix = 'each line must be {"prompt": "...", "answer": "..."} (answer optional); fix that line'
    text = read_text(Path(path), max_bytes=MAX_PROMPTS_BYTES, what="prompts file (JSONL)")
    items, total = [], 0
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        where = f"{shown_path(path)}:{lineno}"
        record = parse_json(line, where, fix)
        if not isinstance(record, dict):
            raise UpcyclerError(f"{where}: not a JSON object with a \"prompt\"; {fix}")
        prompt, answer = record.get("prompt"), record.get("answer")
        if not isinstance(prompt, str) or not prompt:
            raise UpcyclerError(f"{where}: no non-empty \"prompt\" string; {fix}")
        if answer is not None and (not isinstance(answer, str) or not answer):
            raise UpcyclerError(f"{where}: \"answer\" must be a non-empty string; {fix}")
        if len(prompt) + len(answer or "") > MAX_PROMPT_CHARS:
            raise UpcyclerError(f"{where}: a prompt of {len(prompt) + len(answer or ''):,} characters, more "
                                f"than the limit of {MAX_PROMPT_CHARS:,}; shorten it")
        for value in (prompt, answer or ""):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise UpcyclerError(f"{where}: a lone UTF-16 surrogate (an escape such as \\ud800 without its "
                                    f"pair) is not text; {fix}") from None
        if len(items) == MAX_PROMPTS:
            raise UpcyclerError(f"{where}: more than {MAX_PROMPTS:,} prompts; split the file")
        if answer is None:
            ids, answer_ids = tokenizer.encode(prompt, add_special_tokens=True).ids, None
        else:
            ids, answer_ids = answer_after(tokenizer, prompt, answer, special=True)
        if not ids or (answer is not None and not answer_ids):
            raise UpcyclerError(f"{where}: the tokenizer gives no tokens for it; {fix}")
        if len(ids) > MAX_LENGTH:
            raise UpcyclerError(f"{where}: a prompt of {len(ids):,} tokens, more than {MAX_LENGTH:,}; shorten it")
        total += len(ids)
        check_total(total, shown_path(path), "split the file")
        info = {"index": len(items), "line": lineno, "answer": answer,
                "answer_ids": None if answer_ids is None else [int(t) for t in answer_ids]}
        items.append(Item(len(ids), np.asarray(ids, np.int32),
                          None if answer_ids is None else np.asarray(answer_ids, np.int32), info))
    if not items:
        raise UpcyclerError(f"{shown_path(path)}: no prompts; {fix}")
    return items


# --- running and scoring --------------------------------------------------------------------------------


def greedy_retrieves(last_logits: np.ndarray, answer_logits: np.ndarray, answer: np.ndarray) -> bool:
    """Would greedy decoding after the prompt produce exactly `answer` (m tokens)? Without a decode loop.

    Greedy decoding emits a_0 = argmax(last_logits); it then feeds a_0 back and emits the argmax of the
    logits after it, and so on. As long as every emitted token equals the answer's, the sequence fed back
    is exactly the answer's prefix, which is what teacher forcing feeds: so greedy produces the answer iff
    argmax(last_logits) == answer[0] and argmax(answer_logits[j-1]) == answer[j] for j = 1 … m-1, where
    answer_logits[j] are the (teacher-forced) logits after answer token j. At the first mismatch both
    diverge, and greedy has already failed. (Ties go to the lowest id, as `argmax` does.)
    """
    if int(np.argmax(last_logits)) != int(answer[0]):
        return False
    return all(int(np.argmax(answer_logits[j - 1])) == int(answer[j]) for j in range(1, len(answer)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def evaluate(model: Any, task: str, items: Sequence[Item], *, name: str = "the model",
             keep_distribution: bool = False,
             advance: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Per item, what one model does: `top1`, `retrieved` (None without an answer), `logp` (the last
    token's log-distribution, float32, with `keep_distribution`), `nll` (perplexity: per target token) and
    `density` (per layer, mean over heads: fraction of causal key blocks computed) and `sparse` (per
    layer: whether the sparse attention ran, else dense). Non-finite logits (NaN
    or inf weights) are an error naming `name`.

    Items go to the model in batches of up to `model.batch_size` consecutive items of one shape (prompt
    length, answer length): `run_batch` and `next_token_logprobs_batch`."""
    out = []
    for group in _batches(items, model.batch_size):
        if task == "perplexity":
            results = model.next_token_logprobs_batch(np.stack([item.ids for item in group]))
        else:
            answers = None if group[0].answer is None else np.stack([item.answer for item in group])
            results = model.run_batch(np.stack([item.ids for item in group]), answers)
        for item, result in zip(group, results, strict=True):
            out.append(_score(task, item, result, name, keep_distribution))
            advance()
    return out


def _batches(items: Sequence[Item], size: int) -> list[list[Item]]:
    """Runs of up to `size` consecutive items sharing a prompt length and an answer length."""
    shape = lambda item: (item.length, None if item.answer is None else len(item.answer))
    groups: list[list[Item]] = []
    for item in items:
        if groups and len(groups[-1]) < size and shape(groups[-1][0]) == shape(item):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _score(task: str, item: Item, result: Any, name: str, keep_distribution: bool) -> dict[str, Any]:
    """One item's record from what the model returned for it (see `evaluate`)."""
    if task == "perplexity":
        logprobs, stats = result
        record: dict[str, Any] = {"nll": -np.asarray(logprobs, dtype=np.float64)}
        finite = np.isfinite(record["nll"]).all()
    else:
        stats = result.stats
        last = np.asarray(result.last_logits)
        finite = np.isfinite(last).all() and np.isfinite(np.asarray(result.answer_logits)).all()
    if not finite:
        raise UpcyclerError(f"{name}: the model's logits are not finite on a {item.length}-token prompt "
                            "(NaN or inf weights?); check the checkpoint with `upcycle verify`")
    if task != "perplexity":
        retrieved = (None if item.answer is None
                     else greedy_retrieves(last, np.asarray(result.answer_logits), item.answer))
        record = {"top1": int(np.argmax(last)), "retrieved": retrieved}
        if keep_distribution:
            record["logp"] = log_softmax(last).astype(np.float32)
    record["density"] = np.asarray(stats.density, dtype=np.float64).reshape(
        np.shape(stats.density)[0], -1).mean(axis=1)
    record["sparse"] = np.asarray(stats.sparse, dtype=bool)
    return record


def kl_and_agreement(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, bool]:
    """KL(A‖B) of the last-token distributions (over the vocabulary both have) and whether top-1 agrees."""
    n = min(len(a["logp"]), len(b["logp"]))
    p, q = log_softmax(a["logp"][:n]), log_softmax(b["logp"][:n])
    return max(0.0, float(np.sum(np.exp(p) * (p - q)))), int(np.argmax(p)) == int(np.argmax(q))
