"""A request's own SFI settings: how they are read from ``SamplingParams.extra_args``, merged over
the engine's :class:`~sfi_vllm.config.SFIConfig` (by :func:`sfi_vllm.config.merge_policy`) and
checked against what the engine fixed at start-up. The front end
(:mod:`sfi_vllm.request_validation`, before a request reaches the engine) and the worker
(:class:`~sfi_vllm.controller.SFIController`) call the same :func:`resolve_request_config`, so a
request the front end accepts is configured identically in the worker.

Two forms, which may be combined (a field given twice is an error):

* ``extra_args["sfi"]``: a dict of SFIConfig fields (``SamplingParams(extra_args={"sfi":
  {"selected_tokens": 512, "selector": {"alpha": 1.0}}})``), or the same object as a JSON string.
  The JSON string is what the OpenAI API can carry (``vllm_xargs`` holds only strings, numbers and
  lists, so a nested object gets a 400 from vLLM itself).
* flat keys, one per field: ``sfi_<field>`` for every top-level field of SFIConfig,
  ``sfi_selector_<field>`` for every field of its ``selector`` and ``sfi_experimental_<field>``
  for every field of its ``experimental`` (engine-wide)
  (``extra_body={"vllm_xargs": {"sfi_policy": "dense"}}``). The names are derived from the
  models' fields (:func:`flat_keys`), so a new field is a new key. Any other key that starts with
  ``sfi_`` is an error.

A request sets :class:`~sfi_vllm.config.Policy` fields. It may not change the engine's
:class:`~sfi_vllm.config.EngineSettings` (``REQUEST_FIXED_KEYS``; giving the engine's own value is
accepted), ask for a compact set larger than the engine's buffers hold, or turn on a boundary
trigger the engine has no sentence-ender ids for; those raise :class:`SFIRequestError` like a
malformed value.
"""

from __future__ import annotations

import difflib
import json
import re
import reprlib
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec
from pydantic import BaseModel

from sfi_vllm.config import MOVED_FIELDS, PRESETS, PROMOTED_FIELDS, SFIConfig, SFIConfigError, build_config, echo, engine_fields, merge_policy

REQUEST_KEY = "sfi"  # extra_args["sfi"]: a dict, or a JSON object as a string
FLAT_PREFIX = "sfi_"

# SFIConfig fields that a request's own settings cannot change: the EngineSettings fields (they
# size buffers, pick kernels, streams and graphs, or build the trigger's vocabulary)
REQUEST_FIXED_KEYS = engine_fields()


class SFIRequestError(SFIConfigError):
    """A request's SFI settings are malformed or not allowed on this engine. ``param`` names the
    request field at fault as the client wrote it (``vllm_xargs.sfi_selected_tokens``,
    ``extra_args.sfi.selector.alpha``), or the request's SFI settings as a whole."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(bounded(message, ECHO_TOTAL))
        self.param = bounded(param, ECHO_RUN)


# A backstop on what an error message repeats of the client's input (values are cut where they
# are formatted, config.echo): a run of more than ECHO_RUN non-space characters (a long key) is cut
# to its start and its length, the whole message to ECHO_TOTAL characters (the longest message,
# an unknown key's list of the allowed ones, is under 2,000).
ECHO_RUN = 120
ECHO_TOTAL = 4000
_LONG_RUN = re.compile(r"\S{%d,}" % (ECHO_RUN + 1))


def bounded(text: str, total: int) -> str:
    """``text`` with each run of more than :data:`ECHO_RUN` non-space characters cut to its start
    and its length, and at most ``total`` characters in all."""
    text = _LONG_RUN.sub(lambda m: f"{m.group()[:ECHO_RUN // 2]}...({len(m.group())} characters)", text)
    return text if len(text) <= total else text[:total - 30] + f"...({len(text)} characters)"


@dataclass(frozen=True)
class EngineLimits:
    """What an engine fixed at start-up that bounds a request's settings."""

    cfg: SFIConfig
    max_model_len: int | None  # the longest context: the compact buffers hold sinks + K at it
    has_boundary: bool  # the engine has sentence-ender ids (explicit, or from its tokenizer)

    @classmethod
    def for_engine(cls, cfg: SFIConfig, max_model_len: int | None, has_tokenizer: bool = True) -> "EngineLimits":
        """The limits of an engine as it will start: the controller takes the enders from
        ``boundary_token_ids`` or, where the engine has a tokenizer (not ``skip_tokenizer_init``),
        from the tokenizer, whether or not the engine's own boundary trigger is on, so that a
        request may turn it on (SFIController._boundary_tokens)."""
        return cls(cfg, max_model_len, cfg.boundary_token_ids is not None or has_tokenizer)


