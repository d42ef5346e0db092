"""lm-evaluation-harness tasks on the JAX model: `upcycle eval MODEL --task lm-eval:TASKS`.

`JaxLM` is an lm-eval `TemplateLM` backed by a checkpoint (HF or Orbax) run through the JAX model in
float32 at the highest matmul precision, so any harness task (its own or a local `--include` directory)
scores an upcycled or trained checkpoint without converting it to PyTorch. `task_manager` and
`load_tasks` find and load the tasks (an `--include` directory alone when it holds them all),
`evaluate_tasks` runs them as `lm_eval.simple_evaluate` does, and `summarize`, `format_table` and
`sample_lines` give the result, its table and the per-document records.

What it preserves: the scores `lm_eval --model hf --model_args pretrained=DIR,dtype=float32` gives on the
same checkpoint (up to float32 rounding), because every choice HFLM makes is made the same way:

- requests are split into context and continuation by the harness's own `TemplateLM._encode_pair`, and an
  empty context is the prefix token (BOS, else EOS);
- the tokenizer encodes as transformers' fast tokenizer does (`HFTokenizer`): `tokenizer.json` with its
  post-processor (the BOS it adds, if any; transformers ignores `add_bos_token` in tokenizer_config.json
  when there is a tokenizer.json), the BOS and EOS of `tokenizer_config.json`, and a text that already
  starts with the prefix token's text gets no special tokens;
- `loglikelihood`: context + continuation truncated from the left to `max_length + 1` tokens (the model's
  `max_position_embeddings`), the sum of the continuation tokens' log-probabilities, and whether greedy
  decoding yields every one of them;
- `loglikelihood_rolling`: the harness's rolling windows of `max_length` tokens after the prefix token;
- `generate_until`: greedy decoding of at most `max_gen_toks` tokens (256 unless the task says) after the
  context truncated from the left to `max_length - max_gen_toks`, stopped at the EOS tokens of
  `generation_config.json` (else of config.json, which the spec's extras carry), at the EOS text and at
  the task's stop sequences; the text is decoded without special tokens and cut at the first stop sequence.

Not modelled: transformers' per-class defaults (a tokenizer class whose constructor adds a BOS that
tokenizer.json does not; the EOS a config class assumes when neither generation_config.json nor
config.json names one), WordPiece clean-up of decoded spaces, sampling (a task that asks for it is
refused: decoding is greedy) and chat templates. Requests are sorted by length and run `batch_size` at a
time padded to power-of-two lengths, so jit compiles once per length bucket, not per request; padding sits
after each row's tokens and cannot change them (causal attention, dropless MoE). Generation recomputes the
whole prefix for every new token (no KV cache): fine for short answers.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Iterable, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tokenizers import Tokenizer
from tqdm import tqdm

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train.config import ModelConfig
from upcycler.train.model import hidden_states, unembed, weights_for_compute
from upcycler.untrusted import describe, escape, load_json_object, shown_path

FP32 = ModelConfig(compute_dtype="float32")
MIN_LENGTH = 64  # the shortest padded length of a batch
MIN_SCORED = 4  # the fewest scored positions per row
SCORE_CHUNK = 256  # scored positions per row whose logits are alive at once
MAX_GEN_TOKS = 256  # HFLM's default


# --- the tokenizer, as transformers' fast tokenizer sees it ----------------------------------------------


def _special(settings: dict[str, Any], key: str) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken mapping's content."""
    value = settings.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A model directory's tokenizer encoding and decoding as transformers' fast tokenizer does, from
    tokenizer.json and tokenizer_config.json alone (no transformers)."""

    def __init__(self, directory: Path):
        from upcycler.train.data.tokenizer import load_tokenizer

        config_path = directory / "tokenizer_config.json"
        settings = load_json_object(config_path, what="tokenizer config") if config_path.exists() else {}
        eos_text = _special(settings, "eos_token")
        try:
            info = load_tokenizer(directory, eos_text)
        except UpcyclerError as err:
            if "--eos" not in str(err):  # prepare-data's fix, an option this command does not have
                raise
            what = ("names no eos_token, and no EOS can be found" if eos_text is None
                    else f"eos_token {describe(eos_text)} is not a token of tokenizer.json")
            raise UpcyclerError(f"{shown_path(config_path)}: {what}; the harness ends generations and empty "
                                "contexts with the EOS, name it in \"eos_token\"") from None
        self.tokenizer: Tokenizer = info.tokenizer
        self.eos_id = info.eos_id
        self.bos_text = _special(settings, "bos_token")
        self.bos_id = None if self.bos_text is None else self.tokenizer.token_to_id(self.bos_text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _generation_eos(directory: Path, spec: ModelSpec) -> set[int]:
    """The EOS ids greedy decoding stops at, as transformers' `generate` takes them: those of
    `generation_config.json`, else of the model config (`config.json`, carried in the spec's extras)."""
    path = directory / "generation_config.json"
    config = load_json_object(path, what="generation config") if path.exists() else spec.extras_dict
    value = config.get("eos_token_id")
    return {v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int) and not isinstance(v, bool)}


