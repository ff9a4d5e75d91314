"""Offline long-context task suite in the spirit of RULER (Hsieh et al., 2024), own code.

Seven synthetic tasks, generated deterministically from a seed and sized in tokens of a
given tokenizer, with no network at run time (the haystack text is the Paul Graham essay
corpus of :mod:`sfi_vllm.tools.texts`):

=====================  ===========  ==========================================================
task                   kind         what the prompt holds / asks
=====================  ===========  ==========================================================
``niah_single``        retrieval    one needle "One of the special magic numbers for {key} is:
                                    {7 digits}." at a depth from 0% to 100%; asks for it
``niah_multikey``      retrieval    4 needles with different keys; asks for one key's number
``niah_multivalue``    retrieval    4 needles with the same key; asks for all 4 numbers
``passkey``            retrieval    "The pass key is {5 digits}. Remember it. ..." inside the
                                    repeated RULER filler ("The grass is green. ...")
``variable_tracking``  retrieval    a chain "VAR ABCDE = 12345." "VAR FGHIJ = ABCDE." ... (4
                                    variables) + 1-2 distractor chains; asks for every
                                    variable that holds the value
``common_words``       aggregation  a numbered word list: 10 words many times (up to 30x),
                                    the others 3x; asks for the 10 most common
``frequent_words``     aggregation  RULER's frequent-words extraction: a stream of coded
                                    words with Zipf(2) counts, the top one being the noise
                                    "...."; asks for the 3 most frequent coded words
=====================  ===========  ==========================================================

Sizing: a sample for ``context_tokens`` = C has a prompt (the user message, counted with the
tokenizer and no special tokens) of at most :func:`prompt_budget` (C) = C - max(128, 3.5% C)
tokens and at least ~1.5% less (e.g. 7905 for 8192, 3952 for 4096, 1920 for 2048), so a chat
template (~30 tokens for SmolLM2) plus ``max_new_tokens`` still fit in a model with a C-token
context.  Fitting measures the full prompt a few times (one ~8K-token encode is ~60 ms on a
fast tokenizer) and reuses memoized per-sentence token counts.

Scoring (:func:`score`) is RULER's ``string_match_all``: the fraction of ``sample.answers``
that occur in the output, case-insensitively.
"""

from __future__ import annotations

import random
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from sfi_vllm.tools.texts import _token_counter

__all__ = [
    "Sample",
    "TASKS",
    "TASK_KIND",
    "MAX_NEW_TOKENS",
    "MIN_CONTEXT_TOKENS",
    "prompt_budget",
    "count_tokens",
    "make_samples",
    "make_suite",
    "score",
]


@dataclass(frozen=True)
class Sample:
    task: str            # one of TASKS
    context_tokens: int  # the target size (e.g. 2048, 4096, 8192)
    index: int           # sample number within (task, context)
    prompt: str          # the full user message (haystack + question), one chat user turn
    answers: tuple[str, ...]  # every string the answer must contain
    max_new_tokens: int  # how many tokens a correct answer needs
    kind: str            # "retrieval" or "aggregation"


TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "passkey", "variable_tracking",
         "common_words", "frequent_words")

TASK_KIND = {
    "niah_single": "retrieval",
    "niah_multikey": "retrieval",
    "niah_multivalue": "retrieval",
    "passkey": "retrieval",
    "variable_tracking": "retrieval",  # RULER calls it multi-hop tracing
    "common_words": "aggregation",
    "frequent_words": "aggregation",
}

MAX_NEW_TOKENS = {
    "niah_single": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,
    "passkey": 24,
    "variable_tracking": 48,
    "common_words": 64,
    "frequent_words": 32,
}

MIN_CONTEXT_TOKENS = 512

# RULER's passkey filler (from the original "landmark attention" passkey test).
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NIAH_NUM_NEEDLES = 4       # multikey / multivalue
VT_CHAIN_LEN = 4           # variables per chain (1 assignment of the value + 3 hops)
CWE_NUM_COMMON = 10
CWE_FREQ_COMMON = 30       # max repetitions of a common word (fewer at small contexts)
CWE_FREQ_UNCOMMON = 3
FWE_ALPHA = 2.0
FWE_VOCAB = 2000
FWE_WORD_LEN = 6
FWE_NOISE = "...."