def _nested_models() -> dict[str, type[BaseModel]]:
    out = {}
    for name, f in SFIConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out[name] = f.annotation
    return out


@lru_cache(maxsize=1)
def flat_keys() -> dict[str, tuple[str, ...]]:
    """Every flat request key and the field path it sets: ``sfi_<field>`` for SFIConfig's
    top-level fields, ``sfi_<model field>_<field>`` for the fields of its nested models
    (``sfi_selector_alpha``). A top-level field wins over a nested one of the same flat name
    (``tests/test_request_config.py`` checks that none clash)."""
    keys: dict[str, tuple[str, ...]] = {}
    nested = _nested_models()
    for outer, model in nested.items():
        for inner in model.model_fields:
            keys[f"{FLAT_PREFIX}{outer}_{inner}"] = (outer, inner)
    for name in SFIConfig.model_fields:
        if name not in nested:
            keys[f"{FLAT_PREFIX}{name}"] = (name,)
    return keys


def _allowed_keys_text() -> str:
    return ", ".join(sorted(flat_keys()))


def _looks_sfi(key: Any) -> bool:
    """An ``extra_args`` key meant for SFI: ``sfi``, or ``sfi`` then a separator and more, in any
    letter case and separator (``sfi_policy``, ``SFI.selected_tokens``, ``sfi-policy``). Only
    ``sfi`` and the exact ``sfi_*`` names are settings; :func:`request_overrides` refuses the
    others, with the name meant where it can tell, rather than let a misspelt setting be ignored.
    A key that merely begins with the letters (``sfinder_mode``) is another extension's, unless it
    is a setting's name written without its separators (``sfiPolicy``, ``sfiselectedtokens``)."""
    if not isinstance(key, str):
        return False
    k = _folded(key)
    return (k == REQUEST_KEY or (k.startswith(REQUEST_KEY) and not k[len(REQUEST_KEY)].isalnum())
            or _squashed(k) in _squashed_keys())


def _folded(key: str) -> str:
    """``key`` as compared with the settings' names: NFKC-normalised and case-folded, so that a
    look-alike spelling (``ſfi_policy``, full-width letters) is recognised and refused, not ignored."""
    return unicodedata.normalize("NFKC", key).strip().casefold()