# --- the model ---------------------------------------------------------------------------------------------


def _bucket(n: int, low: int) -> int:
    """The power of two at least `n` (and at least `low`)."""
    return max(low, 1 << max(0, n - 1).bit_length())


@partial(jax.jit, static_argnames=("spec", "chunk"))
def _scores_jit(params, ids_BL, positions_BC, targets_BC, spec: ModelSpec, chunk: int):
    """log p(targets[b, c] | ids[b, :positions[b, c] + 1]) and the argmax token at each scored position,
    [B, C] each; the logits of `chunk` positions per row are alive at a time."""
    params = weights_for_compute(params, spec, FP32)
    hidden_BLD, _ = hidden_states(params, ids_BL, spec, FP32)
    B, C = positions_BC.shape

    def score(block):
        pos_Bc, tgt_Bc = block
        logits_BcV = unembed(params, jnp.take_along_axis(hidden_BLD, pos_Bc[..., None], axis=1), spec)
        picked = jnp.take_along_axis(logits_BcV, tgt_Bc[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits_BcV, axis=-1), jnp.argmax(logits_BcV, axis=-1).astype(jnp.int32)

    blocks = (positions_BC.reshape(B, C // chunk, chunk).swapaxes(0, 1),
              targets_BC.reshape(B, C // chunk, chunk).swapaxes(0, 1))
    logp, top = jax.lax.map(score, blocks)
    return logp.swapaxes(0, 1).reshape(B, C), top.swapaxes(0, 1).reshape(B, C)


class _Row:
    """One row of a batch: input ids, the positions to score and the token expected after each."""

    __slots__ = ("ids", "positions", "targets")

    def __init__(self, ids: Sequence[int], positions: Sequence[int], targets: Sequence[int]):
        self.ids, self.positions, self.targets = ids, positions, targets


class JaxLM(TemplateLM):
    """An lm-eval model backed by a checkpoint run through the JAX model (see the module docstring)."""

    backend = "causal"

    def __init__(self, path: str | Path, *, batch_size: int = 8, progress: bool = False, name: str | None = None):
        super().__init__()
        from upcycler.io import read_checkpoint

        self.path, self.name = Path(path), name or shown_path(path)
        self._checkpoint = read_checkpoint(self.path)  # the spec now, the weights at the first request
        self.spec: ModelSpec = self._checkpoint.spec
        self.hf_tokenizer = HFTokenizer(self.path)
        self.stop_ids = _generation_eos(self.path, self.spec) | {self.hf_tokenizer.eos_id}
        self.batch_size = batch_size
        self.progress = progress

    @cached_property
    def params(self) -> Any:
        """The weights in float32, read at the first request (after the tasks are loaded)."""
        from upcycler.train.model.params import from_tensors

        return from_tensors(self.spec, self._checkpoint.tensors, dtype=np.float32)

    # what the harness asks of a TemplateLM

    @property
    def eot_token_id(self) -> int:
        return self.hf_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.hf_tokenizer.bos_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.spec.max_position_embeddings

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return str(self.path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        if add_special_tokens is None:  # HFLM: no special tokens for a text that starts with the prefix token
            prefix = self.hf_tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = not has_bos_prefix(string, prefix)
        ids = self.hf_tokenizer.encode(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(tokens), skip_special_tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise UpcyclerError(f"{self.name}: a request of {len(context)} context and {len(continuation)} "
                                    f"continuation tokens cannot be scored (the continuation must have 1 to "
                                    f"{self.max_length} tokens, the context at least 1); check the task's texts")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            inputs, n = whole[:-1], len(continuation)
            rows.append(_Row(inputs, range(len(inputs) - n, len(inputs)), continuation))
        out = []
        for logp, top, row in zip(*self._score(rows, "loglikelihood", disable_tqdm), rows, strict=True):
            out.append((float(np.sum(logp, dtype=np.float64)), bool(np.array_equal(top, row.targets))))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(harness_utils.make_disjoint_window, harness_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[i] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise UpcyclerError(f"{self.name}: a task asks for sampled generation ({describe(gen_kwargs)}); "
                                    "upcycle eval decodes greedily, run tasks with do_sample false")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            budget = int(kwargs.pop("max_gen_toks"))
            if not 0 < budget < self.max_length:
                raise UpcyclerError(f"{self.name}: a task asks for {budget} new tokens, which must be between 1 "
                                    f"and the model's {self.max_length} positions; lower max_gen_toks")
            # HFLM's batch encoding: no special tokens for a text that starts with the BOS text
            special = not has_bos_prefix(context, self.hf_tokenizer.bos_text)
            ids = self.hf_tokenizer.encode(context, special)[-(self.max_length - budget):]
            if not ids:
                raise UpcyclerError(f"{self.name}: a task asks to generate after an empty context, and the "
                                    "tokenizer adds no BOS to start from; give the task's documents a prompt")
            jobs.append((ids, budget, until))
        return self._generate(jobs, disable_tqdm)

    # running the model

    def _check_ids(self, rows: list[_Row]) -> None:
        top = max(max(*r.ids, *r.targets, 0) for r in rows)
        if top >= self.spec.vocab_size:
            raise UpcyclerError(f"{self.name}: the tokenizer gives token id {top:,}, beyond the model's "
                                f"vocabulary ({self.spec.vocab_size:,} tokens); use the model's own tokenizer")

    def _run_batch(self, rows: list[_Row]) -> tuple[np.ndarray, np.ndarray]:
        """Scores of one batch: `batch_size` rows padded to a power-of-two length (at most `max_length`) and
        power-of-two scored positions, so a task compiles once per length bucket."""
        self._check_ids(rows)
        length = min(_bucket(max(len(r.ids) for r in rows), MIN_LENGTH), self.max_length)
        scored = _bucket(max(len(r.positions) for r in rows), MIN_SCORED)
        count = max(self.batch_size, len(rows))  # one row count: a short last batch compiles nothing new
        ids = np.zeros((count, length), np.int32)
        positions, targets = np.zeros((count, scored), np.int32), np.zeros((count, scored), np.int32)
        for b, row in enumerate(rows):
            ids[b, :len(row.ids)] = row.ids
            positions[b, :len(row.positions)] = row.positions
            targets[b, :len(row.targets)] = row.targets
        with jax.default_matmul_precision("highest"):
            logp, top = _scores_jit(self.params, ids, positions, targets, self.spec, min(scored, SCORE_CHUNK))
        return np.asarray(logp), np.asarray(top)

    def _score(self, rows: list[_Row], what: str, disable_tqdm: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per row, the log-probabilities of its targets and the argmax tokens at its scored positions; rows
        run longest first, `batch_size` at a time (padded to `batch_size` rows)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].ids))
        logps: list[np.ndarray] = [np.zeros(0)] * len(rows)
        tops: list[np.ndarray] = [np.zeros(0, np.int32)] * len(rows)
        with self._bar(len(rows), what, disable_tqdm) as bar:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                logp, top = self._run_batch([rows[i] for i in chunk])
                for b, i in enumerate(chunk):
                    n = len(rows[i].positions)
                    logps[i], tops[i] = logp[b, :n], top[b, :n]
                bar.update(len(chunk))
        return logps, tops

    def _generate(self, jobs: list[tuple[list[int], int, list[str]]], disable_tqdm: bool) -> list[str]:
        """Greedy continuations of every (context ids, token budget, stop sequences), longest first,
        `batch_size` at a time in one buffer of context + budget tokens."""
        order = sorted(range(len(jobs)), key=lambda i: -(len(jobs[i][0]) + jobs[i][1]))
        out = [""] * len(jobs)
        with self._bar(len(jobs), "generate_until", disable_tqdm) as bar:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                for i, text in zip(chunk, self._generate_batch([jobs[i] for i in chunk]), strict=True):
                    out[i] = text
                bar.update(len(chunk))
        return out

    def _generate_batch(self, jobs: list[tuple[list[int], int, list[str]]]) -> list[str]:
        """One batch of greedy continuations: every step runs all rows (one compiled shape) and appends the
        argmax to the rows not yet stopped by an EOS id, their budget or a stop sequence in their text."""
        seqs = [list(ids) for ids, _, _ in jobs]
        new: list[list[int]] = [[] for _ in jobs]
        done = [False] * len(jobs)
        for _ in range(max(budget for _, budget, _ in jobs)):
            live = [b for b in range(len(jobs)) if not done[b]]
            if not live:
                break
            rows = [_Row(seqs[b], [len(seqs[b]) - 1], [0]) for b in range(len(jobs))]
            _, top = self._run_batch(rows)
            for b in live:
                token = int(top[b, 0])
                seqs[b].append(token)
                new[b].append(token)
                text = self.tok_decode(new[b], skip_special_tokens=False)
                done[b] = (token in self.stop_ids or len(new[b]) >= jobs[b][1]
                           or any(s and s in text for s in jobs[b][2]))
        # decoded without special tokens (an EOS among them), then cut at the first stop sequence
        return [postprocess_generated_text(self.tok_decode(tokens), until, None)
                for tokens, (_, _, until) in zip(new, jobs, strict=True)]

    def _bar(self, total: int, what: str, disable_tqdm: bool) -> tqdm:
        return tqdm(total=total, desc=f"{self.path.name or self.name}: {what}", unit="request", file=sys.stderr,
                    disable=disable_tqdm or not self.progress, leave=False)


# --- tasks -------------------------------------------------------------------------------------------------


def task_manager(names: list[str], include: Path | None) -> Any:
    """A harness TaskManager that knows every task in `names`: the --include directory's alone when it
    holds them all (indexing the harness's thousands of built-in tasks takes tens of seconds), else the
    built-in tasks too, with the directory's first."""
    from lm_eval.tasks import TaskManager

    if include is not None:
        local = TaskManager(include_path=str(include), include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
        _refuse_unparsed_yaml(include, [name for name in names if name not in local.all_tasks])
    manager = TaskManager(include_path=None if include is None else str(include))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = "the harness's tasks" + ("" if include is None else f" or {shown_path(include)}")
        raise UpcyclerError(f"--task lm-eval:{describe(unknown[0])}: no such task in {where}; pass a task name "
                            "that `lm_eval ls tasks` lists, or --include the directory of its YAML")
    return manager


def _refuse_unparsed_yaml(include: Path, missing: list[str]) -> None:
    """A task missing from `include` because its YAML there does not parse (the harness skips such a file
    in silence): name the file and where it fails. A file is taken for a missing task's when its name or
    its text names the task."""
    import yaml

    class Lenient(yaml.SafeLoader):  # the harness's own tags (`!function`) are not what fails here
        pass

    Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)
    for path in sorted(include.rglob("*.y*ml")):
        try:
            text = path.read_text(errors="replace")
            yaml.load(text, Lenient)
        except yaml.YAMLError as err:
            task = next((name for name in missing if name == path.stem or name in text), None)
            if task is not None:
                where = getattr(err, "problem_mark", None)
                at = f" at line {where.line + 1}" if where is not None else ""
                raise UpcyclerError(f"--task lm-eval:{describe(task)}: {shown_path(path)} does not parse as YAML"
                                    f"{at} ({escape(str(getattr(err, 'problem', None) or err))[:120]}), so the "
                                    "harness skips it; fix the file") from None
        except OSError:
            continue


def load_tasks(manager: Any, names: list[str]) -> dict[str, Any]:
    """The harness's task dictionary for `names` (reads their datasets)."""
    try:
        return manager.load(names)
    except Exception as err:  # noqa: BLE001 - a task's YAML and dataset loader may raise anything
        raise UpcyclerError(f"--task lm-eval:{','.join(names)}: the harness cannot load it "
                            f"({type(err).__name__}: {escape(str(err))[:200]}); check the task's YAML and that "
                            "its dataset is reachable or cached (HF_DATASETS_OFFLINE=1 reads the cache only)") from None


def evaluate_tasks(lm: JaxLM, loaded: dict[str, Any], *, num_fewshot: int | None, limit: float | None,
                   log_samples: bool) -> dict[str, Any]:
    """Run the loaded tasks on `lm` as `lm_eval.simple_evaluate` does (its seeds, its few-shot rule: a task
    whose YAML sets num_fewshot 0 keeps it) and return the harness's results."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    for task in loaded["tasks"].values():
        configured = task.get_config("num_fewshot")
        if num_fewshot is not None and configured != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif configured is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    return evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=log_samples, fewshot_as_multiturn=True)


def quiet_harness(progress: bool) -> None:
    """Keep the harness's informational logging off stderr (its warnings stay), and without `progress` (not
    a terminal) its progress bars too: the datasets' and the one it draws while building requests."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if progress:
        return
    import datasets
    import lm_eval.api.task

    datasets.disable_progress_bars()
    lm_eval.api.task.tqdm = partial(tqdm, disable=True)


# --- the result --------------------------------------------------------------------------------------------


def summarize(results: dict[str, Any], header: dict[str, Any]) -> dict[str, Any]:
    """`header` + per task (and group, with its subtasks) of the harness's results: its documents, few-shot
    count, version and every metric with its stderr (named as the harness names them, less the default
    filter's `,none`; null where the harness has no number)."""
    tasks = {}
    for name, entry in results["results"].items():
        metrics = {}
        for key, value in entry.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, _, flt = key.partition(",")
            shown = metric if flt == "none" else key
            metrics[shown] = {"value": _number(value), "stderr": _number(entry.get(f"{metric}_stderr,{flt}"))}
        tasks[name] = {"alias": entry.get("alias", name),
                       "samples": results.get("n-samples", {}).get(name, {}).get("effective"),
                       "num_fewshot": results.get("n-shot", {}).get(name),
                       "version": results.get("versions", {}).get(name), "metrics": metrics}
        if results.get("group_subtasks", {}).get(name):
            tasks[name]["subtasks"] = list(results["group_subtasks"][name])
    return {**header, "tasks": tasks}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float, np.floating, np.integer)) else None


def format_table(result: dict[str, Any]) -> str:
    """A short table per task (and group): metric, value, stderr."""
    lines = [f"lm-eval tasks on {result['model_path']} (float32 JAX model, lm-eval {result['lm_eval_version']})"]
    for entry in result["tasks"].values():
        if "subtasks" in entry:
            what = f"group of {len(entry['subtasks'])} tasks"
        else:
            what = f"{_shown(entry['samples'])} documents, {_shown(entry['num_fewshot'])}-shot"
        lines += ["", f"{entry['alias'].strip()}  ({what})", f"  {'metric':<24} {'value':>12} {'stderr':>10}"]
        for metric, m in entry["metrics"].items():
            lines.append(f"  {metric:<24} {_shown(m['value']):>12} {_shown(m['stderr']):>10}")
    return "\n".join(lines)


def _shown(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


def sample_lines(results: dict[str, Any]) -> Iterable[str]:
    """The harness's per-document records, one JSON line each: task, doc_id, target, the filtered responses
    (log-likelihood and greedy flag per choice, or the generated text) and the document's metrics."""
    for task, records in results.get("samples", {}).items():
        for record in records:
            line = {"task": task, "doc_id": record.get("doc_id"), "target": record.get("target"),
                    "resps": record.get("filtered_resps"), "filter": record.get("filter"),
                    **{m: record.get(m) for m in record.get("metrics", ())}}
            yield json.dumps(line, ensure_ascii=False, default=_plain)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)