_ADJECTIVES = (
    "amber", "ancient", "bitter", "brave", "breezy", "bright", "calm", "clever", "cosmic", "crimson",
    "curious", "dapper", "dusty", "eager", "electric", "fancy", "fierce", "fluffy", "frozen", "gentle",
    "gigantic", "glossy", "golden", "grumpy", "hollow", "humble", "icy", "jolly", "lazy", "lively",
    "lucky", "misty", "modern", "nervous", "noble", "obsolete", "orange", "polite", "purple", "quiet",
    "rapid", "rustic", "scarlet", "shaggy", "silent", "silver", "sleepy", "smooth", "snowy", "spicy",
    "stormy", "sturdy", "sunny", "tender", "tidy", "velvet", "vivid", "wandering", "witty", "zealous",
)
_NOUNS = (
    "anchor", "badger", "balcony", "banjo", "beacon", "bicycle", "biscuit", "blanket", "canyon", "castle",
    "cactus", "chimney", "compass", "cottage", "crayon", "dolphin", "dragon", "falcon", "feather", "fountain",
    "garden", "giraffe", "glacier", "hammock", "harbor", "helmet", "island", "jacket", "kettle", "ladder",
    "lantern", "lemon", "meadow", "mirror", "monkey", "mushroom", "napkin", "oyster", "paddle", "parrot",
    "pebble", "pepper", "piano", "pillow", "pumpkin", "rabbit", "rocket", "saddle", "sailboat", "scarf",
    "spider", "teapot", "thimble", "tractor", "trumpet", "tunnel", "umbrella", "violin", "walrus", "window",
)


def prompt_budget(context_tokens: int) -> int:
    """Most prompt tokens for a ``context_tokens`` sample: room is left for a chat template
    and the answer (8192 -> 7905, 4096 -> 3952, 2048 -> 1920)."""
    return context_tokens - max(128, round(0.035 * context_tokens))


def _tolerance(target: int) -> int:
    """How far under the budget a fitted prompt may end up (1.5%)."""
    return max(8, int(0.015 * target))


# --------------------------------------------------------------------------- token counting