def _squashed(key: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", _folded(key))


@lru_cache(maxsize=1)
def _squashed_keys() -> dict[str, str]:
    """Each flat key without its separators (``sfiselectedtokens``), to the key."""
    return {_squashed(k): k for k in flat_keys()}


def _meant_key(key: str) -> str | None:
    """The setting a misspelt SFI key most likely means (``SFI.Selected-Tokens`` ->
    ``sfi_selected_tokens``), or None."""
    flat = re.sub(r"[^a-z0-9]+", "_", _folded(key)).strip("_")
    if flat == REQUEST_KEY:
        return REQUEST_KEY
    return flat if flat in flat_keys() else _squashed_keys().get(_squashed(key))


def mapping_name(extra_args: Any) -> str:
    """How errors name the ``sfi`` entry of a request's ``extra_args``: ``extra_args`` for a
    mapping or ``None`` (only an offline caller can pass either: ``vllm_xargs`` refuses nested
    objects and nulls), else ``vllm_xargs``. Flat keys and a JSON string look the same from both,
    and are named as an HTTP client writes them."""
    if not isinstance(extra_args, Mapping) or REQUEST_KEY not in extra_args:
        return "vllm_xargs"
    entry = extra_args[REQUEST_KEY]
    return "extra_args" if entry is None or isinstance(entry, Mapping) else "vllm_xargs"


def sfi_entries(extra_args: Any) -> dict[str, Any]:
    """The entries of ``extra_args`` meant for SFI (:func:`_looks_sfi`: ``sfi`` and ``sfi_*``, and
    the same names written otherwise, which are refused)."""
    if not isinstance(extra_args, Mapping):
        return {}
    return {k: v for k, v in extra_args.items() if _looks_sfi(k)}


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object (:func:`_object_without_duplicates`)."""


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a key given twice in one object is an error (JSON parsing
    would otherwise keep the last value and drop the first without a word)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"the key {echo(key)} is given twice")
        out[key] = value
    return out


def loads_without_duplicate_keys(text: str) -> Any:
    """``json.loads(text)``, but a key given twice in one object raises ValueError."""
    return json.loads(text, object_pairs_hook=_object_without_duplicates)


def request_overrides(extra_args: Any, where: str = "vllm_xargs",
                      mapping_where: str | None = None) -> tuple[dict[str, Any], dict[tuple, str]] | None:
    """The SFI overrides a request carries in ``extra_args`` (None: none), as one nested dict of
    SFIConfig fields, and for each field path the name the client used (for error messages).
    Raises :class:`SFIRequestError` for a malformed ``sfi`` entry (``null`` included), an unknown
    ``sfi_*`` key, a field given twice, a ``null`` value (leaving a setting out keeps the
    engine's), a group of settings (``selector``) that is not an object, a field that moved (named
    with its new place), or a value vLLM would not send to its engine process as plain data
    (:func:`_unsendable`). ``where`` prefixes the names (``vllm_xargs`` over HTTP);
    ``mapping_where`` (default ``where``) those of the ``sfi`` entry's fields."""
    if extra_args is None:
        return None
    if not isinstance(extra_args, Mapping):
        return None  # vLLM's own validation owns extra_args' type
    overrides: dict[str, Any] = {}
    names: dict[tuple, str] = {}

    def put(path: tuple[str, ...], value: Any, name: str, parsed: bool = False) -> None:
        # null is no request value of a policy field (merged, the field would take its class
        # default, not the engine's value), but for the form of the budget not in force (checked
        # below) and a preset (none: the engine's values); an engine-wide field's null is compared
        # with the engine's, as any value
        if value is None and path[0] not in REQUEST_FIXED_KEYS and path not in _NULLABLE:
            raise SFIRequestError(f"{name}: null is not a value of sfi.{'.'.join(path)}; leave the setting "
                                  "out to keep the engine's value", name)
        unsendable = None if parsed else _unsendable(value)  # a JSON string's values are plain data
        if unsendable is not None:
            raise SFIRequestError(f"{name}: {unsendable}", name)
        clash = [n for p, n in names.items() if p == path or p[:1] == path[:1] and (len(p) == 1 or len(path) == 1)]
        if clash:
            raise SFIRequestError(f"{name}: sfi.{'.'.join(path)} is given twice (also as {clash[0]})", name)
        names[path] = name
        if len(path) == 1:
            overrides[path[0]] = value
        else:
            overrides.setdefault(path[0], {})[path[1]] = value

    if REQUEST_KEY in extra_args:
        raw = extra_args[REQUEST_KEY]
        name = f"{mapping_where or where}.{REQUEST_KEY}"
        parsed = isinstance(raw, str)
        if parsed:
            unsendable = _unsendable(raw)  # a str subclass (numpy.str_) vLLM cannot send
            if unsendable is not None:
                raise SFIRequestError(f"{name}: {unsendable}", name)
            try:
                raw = loads_without_duplicate_keys(raw)
            except _DuplicateKey as e:
                raise SFIRequestError(f"{name}: {e}; give each setting once", name) from None
            except (ValueError, RecursionError) as e:  # JSONDecodeError, numbers or nesting past the parser's limits
                raise SFIRequestError(f"{name}: must be a JSON object of SFI settings "
                                      f"(e.g. '{{\"selected_tokens\": 512}}'); not valid JSON: {e}", name) from None
        if not isinstance(raw, dict):
            raise SFIRequestError(f"{name}: must be an object of SFI settings (a dict, or a JSON object "
                                  f"as a string); got {type(raw).__name__} {echo(raw)}", name)
        nested = _nested_models()
        for key, value in raw.items():
            if key in MOVED_FIELDS:
                raise SFIRequestError(f"{name}.{key}: moved to sfi.{MOVED_FIELDS[key]}", f"{name}.{key}")
            if not isinstance(key, str) or key not in SFIConfig.model_fields:
                close = difflib.get_close_matches(key, list(SFIConfig.model_fields), n=1, cutoff=0.8) \
                    if isinstance(key, str) else []
                raise SFIRequestError(f"{name}: unknown SFI setting {reprlib.repr(key)}; "
                                      + (f"did you mean {close[0]!r}? " if close else "") + "allowed: "
                                      f"{', '.join(SFIConfig.model_fields)}", f"{name}.{key}")
            if key in nested:
                if isinstance(value, nested[key]):  # offline: the engine process receives plain data only
                    raise SFIRequestError(f"{name}.{key}: give the group as a dict, e.g. "
                                          f"{type(value).__name__}(...).model_dump(exclude_unset=True); vLLM's "
                                          "engine process cannot receive a settings object", f"{name}.{key}")
                if not isinstance(value, dict):
                    raise SFIRequestError(f"{name}.{key}: must be an object of {key} settings "
                                          f"(e.g. {{\"{key}\": {{\"{next(iter(nested[key].model_fields))}\": ...}}}}); "
                                          f"got {type(value).__name__} {echo(value)}", f"{name}.{key}")
                for inner, v in value.items():
                    if not isinstance(inner, str):
                        raise SFIRequestError(f"{name}.{key}: unknown {key} setting {reprlib.repr(inner)}; "
                                              f"allowed: {', '.join(nested[key].model_fields)}", f"{name}.{key}")
                    put((key, str(inner)), v, f"{name}.{key}.{inner}", parsed)
            else:
                put((key,), value, f"{name}.{key}", parsed)
    keys = flat_keys()
    for key, value in extra_args.items():
        if not _looks_sfi(key) or key == REQUEST_KEY:
            continue
        path = keys.get(key)
        meant = None if path is not None else _meant_key(key)
        if meant is not None:
            raise SFIRequestError(f"{where}.{key}: not an SFI setting's name; did you mean {meant!r}? "
                                  "(a request's flat SFI keys are lower-case, sfi_ then the field, with "
                                  "underscores: sfi_selected_tokens, sfi_selector_alpha)", f"{where}.{key}")
        group = key[len(FLAT_PREFIX):] if key.startswith(FLAT_PREFIX) else None
        promoted = group[len("experimental_"):] if group and group.startswith("experimental_") else None
        if path is None and (group in MOVED_FIELDS or promoted in PROMOTED_FIELDS):
            moved = MOVED_FIELDS[group] if group in MOVED_FIELDS else PROMOTED_FIELDS[promoted]
            raise SFIRequestError(f"{where}.{key}: moved to sfi.{moved} "
                                  f"({FLAT_PREFIX}{moved.replace('.', '_')})", f"{where}.{key}")
        if path is None and group in _nested_models():
            first = next(iter(_nested_models()[group].model_fields))
            raise SFIRequestError(f"{where}.{key}: {group} is a group of settings; give each as its own key "
                                  f"({FLAT_PREFIX}{group}_{first}), or the group as an object inside the "
                                  f"{REQUEST_KEY} JSON string ('{{\"{group}\": {{\"{first}\": ...}}}}')"
                                  + ("; its settings are engine-wide: a request may only repeat the engine's values"
                                     if group in REQUEST_FIXED_KEYS else ""),
                                  f"{where}.{key}")
        if path is None:
            close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.8)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SFIRequestError(f"{where}.{key}: unknown SFI setting; {hint}allowed: {_allowed_keys_text()}, "
                                  f"and {REQUEST_KEY} (a JSON object)", f"{where}.{key}")
        put(path, value, f"{where}.{key}")
    for form, other in (("selected_tokens", "selected_fraction"), ("selected_fraction", "selected_tokens")):
        if form in overrides and overrides[form] is None and overrides.get(other) is None:
            name = names[(form,)]
            raise SFIRequestError(f"{name}: null is not a value of sfi.{form} unless sfi.{other} is given beside "
                                  "it; leave it out to keep the engine's budget", name)
    if overrides.get("preset", ...) is None:  # no preset: the engine's values
        overrides.pop("preset")
        names.pop(("preset",))
    if not names:
        return None
    return overrides, names


