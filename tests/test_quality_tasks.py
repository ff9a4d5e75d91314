"""Tests for sfi_vllm.tools.quality.tasks (RULER-style long-context task suite; no vLLM engine).

Uses the prepared SmolLM2 tokenizer and the cached essay corpus (see tests/test_texts.py).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from sfi_vllm.tools.quality.tasks import (
    MAX_NEW_TOKENS,
    TASKS,
    Sample,
    count_tokens,
    make_samples,
    make_suite,
    prompt_budget,
    score,
)

NIAH_RE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")
VAR_RE = re.compile(r"VAR ([A-Z]{5}) = ([A-Z]{5}|\d{5})\.")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from sfi_vllm.tools.model_prep import prepare_model

    return AutoTokenizer.from_pretrained(prepare_model(progress=False))


@pytest.fixture(scope="module")
def s2k(tok) -> dict[str, list[Sample]]:
    return {t: make_samples(tok, t, 2048, 3, seed=0) for t in TASKS}


@pytest.fixture(scope="module")
def s8k(tok) -> dict[str, list[Sample]]:
    return {t: make_samples(tok, t, 8192, 1, seed=0) for t in TASKS}


def _list_words(prompt: str) -> list[str]:
    return re.findall(r"^\d+\. (\S+)$", prompt, flags=re.M)


# --------------------------------------------------------------------------- determinism / fields

def test_deterministic_and_distinct(tok, s2k):
    for task in TASKS:
        again = make_samples(tok, task, 2048, 3, seed=0)
        assert again == s2k[task], task
        prompts = [s.prompt for s in s2k[task]]
        assert len(set(prompts)) == 3, task
        assert len({s.answers for s in s2k[task]}) == 3, task
        other = make_samples(tok, task, 2048, 1, seed=1)[0]
        assert other.prompt != s2k[task][0].prompt and other.answers != s2k[task][0].answers, task


def test_sample_fields(s2k):
    for task in TASKS:
        for i, s in enumerate(s2k[task]):
            assert (s.task, s.context_tokens, s.index) == (task, 2048, i)
            assert s.kind == ("aggregation" if task in ("common_words", "frequent_words") else "retrieval")
            assert 16 <= s.max_new_tokens <= 64 and s.max_new_tokens == MAX_NEW_TOKENS[task]
            assert s.answers and all(isinstance(a, str) and a for a in s.answers)
            assert s.prompt.rstrip().endswith("Answer:")
            assert "Question:" in s.prompt[-600:]


# --------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("ctx", [2048, 8192])
def test_sizes_within_tolerance(tok, s2k, s8k, ctx):
    samples = s2k if ctx == 2048 else s8k
    for task in TASKS:
        for s in samples[task]:
            n = count_tokens(tok, s.prompt)
            assert n <= prompt_budget(ctx), (task, n)
            assert abs(n - ctx) <= 0.10 * ctx, (task, n)
            if ctx == 8192:  # chat template + answer still fit in the model's 8192 context
                chat = tok.apply_chat_template([{"role": "user", "content": s.prompt}], tokenize=False,
                                               add_generation_prompt=True)
                assert count_tokens(tok, chat) + s.max_new_tokens <= 8192, task


def test_prompt_budget():
    assert prompt_budget(8192) == 7905 and 7800 <= prompt_budget(8192) <= 8000
    assert prompt_budget(2048) == 1920
    assert prompt_budget(4096) == 3953


# --------------------------------------------------------------------------- answers in the prompt

def test_niah_single(tok, s2k, s8k):
    depths = []
    for s in s2k["niah_single"] + s8k["niah_single"]:
        (value,) = s.answers
        needles = NIAH_RE.findall(s.prompt)
        assert len(needles) == 1 and needles[0][1] == value
        assert s.prompt.count(value) == 1
        key = needles[0][0]
        assert f"special magic number for {key} mentioned" in s.prompt[-400:]
        assert s.prompt.count(key) == 2  # needle + question
    for s in make_samples(tok, "niah_single", 1024, 5, seed=3):
        start = s.prompt.index("\n\n") + 2
        end = s.prompt.rindex("\n\nQuestion:")
        depths.append((s.prompt.index(s.answers[0]) - start) / (end - start))
    assert min(depths) < 0.1 and max(depths) > 0.9  # needle depth spans 0%..100%
    assert len({round(d, 2) for d in depths}) == 5


def test_niah_multikey(s2k, s8k):
    for s in s2k["niah_multikey"] + s8k["niah_multikey"]:
        (value,) = s.answers
        needles = NIAH_RE.findall(s.prompt)
        assert len(needles) == 4
        keys = [k for k, _ in needles]
        values = [v for _, v in needles]
        assert len(set(keys)) == 4 and len(set(values)) == 4
        asked = re.search(r"special magic number for ([a-z]+-[a-z]+) mentioned", s.prompt).group(1)
        assert dict(needles)[asked] == value
        question = s.prompt[s.prompt.rindex("Question:"):]
        for k, v in needles:
            assert s.prompt.count(v) == 1
            if k != asked:
                assert k not in question and v != value


def test_niah_multivalue(s2k, s8k):
    for s in s2k["niah_multivalue"] + s8k["niah_multivalue"]:
        needles = NIAH_RE.findall(s.prompt)
        assert len(needles) == 4 and len({k for k, _ in needles}) == 1
        assert sorted(v for _, v in needles) == sorted(s.answers) and len(set(s.answers)) == 4
        assert f"special magic numbers for {needles[0][0]} mentioned" in s.prompt[-400:]


def test_passkey(s2k, s8k):
    for s in s2k["passkey"] + s8k["passkey"]:
        (key,) = s.answers
        assert re.fullmatch(r"\d{5}", key)
        assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.prompt
        assert s.prompt.count(key) == 2
        assert s.prompt.count("The grass is green. The sky is blue. The sun is yellow.") > 50


def test_variable_tracking(s2k, s8k):
    for s in s2k["variable_tracking"] + s8k["variable_tracking"]:
        value = re.search(r"assigned the value (\d{5})", s.prompt).group(1)
        stmts = VAR_RE.findall(s.prompt)
        assert len(stmts) in (8, 12)
        names = [n for n, _ in stmts]
        assert len(set(names)) == len(names)
        pos = {n: i for i, (n, _) in enumerate(stmts)}
        holds: set[str] = set()
        for n, rhs in stmts:  # in text order; a chain's statements appear in order
            if rhs == value or rhs in holds:
                if rhs in holds:
                    assert pos[rhs] < pos[n]
                holds.add(n)
        assert holds == set(s.answers) and len(s.answers) == 4
        for a in s.answers:
            assert re.fullmatch(r"[A-Z]{5}", a)


def test_common_words(s2k, s8k):
    for s in s2k["common_words"] + s8k["common_words"]:
        words = _list_words(s.prompt)
        assert len(words) > 200
        c = Counter(words)
        assert len(s.answers) == 10 and set(s.answers) <= set(c)
        low = min(c[a] for a in s.answers)
        assert all(n < low for w, n in c.items() if w not in s.answers)
        assert {n for w, n in c.items() if w not in s.answers} == {3}
        assert "10 most common words" in s.prompt[-400:]


def test_frequent_words(s2k, s8k):
    for s in s2k["frequent_words"] + s8k["frequent_words"]:
        body = s.prompt.split("\n\n")[1]
        c = Counter(body.split())
        ranked = [w for w, _ in c.most_common() if w != "...."]
        assert c.most_common(1)[0][0] == "...."
        assert tuple(ranked[:3]) == s.answers
        assert c[ranked[0]] > c[ranked[1]] > c[ranked[2]] > c[ranked[3]]
        assert len(c) > 10


# --------------------------------------------------------------------------- score

def _sample(answers):
    return Sample(task="niah_multivalue", context_tokens=2048, index=0, prompt="p", answers=tuple(answers),
                  max_new_tokens=64, kind="retrieval")


def test_score():
    s = _sample(["1234567", "7654321", "ABCDE", "Word"])
    assert score(s, "1234567, 7654321, abcde and WORD") == 1.0
    assert score(s, "The numbers are 1234567 and abcde.") == 0.5
    assert score(s, "word") == 0.25
    assert score(s, "nothing here") == 0.0
    assert score(s, "") == 0.0
    assert score(_sample(["1234567"]), "The special magic number is 1234567.") == 1.0


def test_score_on_generated(s2k):
    for task in TASKS:
        s = s2k[task][0]
        assert score(s, " ".join(s.answers).upper()) == 1.0
        assert score(s, "I don't know.") == 0.0
        if len(s.answers) > 1:
            assert 0.0 < score(s, s.answers[0]) < 1.0


# --------------------------------------------------------------------------- suite / errors

def test_make_suite_covers_tasks_and_contexts(tok, s8k):
    suite = make_suite(tok, n=1)
    assert {(s.task, s.context_tokens) for s in suite} == {(t, c) for t in TASKS for c in (2048, 4096, 8192)}
    assert len(suite) == 21
    assert [s for s in suite if s.context_tokens == 8192] == [s8k[t][0] for t in TASKS]
    small = make_suite(tok, tasks=("passkey", "niah_single"), contexts=(1024,), n=2, seed=5)
    assert [(s.task, s.index) for s in small] == [("passkey", 0), ("passkey", 1), ("niah_single", 0), ("niah_single", 1)]


def test_errors(tok):
    with pytest.raises(ValueError):
        make_samples(tok, "nope", 2048, 1)
    with pytest.raises(ValueError):
        make_samples(tok, "passkey", 100, 1)
    assert make_samples(tok, "passkey", 2048, 0) == []