def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` without special tokens (how prompt sizes are measured here)."""
    return _token_counter(tokenizer)([text])[0]


# --------------------------------------------------------------------------- corpus

_corpus_memo: dict[str, Any] = {}


def _units() -> list[tuple[str, str]]:
    """The essay corpus as (separator, sentence) units; separator '\\n\\n' starts a paragraph."""
    if "units" not in _corpus_memo:
        from ..texts import load_essays, split_sentences

        units: list[tuple[str, str]] = []
        for essay in load_essays():
            for para in re.split(r"\n\s*\n", essay):
                for j, s in enumerate(split_sentences(para)):
                    units.append(("\n\n" if j == 0 else " ", s))
        if not units:
            raise RuntimeError("empty essay corpus")
        _corpus_memo["units"] = units
    return _corpus_memo["units"]


def _vocabulary() -> list[str]:
    """Lowercase words of 5-9 letters seen at least twice in the essays (sorted; ~2700)."""
    if "vocab" not in _corpus_memo:
        from collections import Counter

        from ..texts import load_essays

        c = Counter(w for e in load_essays() for w in re.findall(r"[A-Za-z]+", e))
        _corpus_memo["vocab"] = sorted(w for w, k in c.items() if w.islower() and 5 <= len(w) <= 9 and k >= 2)
    return _corpus_memo["vocab"]


_cost_memo: "weakref.WeakKeyDictionary[Any, dict[int, int]]" = weakref.WeakKeyDictionary()


class _Env:
    """Per-call state: tokenizer, counter, memoized unit costs."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.count = _token_counter(tokenizer)
        try:
            self.costs = _cost_memo.setdefault(tokenizer, {})
        except TypeError:
            self.costs = {}

    def n(self, text: str) -> int:
        return self.count([text])[0]

    def window(self, start: int, min_tokens: int) -> tuple[list[tuple[str, str]], list[int]]:
        """Units from ``start`` on (wrapping around the corpus) and the running token sums,
        until the sum reaches ``min_tokens`` (or the whole corpus is used)."""
        units = _units()
        total = len(units)
        out: list[tuple[str, str]] = []
        prefix = [0]
        i = 0
        chunk = 64
        while prefix[-1] < min_tokens and i < total:
            idx = [(start + j) % total for j in range(i, min(i + chunk, total))]
            missing = [j for j in idx if j not in self.costs]
            if missing:
                for j, c in zip(missing, self.count([units[j][0] + units[j][1] for j in missing])):
                    self.costs[j] = c
            for j in idx:
                out.append(units[j])
                prefix.append(prefix[-1] + self.costs[j])
                i += 1
                if prefix[-1] >= min_tokens:
                    break
            chunk = min(512, chunk * 2)
        return out, prefix


def _fit(measure: Callable[[int], int], mass: Callable[[int], float], fixed: int, k_max: int,
         target: int, tol: int) -> tuple[int, int]:
    """Largest-ish ``k`` in [0, k_max] with ``measure(k) <= target`` and, where the step size
    allows, ``>= target - tol``.  ``measure(k)`` is the exact prompt size with k filler units;
    ``fixed + scale * mass(k)`` estimates it (scale re-fitted after each measurement).
    Returns (k, measure(k)); raises ValueError if even k=0 is too big."""
    scale = 1.0

    def best_k() -> int:
        if fixed + scale * mass(0) > target:
            return 0
        lo, hi = 0, k_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fixed + scale * mass(mid) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    seen: dict[int, int] = {}
    feas: int | None = None
    infeas: int | None = None
    k = best_k()
    for _ in range(16):
        m = seen[k] = measure(k)
        if m <= target:
            feas = k if feas is None else max(feas, k)
            if m >= target - tol or k >= k_max:
                break
        else:
            infeas = k if infeas is None else min(infeas, k)
            if k == 0:
                break
        if feas is not None and infeas is not None and infeas - feas <= 1:
            break
        mk = mass(k)
        if mk > 0 and m > fixed:
            scale = (m - fixed) / mk
        lo_b = feas if feas is not None else -1
        hi_b = infeas if infeas is not None else k_max + 1
        k = min(max(best_k(), lo_b + 1), hi_b - 1)
    if feas is None:
        raise ValueError(f"cannot fit a prompt into {target} tokens (smallest is {min(seen.values())})")
    return feas, seen[feas]


# --------------------------------------------------------------------------- helpers

def _rng(*parts: Any) -> random.Random:
    return random.Random(":".join(str(p) for p in parts))  # str seeds hash with sha512: stable


def _depths(task: str, context_tokens: int, n: int, seed: int) -> list[float]:
    """Needle depths for samples 0..n-1: evenly spaced over [0, 1], in a seeded order."""
    r = _rng("depths", seed, task, context_tokens, n)
    if n == 1:
        return [r.random()]
    d = [i / (n - 1) for i in range(n)]
    r.shuffle(d)
    return d


def _number(r: random.Random, digits: int, avoid: Iterable[str] = ()) -> str:
    avoid = set(avoid)
    while True:
        v = str(r.randint(10 ** (digits - 1), 10 ** digits - 1))
        if v not in avoid:
            return v


def _keys(r: random.Random, n: int) -> list[str]:
    """n keys "adjective-noun" with distinct adjectives and distinct nouns (none a substring
    of another)."""
    return [f"{a}-{b}" for a, b in zip(r.sample(_ADJECTIVES, n), r.sample(_NOUNS, n))]


def _var_names(r: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in out:
            out.append(v)
    return out


def _join(units: Sequence[tuple[str, str]], needles: Sequence[tuple[float, str]]) -> str:
    """Haystack text: units with each needle (depth in [0, 1], sentence) inserted at the unit
    boundary nearest to depth; needles at the same boundary keep their order."""
    k = len(units)
    at: dict[int, list[str]] = {}
    for depth, text in needles:
        at.setdefault(int(round(depth * k)), []).append(text)
    parts: list[str] = []
    for i in range(k + 1):
        for text in at.get(i, ()):
            parts.append((" " if parts else "") + text)
        if i < k:
            sep, s = units[i]
            parts.append((sep if parts else "") + s)
    return "".join(parts)


def _essay_haystack(env: _Env, r: random.Random, target: int, make_prompt: Callable[[str], str],
                    needles: Sequence[tuple[float, str]], secrets: Sequence[str]) -> str | None:
    """Fit essay sentences + needles into ``target`` prompt tokens.  Returns the prompt, or None
    if a secret string (value, key, variable name) also occurs in the chosen text."""
    units = _units()
    start = r.randrange(len(units))
    window, prefix = env.window(start, target + 64)
    fixed = env.n(make_prompt(_join([], needles)))

    def measure(k: int) -> int:
        return env.n(make_prompt(_join(window[:k], needles)))

    k, _ = _fit(measure, lambda k: prefix[k], fixed, len(window), target, _tolerance(target))
    plain = "".join(sep + s for sep, s in window[:k]).lower()
    if any(s.lower() in plain for s in secrets):
        return None
    return make_prompt(_join(window[:k], needles))


def _question(body: str, question: str) -> str:
    return f"{body}\n\nQuestion: {question}\nAnswer:"


# --------------------------------------------------------------------------- task builders
# Each returns (prompt, answers) or None (retry with further draws from the same rng).

_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to "
               "memorize it. I will quiz you about the numbers afterwards.\n\n")


def _niah_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah_single(env: _Env, r: random.Random, target: int, depth: float):
    key = _keys(r, 1)[0]
    value = _number(r, 7)
    q = f"What is the special magic number for {key} mentioned in the provided text? Reply with just the number."
    prompt = _essay_haystack(env, r, target, lambda h: _question(_NIAH_INTRO + h, q),
                             [(depth, _niah_needle(key, value))], [key, value])
    return None if prompt is None else (prompt, (value,))


def _niah_multikey(env: _Env, r: random.Random, target: int, depth: float):
    keys = _keys(r, NIAH_NUM_NEEDLES)
    values: list[str] = []
    for _ in keys:
        values.append(_number(r, 7, values))
    ask = r.randrange(len(keys))
    depths = [depth if i == ask else r.random() for i in range(len(keys))]
    needles = sorted(zip(depths, (_niah_needle(k, v) for k, v in zip(keys, values))), key=lambda x: x[0])
    q = f"What is the special magic number for {keys[ask]} mentioned in the provided text? Reply with just the number."
    prompt = _essay_haystack(env, r, target, lambda h: _question(_NIAH_INTRO + h, q), needles, keys + values)
    return None if prompt is None else (prompt, (values[ask],))


def _niah_multivalue(env: _Env, r: random.Random, target: int, depth: float):
    key = _keys(r, 1)[0]
    values: list[str] = []
    for _ in range(NIAH_NUM_NEEDLES):
        values.append(_number(r, 7, values))
    depths = sorted([depth] + [r.random() for _ in range(NIAH_NUM_NEEDLES - 1)])
    needles = [(d, _niah_needle(key, v)) for d, v in zip(depths, values)]
    q = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
         "Reply with just the numbers, separated by commas.")
    prompt = _essay_haystack(env, r, target, lambda h: _question(_NIAH_INTRO + h, q), needles, [key] + values)
    return None if prompt is None else (prompt, tuple(values))


def _passkey(env: _Env, r: random.Random, target: int, depth: float):
    key = _number(r, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    intro = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
             "I will quiz you about the important information there.\n\n")
    q = "What is the pass key? Reply with just the number."

    def build(k: int) -> str:
        pos = int(round(depth * k))
        parts = [PASSKEY_FILLER] * pos + [needle] + [PASSKEY_FILLER] * (k - pos)
        return _question(intro + " ".join(parts), q)

    per = env.n(" " + PASSKEY_FILLER)
    fixed = env.n(build(0))
    k, _ = _fit(lambda k: env.n(build(k)), lambda k: per * k, fixed, target // max(1, per) + 8,
                target, _tolerance(target))
    return build(k), (key,)


def _variable_tracking(env: _Env, r: random.Random, target: int, depth: float):
    n_chains = 1 + r.randint(1, 2)  # the asked chain + 1-2 distractors
    names = _var_names(r, n_chains * VT_CHAIN_LEN)
    values: list[str] = []
    for _ in range(n_chains):
        values.append(_number(r, 5, values))
    needles: list[tuple[float, str]] = []
    for c in range(n_chains):
        chain = names[c * VT_CHAIN_LEN:(c + 1) * VT_CHAIN_LEN]
        ds = sorted(r.random() for _ in chain)
        if c == 0:  # the asked chain starts at this sample's depth (scaled into the first half)
            ds = sorted([depth * 0.5] + ds[1:])
        for j, (d, name) in enumerate(zip(ds, chain)):
            needles.append((d, f"VAR {name} = {values[c] if j == 0 else chain[j - 1]}."))
    needles.sort(key=lambda x: x[0])  # stable: a chain's statements keep their order on ties
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    q = (f"Find all variables that are assigned the value {values[0]} in the text above. "
         "Reply with just the variable names, separated by commas.")
    prompt = _essay_haystack(env, r, target, lambda h: _question(intro + h, q), needles, names + values)
    return None if prompt is None else (prompt, tuple(names[:VT_CHAIN_LEN]))


def _common_words(env: _Env, r: random.Random, target: int, depth: float):
    vocab = list(_vocabulary())
    r.shuffle(vocab)
    common: list[str] = []
    for w in vocab:  # no common word inside another common word
        if len(common) == CWE_NUM_COMMON:
            break
        if not any(w in c or c in w for c in common):
            common.append(w)
    pool = [w for w in vocab if w not in common and not any(c in w for c in common)]
    est_entries = target / 6.0  # "123. word\n" is ~6 tokens with SmolLM2; refined by _fit
    freq_c = max(CWE_FREQ_UNCOMMON + 2, min(CWE_FREQ_COMMON, int(0.4 * est_entries / CWE_NUM_COMMON)))
    order_seed = r.random()
    intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n\n")
    q = (f"What are the {CWE_NUM_COMMON} most common words in the above list? "
         f"Reply with just the {CWE_NUM_COMMON} words, separated by commas.")

    def build(k: int) -> str:
        words = common * freq_c + pool[:k] * CWE_FREQ_UNCOMMON
        random.Random(order_seed).shuffle(words)
        return _question(intro + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words)), q)

    fixed = env.n(build(0))
    k, _ = _fit(lambda k: env.n(build(k)), lambda k: 6.0 * CWE_FREQ_UNCOMMON * k, fixed, len(pool),
                target, _tolerance(target))
    return build(k), tuple(common)


def _frequent_words(env: _Env, r: random.Random, target: int, depth: float):
    vocab: list[str] = [FWE_NOISE]
    seen = {FWE_NOISE}
    while len(vocab) < FWE_VOCAB:
        w = "".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(FWE_WORD_LEN))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    weights = [(i + 1) ** -FWE_ALPHA for i in range(FWE_VOCAB)]
    z = sum(weights)
    order_seed = r.random()
    intro = ("Read the following coded text and track the frequency of each coded word. "
             "Find the three most frequently appeared coded words.\n\n")
    q = ("Do not provide any explanation. Please ignore the dots '....'. What are the three most "
         "frequently appeared words in the above coded text? Reply with just the three words, separated by commas.")

    def counts(n: int) -> list[int]:
        return [int(n * w / z) for w in weights]

    def build(n: int) -> str:
        words = [w for w, c in zip(vocab, counts(n)) for _ in range(c)]
        random.Random(order_seed).shuffle(words)
        return _question(intro + " ".join(words), q)

    fixed = env.n(build(0))
    k, _ = _fit(lambda n: env.n(build(n)), lambda n: 3.0 * n, fixed, 4 * target, target, _tolerance(target))
    c = counts(k)
    if not (c[1] > c[2] > c[3] > c[4]):
        raise ValueError(f"context too small for frequent_words ({target} prompt tokens)")
    return build(k), tuple(vocab[1:4])


_BUILDERS = {
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "passkey": _passkey,
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
    "frequent_words": _frequent_words,
}


# --------------------------------------------------------------------------- public API

def make_samples(tokenizer: Any, task: str, context_tokens: int, n: int, seed: int = 0) -> list[Sample]:
    """``n`` samples of ``task`` whose prompts have about ``prompt_budget(context_tokens)``
    tokens of ``tokenizer`` (never more; at most ~1.5% less unless one haystack unit is
    bigger than that).  Deterministic for (task, context_tokens, n, seed); sample ``i`` gets
    its own haystack start, needles and (for the needle tasks) the i-th of n depths spread
    evenly over 0%..100% in a seeded order."""
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if n < 0:
        raise ValueError("n must be >= 0")
    if context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be >= {MIN_CONTEXT_TOKENS}")
    if n == 0:
        return []
    env = _Env(tokenizer)
    target = prompt_budget(context_tokens)
    depths = _depths(task, context_tokens, n, seed)
    out: list[Sample] = []
    for i in range(n):
        r = _rng(seed, task, context_tokens, i)
        for _ in range(20):
            got = _BUILDERS[task](env, r, target, depths[i])
            if got is not None:
                break
        else:  # pragma: no cover - would need 20 collisions in a row
            raise RuntimeError(f"could not build {task} sample {i}")
        prompt, answers = got
        out.append(Sample(task=task, context_tokens=context_tokens, index=i, prompt=prompt,
                          answers=tuple(answers), max_new_tokens=MAX_NEW_TOKENS[task], kind=TASK_KIND[task]))
    return out


def make_suite(tokenizer: Any, tasks: Sequence[str] = TASKS, contexts: Sequence[int] = (2048, 4096, 8192),
               n: int = 10, seed: int = 0) -> list[Sample]:
    """``make_samples`` for every (task, context), ordered by context, then task, then index."""
    return [s for c in contexts for t in tasks for s in make_samples(tokenizer, t, c, n, seed)]


def score(sample: Sample, output: str) -> float:
    """RULER ``string_match_all``: fraction of ``sample.answers`` found in ``output``
    (case-insensitive substring match); in [0, 1]."""
    if not sample.answers:
        return 0.0
    out = (output or "").lower()
    return sum(a.lower() in out for a in sample.answers) / len(sample.answers)