# plain msgpack, without vLLM's hooks (which send numpy arrays and tensors as raw buffers the
# worker's settings cannot be read from); stateless, so one serves every thread
_PLAIN_MSGPACK = msgspec.msgpack.Encoder()


def _unsendable(value: Any) -> str | None:
    """Why a setting's value would not reach vLLM's engine process as the same plain data (None:
    it would). vLLM sends ``extra_args`` there with msgpack: numpy scalars and other objects make
    it raise after the request is half added (an offline engine then hangs), and numpy arrays and
    tensors arrive as raw buffers; so they are refused first. An int passes here: every integer
    field a request may set has bounds, which the field's own check reports better than msgpack's
    64-bit limit."""
    if type(value) in (str, bool, int, float) or value is None:
        return None
    try:
        _PLAIN_MSGPACK.encode(value)
    except Exception as e:  # TypeError for an object msgpack does not know, OverflowError past 64 bits
        return (f"{echo(value)} is not plain data vLLM sends to its engine process ({e}); give a str, "
                "bool, int, float, or a list of them (str(x), int(x), float(x), x.tolist())")
    return None


# policy fields a request may give as null: the budget form not in force, and no preset
_NULLABLE = {("selected_tokens",), ("selected_fraction",), ("preset",)}


# the fields that size a request's compact set, each with those that revert with it (the budget's
# two forms replace each other), in the order a refusal names them when no one of them alone is at fault
_BUDGET_FIELDS = {
    "selected_tokens": ("selected_tokens", "selected_fraction"),
    "selected_fraction": ("selected_tokens", "selected_fraction"),
    "selected_cap": ("selected_cap",),
    "selected_floor": ("selected_floor",),
    "sinks": ("sinks",),
    "policy": ("policy",),  # streaming selects nothing: a request leaving it selects K tokens
}


