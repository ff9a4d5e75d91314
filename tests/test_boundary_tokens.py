"""Where an engine's sentence enders come from (``SFIController._boundary_tokens``): explicit ids,
else the tokenizer's, also with the engine's own boundary trigger off (so that a request may turn
it on); with the trigger off a tokenizer that does not load or has no enders only warns; the
lossless mode takes none."""

import logging
from types import SimpleNamespace

import pytest
import transformers

from sfi_vllm import controller as controller_module
from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController
from sfi_vllm.trigger import BoundaryTokens


def _enders(sfi: dict, monkeypatch, tokenizer=None, skip_tokenizer_init=False):
    """Run ``_boundary_tokens`` for an engine of ``sfi``; ``tokenizer``: an exception the tokenizer's
    load raises, "no enders" (it loads, and its vocabulary has none) or None (a vocabulary with
    '.' as id 7)."""
    def load(*args, **kwargs):
        if isinstance(tokenizer, Exception):
            raise tokenizer
        return object()

    def derive(tok, newline_is_boundary):
        if tokenizer == "no enders":
            raise ValueError("sfi-vllm: found no sentence-ending token in the tokenizer's vocabulary")
        return BoundaryTokens(frozenset({7}), frozenset())

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load)
    monkeypatch.setattr(controller_module, "boundary_tokens_from_tokenizer", derive)
    owner = SimpleNamespace(cfg=build_config(sfi, use_env=False))
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(tokenizer="tok", skip_tokenizer_init=skip_tokenizer_init))
    return SFIController._boundary_tokens(owner, vllm_config)


def test_explicit_ids_come_first(monkeypatch):
    assert _enders({"boundary_token_ids": [3, 4]}, monkeypatch, OSError("no tokenizer")).enders == {3, 4}


@pytest.mark.parametrize("trigger", [True, False])
def test_the_tokenizer_gives_the_enders_with_the_trigger_on_or_off(monkeypatch, trigger):
    assert _enders({"boundary_trigger": trigger}, monkeypatch).enders == {7}


@pytest.mark.parametrize("failure", [OSError("no tokenizer here"), "no enders"])
def test_with_the_trigger_off_a_tokenizer_without_enders_warns(monkeypatch, caplog, failure):
    with caplog.at_level(logging.WARNING, logger="sfi_vllm"):
        assert _enders({"boundary_trigger": False}, monkeypatch, failure) is None
    assert "give sfi.boundary_token_ids" in caplog.text
    with pytest.raises((OSError, ValueError)):  # with the trigger on it stops the start-up
        _enders({"boundary_trigger": True}, monkeypatch, failure)


def test_without_a_tokenizer_only_an_engine_with_the_trigger_on_stops(monkeypatch):
    assert _enders({"boundary_trigger": False}, monkeypatch, skip_tokenizer_init=True) is None
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        _enders({"boundary_trigger": True}, monkeypatch, skip_tokenizer_init=True)


def test_the_lossless_mode_takes_no_enders(monkeypatch):
    assert _enders({"mode": "lossless"}, monkeypatch, OSError("never loaded")) is None
