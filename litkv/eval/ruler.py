"""Offline RULER synthetic tasks (Hsieh et al. 2024, github.com/NVIDIA/RULER), generated locally with a seed.

Tasks (RULER's names): ``niah_single_1/2/3``, ``niah_multikey_1``, ``niah_multivalue``,
``niah_multiquery``, ``vt`` (variable tracking), ``cwe`` (common-word extraction) and ``fwe``
(frequent-word extraction). Every sample is a prompt of at most ``length - max_new_tokens`` tokens
(the haystack is grown by binary search with the tokenizer until it no longer fits) and the list of
reference strings the greedy answer must contain. Haystacks need no download: the repeated noise
sentence (RULER's ``noise``), random words from a local word list (in place of RULER's Paul Graham
``essay``), and the needles' values are RULER's ``numbers`` or ``uuids``.

Scoring follows RULER's ``scripts/eval/synthetic/constants.py``: every synthetic task uses
``string_match_all`` (per sample, the share of references found in the prediction, case-insensitive);
``string_match_part`` (1 if any reference is found) is provided for the QA-style metric.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from litkv.core.tokens import encode_plain
from litkv.eval.recall import RecallFormat

__all__ = [
    "NOISE",
    "FALLBACK_WORDS",
    "NiahFormat",
    "TASKS",
    "split_answer_prefix",
    "RulerSample",
    "RulerTask",
    "generate_samples",
    "question_start",
    "resolve_tasks",
    "string_match_all",
    "string_match_part",
    "word_list",
]

#: A prompt's (context, question) texts -> the token ids the model is fed for each (tokenized apart, as
#: kvpress's pipeline tokenizes its context and question; the sample's ids are their concatenation).
Encode = Callable[[str, str], tuple[list[int], list[int]]]

# RULER's noise haystack sentence.

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_PROMPT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {value} in the text above. Answer: According to "
    "the chain(s) of variable assignment in the text above, {n} variables are assigned the value {value}, they are:"
)
CWE_PROMPT = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the {n} most common words in the above list? "
    "Answer: The top {n} words that appear most often in the list are:"
)
FWE_PROMPT = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words.\n{context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text? Answer: According to the coded "
    "text above, the three most frequently appeared words are:"
)


@dataclass(frozen=True)
class NiahFormat:
    """Needle and question wording of the niah tasks. The default is RULER's English template; a checkpoint with
    a pass-key recall format gets its own wording (`from_recall`), which a small model was trained to answer.

    ``needle`` has ``{key}`` and ``{value}``; the questions have ``{key}`` (the queried keys, comma-joined);
    ``single_needle``/``single_question`` (``{value}``; no key) serve the one-needle tasks when set.
    """

    needle: str = "\nOne of the special magic numbers for {key} is: {value}.\n"
    question_one: str = (
        "\nWhat is the special magic number for {key} mentioned in the provided text? "
        "The special magic number for {key} mentioned in the provided text is"
    )
    question_all: str = (
        "\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
        "The special magic numbers for {key} mentioned in the provided text are"
    )
    single_needle: str | None = None
    single_question: str | None = None
    num_digits: int = 7
    distinct_digits: bool = False

    def __post_init__(self) -> None:
        fields = {"needle": ("{key}", "{value}"), "question_one": ("{key}",), "question_all": ("{key}",)}
        fields.update({"single_needle": ("{value}",)} if self.single_needle is not None else {})
        for name, placeholders in fields.items():
            missing = [p for p in placeholders if p not in getattr(self, name)]
            if missing:
                raise ValueError(f"NiahFormat.{name} must contain {missing}, got {getattr(self, name)!r}")
        if (self.single_needle is None) != (self.single_question is None):
            raise ValueError("NiahFormat: single_needle and single_question must be set together or not at all")
        if not isinstance(self.num_digits, int) or not 1 <= self.num_digits <= (10 if self.distinct_digits else 18):
            raise ValueError(f"NiahFormat.num_digits must be an int in [1, 10 or 18], got {self.num_digits!r}")

    @classmethod
    def from_recall(cls, fmt: RecallFormat) -> NiahFormat:
        """The checkpoint's pass-key wording: its multi-key needle and question, its single pass-key needle."""
        needle = fmt.multikey_needle.replace("{key}", "{value}").replace("{word}", "{key}")
        question_one = fmt.multikey_question.replace("{word}", "{key}")
        plural = question_one.replace("What is the pass key", "What are all the pass keys").replace(
            "The pass key of {key} is", "The pass keys of {key} are"
        )
        return cls(
            needle=needle,
            question_one=question_one,
            question_all=plural,
            single_needle=fmt.needle.replace("{key}", "{value}"),
            single_question=fmt.question,
            num_digits=fmt.num_digits,
            distinct_digits=fmt.distinct_digits,
        )