def _budget_field_at_fault(cfg: SFIConfig, engine: SFIConfig, names: Mapping[tuple, str], max_model_len: int,
                           have: int, preset: str | None = None) -> str:
    """The request's field (as the request wrote it) that makes its compact set larger than the
    engine's buffers: the first of the budget's fields it set whose engine value alone would make
    the set fit, else the preset it named if the engine's values of the budget fields the preset
    set would, else the first budget field it set, else the preset, else the whole ``sfi``."""
    # of the budget's two forms given together, the one in force (the other is null)
    given = [(names[(f,)], f) for f in _BUDGET_FIELDS if (f,) in names
             and not (f in ("selected_tokens", "selected_fraction") and getattr(cfg, f) is None)]

    def fits(fields) -> bool:
        reverted = cfg.model_copy(update={f: getattr(engine, f) for f in fields})
        return reverted.compact_capacity(max_model_len) <= have

    for name, field in given:
        if fits(_BUDGET_FIELDS[field]):
            return name
    preset_name = names.get(("preset",))
    if preset_name is not None and preset in PRESETS:
        # the preset is the request's whole policy: every budget field the request left out is its
        own = {g for f in _BUDGET_FIELDS if (f,) in names for g in _BUDGET_FIELDS[f]}
        from_preset = {f for f in _BUDGET_FIELDS if f not in own}
        if from_preset and fits(from_preset):
            return preset_name
    if given:
        return given[0][0]
    return preset_name or REQUEST_KEY


