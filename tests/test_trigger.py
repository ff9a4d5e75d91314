import pytest
import torch

from sfi_vllm.config import build_config
from sfi_vllm.trigger import (
    BoundaryTokens,
    SlowReason,
    SlowStepTrigger,
    StepMode,
    boundary_tokens_from_tokenizer,
    classify_token_text,
)

END, NL, WORD, SPACE = 1, 2, 3, 4
BOUNDARY = BoundaryTokens(frozenset({END, NL}), frozenset({NL, SPACE}))


def run(cfg, tokens, context_start=1000, slot=0):
    trig = SlowStepTrigger(cfg, num_slots=4, vocab_size=8, boundary=BOUNDARY)
    out = []
    for i, t in enumerate(tokens):
        m, r = trig.step(torch.tensor([slot]), torch.tensor([t]), torch.tensor([context_start + i]))
        out.append((StepMode(int(m[0])), SlowReason(int(r[0]))))
    return trig, out


def test_first_decode_then_reuse_budget():
    cfg = build_config({"reuse_budget": 5, "min_gap": 2}, use_env=False)
    _, out = run(cfg, [WORD] * 13)
    modes = [m for m, _ in out]
    assert out[0] == (StepMode.SLOW, SlowReason.FIRST_DECODE)
    assert modes[1:6] == [StepMode.FAST] * 5
    assert out[6] == (StepMode.SLOW, SlowReason.REUSE_BUDGET)
    assert out[12] == (StepMode.SLOW, SlowReason.REUSE_BUDGET)


def test_boundary_fires_on_first_token_after_ender_and_skips_newlines():
    cfg = build_config({"reuse_budget": 50, "min_gap": 3}, use_env=False)
    toks = [WORD, WORD, WORD, WORD, END, NL, SPACE, WORD, WORD]
    _, out = run(cfg, toks)
    assert [m for m, _ in out][:7] == [StepMode.SLOW] + [StepMode.FAST] * 6
    assert out[7] == (StepMode.SLOW, SlowReason.BOUNDARY)
    assert out[8][0] == StepMode.FAST


def test_boundary_at_ender_mode():
    cfg = build_config({"reuse_budget": 50, "min_gap": 3, "boundary_fire": "at_ender"}, use_env=False)
    _, out = run(cfg, [WORD, WORD, WORD, WORD, END, WORD])
    assert out[4] == (StepMode.SLOW, SlowReason.BOUNDARY)
    assert out[5][0] == StepMode.FAST


def test_boundary_inside_min_gap_is_dropped():
    cfg = build_config({"reuse_budget": 50, "min_gap": 4}, use_env=False)
    toks = [WORD, END, WORD, WORD, WORD, WORD, WORD]
    _, out = run(cfg, toks)
    assert all(m == StepMode.FAST for m, _ in out[1:])


def test_boundary_trigger_off():
    cfg = build_config({"reuse_budget": 50, "min_gap": 0, "boundary_trigger": False}, use_env=False)
    _, out = run(cfg, [WORD, END, WORD, END, WORD])
    assert all(m == StepMode.FAST for m, _ in out[1:])


def test_dense_below_context_then_first_slow():
    cfg = build_config({"dense_below_context": 1003}, use_env=False)
    _, out = run(cfg, [WORD] * 5, context_start=1000)
    assert [m for m, _ in out] == [StepMode.DENSE] * 3 + [StepMode.SLOW, StepMode.FAST]
    assert out[3][1] == SlowReason.FIRST_DECODE


def test_reset_and_slots_are_independent():
    cfg = build_config({"reuse_budget": 3, "min_gap": 0}, use_env=False)
    trig = SlowStepTrigger(cfg, num_slots=4, vocab_size=8, boundary=BOUNDARY)
    slots = torch.tensor([0, 2])
    toks = torch.tensor([WORD, WORD])
    m, _ = trig.step(slots, toks, torch.tensor([100, 100]))
    assert m.tolist() == [StepMode.SLOW, StepMode.SLOW]
    m, _ = trig.step(slots, toks, torch.tensor([101, 101]))
    assert m.tolist() == [StepMode.FAST, StepMode.FAST]
    trig.reset(torch.tensor([2]))
    m, r = trig.step(slots, toks, torch.tensor([102, 102]))
    assert m.tolist() == [StepMode.FAST, StepMode.SLOW] and r[1] == SlowReason.FIRST_DECODE


def test_boundary_trigger_needs_token_ids():
    cfg = build_config({}, use_env=False)
    with pytest.raises(ValueError, match="boundary_token_ids"):
        SlowStepTrigger(cfg, 2, 8, boundary=None)


@pytest.mark.parametrize(
    "text,newline,expect",
    [
        (".", True, (True, False)),
        (" .", True, (True, False)),
        ("?!", True, (True, False)),
        (".\n\n", True, (True, False)),
        ("。", True, (True, False)),
        ('."', True, (True, False)),
        ("\n", True, (True, True)),
        ("\n", False, (False, True)),
        (" ", True, (False, True)),
        ("Mr", True, (False, False)),
        ("3.14", True, (False, False)),
        (",", True, (False, False)),
    ],
)
def test_classify_token_text(text, newline, expect):
    assert classify_token_text(text, newline) == expect


def test_boundary_set_from_a_real_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "Hello": 1, ".": 2, "?": 3, "\n": 4, ".\n": 5, "world": 6, "。": 7, ",": 8}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    b = boundary_tokens_from_tokenizer(hf, newline_is_boundary=True)
    assert b.enders == {2, 3, 4, 5, 7}
    assert b.skips == {4}