@dataclass(frozen=True)
class RulerTask:
    """One task: its kind (``niah``, ``vt``, ``cwe``, ``fwe``), RULER's parameters and tokens to generate."""

    name: str
    kind: str
    max_new_tokens: int
    haystack: str = "words"  # niah: "noise" or "words"
    value_type: str = "numbers"  # niah: "numbers" or "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    metric: str = "string_match_all"

    def __post_init__(self) -> None:
        checks = {
            "kind": (self.kind, ("niah", "vt", "cwe", "fwe")),
            "haystack": (self.haystack, ("noise", "words")),
            "value_type": (self.value_type, ("numbers", "uuids")),
            "metric": (self.metric, ("string_match_all", "string_match_part")),
        }
        for field_name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"RulerTask {self.name!r}: {field_name} must be one of {allowed}, got {value!r}")
        for field_name in ("max_new_tokens", "num_keys", "num_values", "num_queries"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RulerTask {self.name!r}: {field_name} must be an int >= 1, got {value!r}")
        if self.num_queries > self.num_keys:
            raise ValueError(f"RulerTask {self.name!r}: num_queries {self.num_queries} > num_keys {self.num_keys}")


TASKS: dict[str, RulerTask] = {
    t.name: t
    for t in (
        RulerTask("niah_single_1", "niah", 16, haystack="noise"),
        RulerTask("niah_single_2", "niah", 16),
        RulerTask("niah_single_3", "niah", 32, value_type="uuids"),
        RulerTask("niah_multikey_1", "niah", 16, num_keys=4),
        RulerTask("niah_multivalue", "niah", 40, num_values=4),
        RulerTask("niah_multiquery", "niah", 40, num_keys=4, num_queries=4),
        RulerTask("vt", "vt", 30),
        RulerTask("cwe", "cwe", 60),
        RulerTask("fwe", "fwe", 30),
    )
}
ALL_TASKS = "ruler"
# The word list of a text too short to give one (`word_list`).
FALLBACK_WORDS = (
    "anchor", "basket", "candle", "desert", "engine", "forest", "garden", "hammer", "island", "jacket",
    "kettle", "ladder", "marble", "needle", "oyster", "pepper", "quartz", "ribbon", "saddle", "tunnel",
    "umpire", "valley", "walnut", "yellow", "zipper", "bridge", "castle", "dragon", "feather", "glacier",
    "harvest", "insect", "jungle", "kingdom", "lemon", "mirror", "napkin", "orange", "pillow", "rabbit",
    "silver", "thunder", "velvet", "window", "blanket", "compass", "dolphin", "emerald", "fountain", "gravel",
    "helmet", "ivory", "journal", "lantern", "meadow", "nutmeg", "orchard", "parrot", "quiver", "rocket",
    "spider", "tomato", "violin", "wizard",
)  # fmt: skip


def resolve_tasks(tasks: str | Sequence[str]) -> list[str]:
    """``"ruler"``: every task; otherwise a comma-separated string or a list of task names (checked)."""
    names = tasks.split(",") if isinstance(tasks, str) else [n for t in tasks for n in str(t).split(",")]
    names = [n.strip() for n in names if n.strip()]
    if names == [ALL_TASKS]:
        return list(TASKS)
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ValueError(
            f"unknown RULER task(s) {unknown or names}: expected {ALL_TASKS!r} or names among {list(TASKS)}"
        )
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class RulerSample:
    """A prompt (token ids and text) and the references its answer must contain.

    The prompt is a context and a question, as kvpress splits RULER's prompts: `ids[:context_length]` is
    the (templated) prompt up to the end of the haystack, `ids[context_length:]` the question, the rest of
    the chat template and the answer's start. A one-shot evaluation compresses the context only and feeds
    the question after it (`litkv.eval.oneshot`).
    """

    task: str
    prompt: str
    ids: list[int]
    references: list[str]
    max_new_tokens: int
    context_length: int

    def __post_init__(self) -> None:
        n = len(self.ids)
        if isinstance(self.context_length, bool) or not isinstance(self.context_length, int):
            raise TypeError(f"RulerSample.context_length must be an int, got {self.context_length!r}")
        if not 1 <= self.context_length < n:
            raise ValueError(
                f"RulerSample.context_length must be in [1, {n - 1}] (a context and a question of {n} ids), "
                f"got {self.context_length}"
            )


def word_list(text: str, min_len: int = 3, max_len: int = 10, skip_frequent: int = 200) -> list[str]:
    """Distinct lowercase alphabetic words of `text` (sorted), the local stand-in for RULER's wonderwords.

    The `skip_frequent` most frequent words are left out, so that a model babbling text like `text`
    ("the", "and", "lord") does not name a reference by chance. A text with fewer than
    `len(FALLBACK_WORDS)` such words gives `FALLBACK_WORDS`.
    """
    counts = Counter(w.lower() for w in re.findall(r"[A-Za-z]+", text))
    frequent = {w for w, _ in counts.most_common(skip_frequent)}
    words = sorted(w for w in counts if min_len <= len(w) <= max_len and w not in frequent)
    return words if len(words) >= len(FALLBACK_WORDS) else list(FALLBACK_WORDS)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_all, in [0, 1]: mean over samples of the share of references in the prediction."""
    _check_pairs(predictions, references)
    scores = [
        sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references, strict=True)
    ]
    return sum(scores) / len(scores)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_part, in [0, 1]: mean over samples of 1 if any reference is in the prediction."""
    _check_pairs(predictions, references)
    scores = [max(r.lower() in p.lower() for r in refs) for p, refs in zip(predictions, references, strict=True)]
    return sum(scores) / len(scores)


METRICS: dict[str, Callable[[Sequence[str], Sequence[Sequence[str]]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def _check_pairs(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"need as many predictions as reference lists (>= 1), got {len(predictions)} and {len(references)}"
        )
    if any(not refs for refs in references):
        raise ValueError("every sample needs at least one reference string")


def _number(rng: random.Random, digits: int = 5, distinct: bool = False) -> str:
    if distinct:
        first = rng.choice("123456789")
        return first + "".join(rng.sample([d for d in "0123456789" if d != first], digits - 1))
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _uuid(rng: random.Random) -> str:
    h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def split_answer_prefix(prompt: str) -> tuple[str, str]:
    """`(question, answer_prefix)` of a RULER prompt: the prompt ends with the start of its answer (RULER's
    `answer_prefix`, e.g. "The special magic number for X mentioned in the provided text is"), which a chat
    model is given as the start of its reply, after the template's generation prompt, not inside the user
    message. Split after the last "Answer: " (vt, cwe, fwe) or the last "? " (niah); no split: `(prompt, "")`."""
    for marker in ("Answer: ", "? "):
        at = prompt.rfind(marker)
        if at >= 0:
            return prompt[: at + len(marker)].rstrip(), prompt[at + len(marker) :]
    return prompt, ""


def question_start(prompt: str) -> int:
    """Where the question of a RULER prompt begins (kvpress's split of RULER's prompts): at the last
    "Question:" (vt, cwe, fwe); a niah prompt's question is the text after its haystack, which the
    builder knows (`_niah_builder`)."""
    at = prompt.rfind("Question:")
    if at < 0:
        raise ValueError(f"no 'Question:' in the RULER prompt ending {prompt[-80:]!r}")
    return at


@dataclass(frozen=True)
class _Fitted:
    text: str
    ids: list[int]
    context_length: int


def _fit(build: Callable[[int], tuple[str, int]], encode: Encode, budget: int, hi: int) -> _Fitted:
    """The prompt `build(n)` (text, where its question starts) with the largest `n` in [0, hi] whose
    tokens fit in `budget` (binary search)."""
    lo, best = 0, None
    while lo <= hi:
        mid = (lo + hi) // 2
        text, split = build(mid)
        context, question = encode(text[:split], text[split:])
        if len(context) + len(question) <= budget:
            best, lo = _Fitted(text, context + question, len(context)), mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise ValueError(f"even an empty haystack does not fit in {budget} prompt tokens: use a longer length")
    return best


def _niah_builder(
    task: RulerTask, words: Sequence[str], rng: random.Random, fmt: NiahFormat
) -> tuple[Callable[[int], tuple[str, int]], list[str]]:
    keys = rng.sample(list(words), task.num_keys)
    if task.value_type == "numbers":
        values = [[_number(rng, fmt.num_digits, fmt.distinct_digits) for _ in range(task.num_values)] for _ in keys]
    else:
        values = [[_uuid(rng) for _ in range(task.num_values)] for _ in keys]
    single = task.num_keys == task.num_values == 1 and fmt.single_needle is not None
    needle = fmt.single_needle if single and fmt.single_needle else fmt.needle
    needles = [needle.format(key=k, value=v) for k, vs in zip(keys, values, strict=True) for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.random() for _ in needles)
    queried = rng.sample(range(task.num_keys), task.num_queries)
    query_keys = [keys[i] for i in queried]
    one = task.num_values == 1 and task.num_queries == 1
    template = fmt.single_question if single and fmt.single_question else fmt.question_one if one else fmt.question_all
    question = template.format(key=", ".join(query_keys))
    others = [w for w in words if w not in keys]
    pool = [rng.choice(others) for _ in range(4096)] if task.haystack == "words" else []

    lead = len(question) - len(question.lstrip())  # whitespace before the question ends the context

    def build(n: int) -> tuple[str, int]:
        units = [NOISE] * n if task.haystack == "noise" else [pool[i % len(pool)] for i in range(n)]
        parts, last = [], 0
        for depth, needle in zip(depths, needles, strict=True):
            cut = round(depth * n)
            parts += [" ".join(units[last:cut]), needle]
            last = cut
        parts.append(" ".join(units[last:]))
        context = "".join(parts)
        return context + question, len(context) + lead

    return build, [v for i in queried for v in values[i]]


def _vt_builder(
    words: Sequence[str], rng: random.Random, hops: int = 4
) -> tuple[Callable[[int], tuple[str, int]], list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        names += [] if name in names else [name]
    value = _number(rng)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    depths = sorted(rng.random() for _ in chain)

    def build(n: int) -> tuple[str, int]:
        units: list[str] = []
        last = 0
        for depth, line in zip(depths, chain, strict=True):
            cut = round(depth * n)
            units += [NOISE] * (cut - last) + [line]
            last = cut
        units += [NOISE] * (n - last)
        text = VT_PROMPT.format(context=" ".join(units), value=value, n=len(names))
        return text, question_start(text)

    return build, names


def _cwe_builder(
    words: Sequence[str], rng: random.Random, num_cw: int = 10, freq_cw: int = 10, freq_ucw: int = 3
) -> tuple[Callable[[int], tuple[str, int]], list[str]]:
    chosen = rng.sample(list(words), min(len(words), num_cw + 400))
    common, uncommon = chosen[:num_cw], chosen[num_cw:]

    def build(n: int) -> tuple[str, int]:
        items = common * freq_cw + uncommon[:n] * freq_ucw
        random.Random(len(items)).shuffle(items)
        context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        text = CWE_PROMPT.format(context=context, n=num_cw)
        return text, question_start(text)

    return build, common


def _fwe_builder(
    rng: random.Random, alpha: float = 2.0, vocab: int = 600
) -> tuple[Callable[[int], tuple[str, int]], list[str]]:
    coded = list(dict.fromkeys("".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(vocab)))
    weights = [1.0 / (rank + 1) ** alpha for rank in range(len(coded))]  # Zipf over the coded words
    stream = rng.choices(coded, weights=weights, k=4000)

    def build(n: int) -> tuple[str, int]:
        text = FWE_PROMPT.format(context=" ".join(stream[:n]))
        return text, question_start(text)

    return build, []


def _sample(
    task: RulerTask, encode: Encode, words: Sequence[str], length: int, rng: random.Random, fmt: NiahFormat
) -> RulerSample:
    budget = length - task.max_new_tokens
    if task.kind == "niah":
        build, refs = _niah_builder(task, words, rng, fmt)
        fitted = _fit(build, encode, budget, hi=4096 if task.haystack == "words" else 400)
    elif task.kind == "vt":
        build, refs = _vt_builder(words, rng)
        fitted = _fit(build, encode, budget, hi=400)
    elif task.kind == "cwe":
        fitted, refs = _fit_cwe(encode, words, budget, rng)
    else:
        build, _ = _fwe_builder(rng)
        fitted = _fit(build, encode, budget, hi=4000)
        refs = _fwe_top(fitted.text)
    return RulerSample(task.name, fitted.text, fitted.ids, refs, task.max_new_tokens, fitted.context_length)


def _fit_cwe(encode: Encode, words: Sequence[str], budget: int, rng: random.Random) -> tuple[_Fitted, list[str]]:
    """RULER's cwe frequencies (common words 10x here, 30x in RULER at 4K+ tokens; others 3x), lowered to
    6x/2x then 3x/1x when even the common words alone do not fit in `budget` tokens."""
    seed = rng.random()
    for freq_cw, freq_ucw in ((10, 3), (6, 2), (3, 1)):
        build, refs = _cwe_builder(words, random.Random(seed), freq_cw=freq_cw, freq_ucw=freq_ucw)
        try:
            fitted = _fit(build, encode, budget, hi=400)
        except ValueError:
            continue
        return fitted, refs
    raise ValueError(f"even the cwe common words (3 times each) do not fit in {budget} prompt tokens")


def _fwe_top(prompt: str) -> list[str]:
    """The three most frequent coded words of an fwe prompt's context (what is really in the prompt)."""
    context = prompt[prompt.index("\n") + 1 : prompt.index("\nQuestion:")]
    return [w for w, _ in Counter(context.split()).most_common(3)]


def _plain(tokenizer: Any, context: str, question: str) -> tuple[list[int], list[int]]:
    return encode_plain(tokenizer, context), encode_plain(tokenizer, question)


def generate_samples(
    tasks: Sequence[str],
    tokenizer: Any,
    words: Sequence[str],
    length: int,
    num_samples: int,
    seed: int = 0,
    niah_format: NiahFormat | None = None,
    encode: Encode | None = None,
) -> dict[str, list[RulerSample]]:
    """`num_samples` samples per task, each at most `length` tokens with its answer; deterministic in `seed`.

    `words`: the local word list (`word_list`) for keys and word haystacks; `niah_format`: the needle wording
    (default: RULER's English template); `encode`: a prompt's context and question texts -> the token ids
    the model is fed for each (default: each text alone, `encode_plain`; an instruct model's chat template:
    `chat_encoder`). A sample's ids are the context's then the question's (`RulerSample.context_length`).
    """
    fmt = NiahFormat() if niah_format is None else niah_format
    if isinstance(length, bool) or not isinstance(length, int) or length < 64:
        raise ValueError(f"length must be an int >= 64 tokens, got {length!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if len(words) < 20:
        raise ValueError(f"the word list needs at least 20 words (keys and haystack), got {len(words)}")
    enc: Encode = encode or (lambda context, question: _plain(tokenizer, context, question))
    out: dict[str, list[RulerSample]] = {}
    for index, name in enumerate(resolve_tasks(list(tasks))):
        rng = random.Random(f"{seed}/{index}/{name}")
        out[name] = [_sample(TASKS[name], enc, words, length, rng, fmt) for _ in range(num_samples)]
    return out