def check_request_config(limits: EngineLimits, cfg: SFIConfig, names: Mapping[tuple, str],
                         preset: str | None = None) -> None:
    """What a request's merged config ``cfg`` may not ask of the engine: a compact set larger than
    the engine's buffers hold, a boundary trigger the engine has no enders for. (Its
    EngineSettings are the engine's: :func:`~sfi_vllm.config.merge_policy` refuses a change.)
    ``preset``: the preset the request named, if any."""
    engine = limits.cfg
    if limits.max_model_len:
        need = cfg.compact_capacity(limits.max_model_len)
        have = engine.compact_capacity(limits.max_model_len)
        if cfg.policy != "dense" and need > have:
            name = _budget_field_at_fault(cfg, engine, names, limits.max_model_len, have, preset)
            fix = ("Ask for fewer, or raise the engine's sfi.selected_tokens (or selected_cap)"
                   + (f" (the preset {preset!r} brings its own budget, selected_cap included: the request "
                      "may set those too)" if name == names.get(("preset",)) else "")
                   if engine.policy != "streaming" else
                   "The engine runs policy streaming, which selects nothing, so its buffers hold its sinks "
                   "only: a request can select tokens on an engine started with another policy")
            raise SFIRequestError(f"{name}: the request's compact set (sinks + K, K at most max_model_len "
                                  f"{limits.max_model_len}) needs {need} tokens, more than the engine's compact "
                                  f"buffers hold ({have}: its own sinks + K); allowed: sinks + K <= {have}. {fix}",
                                  name)
    problem = cfg.quest_page_problem(limits.max_model_len)
    if problem:
        name = next((names[f] for f in (("quest_page",), ("selected_fraction",), ("selected_floor",),
                                        ("selected_cap",), ("policy",), ("preset",)) if f in names),
                    names.get((), REQUEST_KEY))
        raise SFIRequestError(f"{name}: {problem}", name)
    # lossless mode runs no boundary trigger (its drafter re-selects at verify steps)
    if cfg.boundary_trigger and cfg.refreshes_selection and not limits.has_boundary and engine.mode != "lossless":
        name = names.get(("boundary_trigger",)) or names.get(("policy",)) or names.get(("preset",)) or REQUEST_KEY
        raise SFIRequestError(f"{name}: the boundary trigger needs sentence-ender token ids, and this engine "
                              "has none (it has no sfi.boundary_token_ids, and no tokenizer, or its tokenizer gave none: "
                              "see its start-up log); "
                              "allowed: boundary_trigger false. The engine's operator can give "
                              "sfi.boundary_token_ids", name)


def _param_at_fault(error: SFIConfigError, names: Mapping[tuple, str], where: str) -> str:
    """The request field an error names: its location, or for an error of several fields together
    (no location of its own) the request's field that its message names first, else ``where``."""
    at = [names[loc] for loc in getattr(error, "locs", ()) if loc in names]
    if at:
        return at[0]
    message = str(error)
    found = [(m.start(), name) for path, name in names.items()
             if (m := re.search(rf"\b{re.escape(path[-1])}\b", message))]
    return min(found)[1] if found else where


def _engine_values_hint(error: SFIConfigError, names: Mapping[tuple, str], engine: SFIConfig,
                        overrides: Mapping[str, Any]) -> str:
    """For an error of several fields together, the fields its message names (``min_gap (16)``)
    that the request did not set: they hold the engine's values, or those of the preset the
    request names, which the request may change too."""
    given = {path[0] for path in names}
    preset = overrides.get("preset")
    if isinstance(preset, str) and preset in PRESETS:  # the request's policy is the preset's
        base = build_config({"preset": preset}, use_env=False)
        source = f"comes from the preset {preset!r}; the request may set it"
    else:
        base, source = engine, "is the engine's value, which the request may set"
    keys = flat_keys()
    unset = [f for f in SFIConfig.model_fields
             if f not in given and f not in REQUEST_FIXED_KEYS and f"{FLAT_PREFIX}{f}" in keys
             and re.search(rf"\b{re.escape(f)} \(", str(error))]
    if not unset or not any(re.search(rf"\b{re.escape(p[0])} \(", str(error)) for p in names):
        return ""
    return "; " + ", ".join(f"{f} ({getattr(base, f)!r}) {source} as well ({FLAT_PREFIX}{f})" for f in unset)


def resolve_request_config(limits: EngineLimits, extra_args: Any, where: str = "vllm_xargs",
                           mapping_where: str | None = None) -> SFIConfig:
    """The config a request runs with: the engine's, or its own settings merged over it (see the
    module doc). Raises :class:`SFIRequestError` naming the field (:func:`request_overrides`)."""
    parsed = request_overrides(extra_args, where, mapping_where)
    if parsed is None:
        return limits.cfg
    overrides, names = parsed
    try:  # an error of several fields together (e.g. min_gap > reuse_budget): see _param_at_fault
        cfg = merge_policy(limits.cfg, overrides, field_names={**names, (): where})
    except SFIConfigError as e:
        raise SFIRequestError(str(e) + _engine_values_hint(e, names, limits.cfg, overrides),
                              _param_at_fault(e, names, where)) from None
    preset = overrides.get("preset")
    check_request_config(limits, cfg, names, preset if isinstance(preset, str) else None)
    return cfg
