"""``sfi-vllm batch IN.jsonl OUT.jsonl``: offline batch generation through one vLLM engine.

Every input line is one request, in either form:

* ``{"id": "a", "prompt": "text"}`` or ``{"id": "b", "messages": [{"role": "user", "content": "..."}]}``,
  optionally with ``"sampling": {...}`` (any ``vllm.SamplingParams`` field: ``max_tokens``,
  ``temperature``, ``top_p``, ``stop``, ...) and ``"sfi": {...}`` (the request's SFI settings, as
  in ``SamplingParams(extra_args={"sfi": ...})``, e.g. ``{"selected_tokens": 512}`` or
  ``{"policy": "dense"}``, or the same object as a JSON string);
* a line of vLLM's ``run-batch`` / OpenAI batch file: ``{"custom_id": "a", "url":
  "/v1/chat/completions", "body": {"messages": [...], "max_tokens": 64, ...}}``; the body's
  sampling fields are used as above and its ``sfi`` key (or ``vllm_xargs``: ``sfi`` or flat ``sfi_*``
  keys, not both places) as the SFI settings; ``n`` must be 1 (one completion per line).

An engine with dense attention runs every line without its SFI settings (as a dense server ignores
them), so the same file gives the dense reference.

Each finished request is appended to the output as one JSON line as soon as it finishes:
``{"id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "sfi_stats"}``. A line that
cannot run (bad JSON, bad sampling or SFI settings, a prompt longer than the engine allows) is
written as ``{"id", "line", "error"}`` and the run goes on. Ids already in the output are skipped,
so an interrupted run resumes where it stopped (``retry_errors`` runs the failed ids again).

Why a command of ours and not vLLM's ``run-batch`` with the SFI backend (which works too, since the
backend is a plugin): ``run-batch`` submits every line at once and writes the output only at the
end, a malformed line aborts the whole run, it cannot resume, and it does not return SFI's
per-request statistics. This command reads run-batch's input format as well, so the same files work
with both.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so every request's SFI
statistics are read from the worker's controller as it finishes (one worker: with tensor or
pipeline parallelism the statistics live in other processes and ``sfi_stats`` is left out).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator, model_validator


class BatchLine(BaseModel):
    """One request of a batch file (the module doc lists the fields)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = {}
    sfi: dict[str, Any] | None = None
    # where the sampling fields were written: "sampling", or "body" (an OpenAI run-batch line)
    _sampling_path: str = PrivateAttr("sampling")

    @field_validator("sfi", mode="before")
    @classmethod
    def _sfi_object(cls, value: Any) -> Any:
        """``sfi`` as a JSON string is read as the object it holds, as ``extra_args["sfi"]`` is
        offline (a key given twice in it is refused, as there)."""
        if not isinstance(value, str):
            return value
        from sfi_vllm.request_config import loads_without_duplicate_keys

        try:
            parsed = loads_without_duplicate_keys(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"a JSON string here must hold an object of SFI settings; not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"a JSON string here must hold an object of SFI settings; it holds "
                             f"{type(parsed).__name__} {value[:60]!r}")
        return parsed

    @model_validator(mode="after")
    def _one_input(self) -> "BatchLine":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.sampling.get("n", 1) != 1:
            raise ValueError(f"sampling.n must be 1 in a batch (one completion per line); got {self.sampling['n']!r}")
        extra = self.sampling.get("extra_args")
        if self.sfi is not None and isinstance(extra, dict) and "sfi" in extra:
            raise ValueError("the SFI settings are given twice (sfi and sampling.extra_args.sfi): give them once")
        return self


class LineError(ValueError):
    """A batch line that cannot run: ``LineError(request_id, message)``."""


_OPENAI_BODY_INPUTS = {"messages", "prompt"}
# fields of an OpenAI request that do not change what is generated
_OPENAI_BODY_IGNORED = {"model", "stream", "stream_options", "n", "user", "store", "metadata", "service_tier",
                        "parallel_tool_calls"}
_OPENAI_BODY_UNSUPPORTED = {"response_format", "tools", "tool_choice", "functions", "function_call",
                            "chat_template_kwargs", "structured_outputs"}
_OPENAI_URLS = {"/v1/chat/completions", "/v1/completions"}


def _from_openai_batch(data: dict[str, Any]) -> dict[str, Any]:
    """A run-batch (OpenAI batch file) line as a :class:`BatchLine` dict."""
    url = data.get("url")
    if url is not None and url not in _OPENAI_URLS:
        raise ValueError(f"url {url!r}: a batch generates text ({', '.join(sorted(_OPENAI_URLS))})")
    if not isinstance(data.get("body"), dict):
        raise ValueError("body must be a JSON object (the request)")
    body = dict(data["body"])
    if body.get("stream"):
        raise ValueError("streaming requests are not supported in a batch")
    if body.get("n") not in (None, 1):
        raise ValueError(f"body.n must be 1 in a batch (one completion per line); got {body['n']!r}")
    unsupported = sorted(_OPENAI_BODY_UNSUPPORTED & set(body))
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: not supported by sfi-vllm batch (vLLM's run-batch "
                         "takes structured output and tools)")
    if "logprobs" in body and "messages" in body:  # chat: a flag, and top_logprobs the count
        wanted, top = body.pop("logprobs"), body.pop("top_logprobs", None)
        if wanted:
            body["logprobs"] = top or 0
    xargs = body.pop("vllm_xargs", None) or {}
    if not isinstance(xargs, dict):
        raise ValueError("vllm_xargs must be a JSON object")
    xargs = dict(xargs)
    sfi = body.pop("sfi", None)
    # SFI settings in vllm_xargs as the OpenAI API carries them: flat sfi_* keys or one JSON string
    # "sfi" (sfi_vllm.request_config); the other vllm_xargs entries go to SamplingParams.extra_args
    from sfi_vllm.request_config import request_overrides, sfi_entries

    # they stay in extra_args as written, so a refusal names them as the server would
    # (vllm_xargs.sfi_selected_tokens); a misspelt or malformed key is an error of the line here
    ours = sfi_entries(xargs)
    if ours:
        if sfi is not None:
            raise ValueError("the SFI settings are given twice (body.sfi and body.vllm_xargs): give them once")
        request_overrides(ours, where="vllm_xargs")
    if xargs:
        extra = body.get("extra_args") or {}
        if not isinstance(extra, dict):
            raise ValueError("extra_args must be a JSON object")
        body["extra_args"] = {**extra, **xargs}
    line = {k: body.pop(k) for k in list(body) if k in _OPENAI_BODY_INPUTS}
    for k in _OPENAI_BODY_IGNORED:
        body.pop(k, None)
    if "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    return dict(id=data.get("custom_id"), **line, sampling=body, sfi=sfi)


def parse_line(text: str, lineno: int) -> tuple[str, BatchLine]:
    """The request id and the validated request of one input line (1-based ``lineno``; a line
    without an id gets ``line-<lineno>``). Raises :class:`LineError` with the id it could read."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and numbers or nesting past the parser's limits
        raise LineError(f"line-{lineno}", f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise LineError(f"line-{lineno}", "a line must be a JSON object")
    rid = _line_id(data, lineno)
    try:
        if "id" in data and "custom_id" in data:  # either form of line: the output record would take the id
            raise ValueError("id and custom_id: give one (a run-batch line names its request by custom_id)")
        if "body" not in data and ("url" in data or "method" in data):  # a run-batch line's other fields
            raise ValueError("body: missing; a run-batch line gives its request in a body object "
                             '({"custom_id": ..., "method": "POST", "url": ..., "body": {...}})')
        fields = _from_openai_batch(data) if "body" in data else data
        req = BatchLine.model_validate(fields)
        if "body" in data:
            req._sampling_path = "body"
    except ValidationError as e:
        # a field's error names its path; a check of the whole line names the fields itself
        msg = "; ".join((f"{'.'.join(map(str, err['loc']))}: " if err["loc"] else "")
                        + err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise LineError(rid, msg) from None
    except (ValueError, TypeError) as e:
        raise LineError(rid, str(e)) from None
    return rid, req


def done_ids(out: Path, retry_errors: bool = False) -> set[str]:
    """Ids already in the output file. A last line cut off by a kill is dropped from the file, so
    that what is appended starts on a line of its own; with ``retry_errors`` the error records are
    dropped too (those ids run again)."""
    if not out.exists():
        return set()
    raw = out.read_text(encoding="utf-8")
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    kept, ids = [], set()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not raw.endswith("\n"):
                continue  # the last line, cut off by a kill
            rec = None  # not a record of ours: kept as it is
        if isinstance(rec, dict) and "id" in rec:
            if retry_errors and rec.get("error") is not None:
                continue
            ids.add(str(rec["id"]))
        kept.append(line + "\n")
    text = "".join(kept)
    if text != raw:
        out.write_text(text, encoding="utf-8")
    return ids


def earlier_error_ids(out: Path) -> set[str]:
    """Ids whose record in the output file is an error (a resumed run skips them unless
    ``retry_errors``)."""
    if not out.exists():
        return set()
    ids = set()
    for line in out.read_text(encoding="utf-8").split("\n"):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "id" in rec and rec.get("error") is not None:
            ids.add(str(rec["id"]))
    return ids


class BatchFileError(ValueError):
    """An input or output file the batch cannot use (found before the engine loads)."""


def read_input_lines(in_path: str | Path, out_path: str | Path | None = None) -> list[tuple[int, str]]:
    """``(line number, text)`` of the input's non-blank lines. Lines end at ``\\n`` only (JSON
    strings may hold U+2028 and the like raw); UTF-8, a byte-order mark dropped. Raises
    :class:`BatchFileError` for an input that cannot be read, an output that is the input or
    a directory, or ids that more than one line has (the output and a resumed run key every
    record by its id, as OpenAI's batch API requires a unique ``custom_id``)."""
    in_path = Path(in_path)
    if out_path is not None:
        out_path = Path(out_path)
        if out_path.is_dir():
            raise BatchFileError(f"{out_path}: the output is a directory")
        if out_path.exists() and in_path.exists() and os.path.samefile(out_path, in_path):  # links too
            raise BatchFileError(f"{out_path}: the output is the input file; give another")
    try:
        data = in_path.read_bytes()
    except OSError as e:
        raise BatchFileError(f"{in_path}: cannot read the input ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BatchFileError(f"{in_path}: not UTF-8 text ({e})") from None
    lines = [(i, t.rstrip("\r")) for i, t in enumerate(text.split("\n"), 1) if t.strip()]
    repeated = {rid: nums for rid, nums in _line_numbers_by_id(lines).items() if len(nums) > 1}
    if repeated:
        shown = ", ".join(f"{rid!r} (lines {', '.join(map(str, nums))})" for rid, nums in list(repeated.items())[:5])
        more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
        raise BatchFileError(f"{in_path}: ids must be unique (each output record is keyed by its id); "
                             f"given more than once: {shown}{more}")
    return lines


def _line_numbers_by_id(lines: list[tuple[int, str]]) -> dict[str, list[int]]:
    """Each line's request id as :func:`parse_line` reads it (``id``, else ``custom_id``, else
    ``line-<n>``), with the numbers of the lines that give it."""
    out: dict[str, list[int]] = {}
    for lineno, text in lines:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):  # the line's error comes later (parse_line)
            data = None
        out.setdefault(_line_id(data, lineno), []).append(lineno)
    return out


def _line_id(data: Any, lineno: int) -> str:
    """A line's request id, as text: ``id``, else OpenAI's ``custom_id``, else ``line-<lineno>``
    (a key that is missing, null or the empty string gives no id; ``0`` and ``false`` do)."""
    if isinstance(data, dict):
        for key in ("id", "custom_id"):
            if data.get(key) is not None and data[key] != "":
                return str(data[key])
    return f"line-{lineno}"


@dataclass
class Request:
    """A request handed to :func:`run_requests`."""

    id: str
    params: Any  # vllm.SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    line: int | None = None  # the input line, named in an error record


def run_requests(llm: Any, requests: Iterator[Request | dict[str, Any]], on_done: Callable[[dict[str, Any]], None],
                 total: int | None = None, max_open: int = 16, desc: str = "sfi-vllm batch",
                 progress: bool = True, total_tokens: int | None = None) -> dict[str, Any]:
    """Run ``requests`` through ``llm`` (a ``vllm.LLM``), keeping at most ``max_open`` in the engine,
    and call ``on_done`` with each one's record as it finishes. An item of ``requests`` that is a
    dict is an error record already made; it is passed on as it is. A request the engine refuses
    (e.g. a prompt too long) becomes an error record too. Records of finished requests hold the
    output (``text``, ``token_ids``, ``finish_reason``, token counts, ``logprobs`` if asked for) and,
    where the engine's SFI controller runs in this process, ``sfi_stats``. Shows a tqdm bar with
    the generated tokens/s: of finished requests out of ``total``, or, with ``total_tokens``, of
    generated tokens (it moves at every step). Returns totals: requests, errors, generated tokens,
    seconds."""
    from tqdm import tqdm

    from sfi_vllm.controller import current_controller, external_request_id

    if max_open < 1:
        raise ValueError(f"max_open must be at least 1, got {max_open}")
    engine = llm.llm_engine
    ctl = current_controller()
    # enqueue returns the engine's internal request ids; outputs carry the external ones
    open_reqs: dict[str, str] = {}  # vLLM's external request id -> ours
    internal: dict[str, str] = {}  # external -> internal (the worker's statistics are keyed by it)
    seen_tokens: dict[str, int] = {}
    totals = dict(requests=0, errors=0, generated_tokens=0)
    t0 = time.perf_counter()
    by_tokens = total_tokens is not None
    bar = tqdm(total=total_tokens if by_tokens else total, desc=desc, unit="tok" if by_tokens else "req",
               disable=not progress, dynamic_ncols=True)
    pending = iter(requests)
    exhausted = False
    last_shown = 0.0

    def finish(rec: dict[str, Any]) -> None:
        totals["requests"] += 1
        totals["errors"] += rec.get("error") is not None
        on_done(rec)
        if not by_tokens:
            bar.update(1)

    while True:
        while not exhausted and len(open_reqs) < max_open:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            if isinstance(item, dict):
                finish(item)
                continue
            try:
                if item.messages is not None:
                    (rid,) = llm.enqueue_chat([item.messages], [item.params], use_tqdm=False)
                elif item.prompt_token_ids is not None:
                    (rid,) = llm.enqueue([{"prompt_token_ids": item.prompt_token_ids}], [item.params],
                                         use_tqdm=False)
                else:
                    (rid,) = llm.enqueue([item.prompt], [item.params], use_tqdm=False)
            except Exception as e:  # the engine refused it: record and go on
                rec = dict(id=item.id, line=item.line) if item.line is not None else dict(id=item.id)
                message = _prompt_too_long(llm, item, e) or f"{type(e).__name__}: {e}"
                finish(dict(rec, error=" ".join(message.split())))
                continue
            open_reqs[external_request_id(rid)] = item.id
            internal[external_request_id(rid)] = rid
        if not open_reqs:
            if exhausted:
                break
            continue
        if not engine.has_unfinished_requests():
            for rid, our_id in open_reqs.items():  # cannot happen unless vLLM dropped a request
                finish(dict(id=our_id, error="the engine finished without an output for this request"))
            open_reqs.clear()
            continue
        for o in engine.step():
            if o.request_id not in open_reqs:
                continue
            n = len(o.outputs[0].token_ids)
            totals["generated_tokens"] += n - seen_tokens.get(o.request_id, 0)
            if by_tokens:
                bar.update(n - seen_tokens.get(o.request_id, 0))
            seen_tokens[o.request_id] = n
            if not o.finished:
                continue
            our_id = open_reqs.pop(o.request_id)
            seen_tokens.pop(o.request_id, None)
            rec = _record(our_id, o)
            if ctl is not None:
                st = ctl.stats.lookup(internal.pop(o.request_id))
                if st is not None:
                    rec["sfi_stats"] = st.to_dict()
            finish(rec)
        elapsed = time.perf_counter() - t0
        if not by_tokens and elapsed - last_shown >= 0.5:  # the rate moves at every step; redraw twice a second
            last_shown = elapsed
            bar.set_postfix_str(f"{totals['generated_tokens'] / max(elapsed, 1e-9):.1f} tok/s")
    totals["seconds"] = time.perf_counter() - t0
    if not by_tokens:  # the final rate, also for a run shorter than one redraw
        bar.set_postfix_str(f"{totals['generated_tokens'] / max(totals['seconds'], 1e-9):.1f} tok/s")
    bar.close()
    return totals


def _prompt_too_long(llm: Any, item: Request, error: Exception) -> str | None:
    """The message for a prompt longer than ``max_model_len`` (None for other errors, and where
    the count here does not confirm it). vLLM's offline check stops tokenizing one token past the
    limit and quotes 0 output tokens, so its message gives neither the prompt's length nor the
    request's ``max_tokens``; this counts the prompt's tokens (chat: Hugging Face's rendering of
    the template)."""
    if getattr(error, "parameter", None) != "input_tokens":
        return None
    try:
        limit = int(llm.llm_engine.model_config.max_model_len)
        if item.prompt_token_ids is not None:
            n = len(item.prompt_token_ids)
        else:
            tokenizer = llm.get_tokenizer()
            if item.messages is not None:
                text = tokenizer.apply_chat_template(item.messages, tokenize=False, add_generation_prompt=True)
                n = len(tokenizer.encode(text, add_special_tokens=False))
            else:
                n = len(tokenizer.encode(item.prompt))
    except Exception:  # noqa: BLE001 (the count is a courtesy: vLLM's own message stands without it)
        return None
    if n <= limit:  # counted otherwise than vLLM renders it (a chat template's content format): its message stands
        return None
    return (f"the prompt has {n} tokens, more than max_model_len ({limit}): shorten it, or run with a "
            "larger --max-model-len")


def _record(our_id: str, o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    rec: dict[str, Any] = dict(id=our_id, text=c.text, finish_reason=c.finish_reason,
                               prompt_tokens=len(o.prompt_token_ids or []), completion_tokens=len(c.token_ids),
                               token_ids=list(c.token_ids))
    if c.logprobs is not None:
        rec["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]
    return rec


def _requests(lines: list[tuple[int, str]], skip: set[str], make_params: Callable[[BatchLine], Any],
              check_sfi: Callable[[str, dict[str, Any]], None]) -> Iterator[Request | dict[str, Any]]:
    """The input lines as :class:`Request` objects, or error records for lines that cannot run."""
    from sfi_vllm.config import SFIConfigError
    from sfi_vllm.request_config import sfi_entries

    for lineno, text in lines:
        try:
            rid, req = parse_line(text, lineno)
        except LineError as e:
            rid, msg = e.args
            if rid in skip:
                continue
            yield dict(id=rid, line=lineno, error=msg)
            continue
        if rid in skip:
            continue
        try:
            extra = req.sampling.get("extra_args")
            if req.sfi or sfi_entries(extra):
                check_sfi(rid, {**(extra if isinstance(extra, dict) else {}), **({"sfi": req.sfi} if req.sfi else {})})
            params = make_params(req)
        except (SFIConfigError, UnknownSamplingField) as e:
            yield dict(id=rid, line=lineno, error=" ".join(str(e).split()))
            continue
        except Exception as e:  # SamplingParams refused the sampling fields' values (the message names them)
            yield dict(id=rid, line=lineno, error=" ".join(str(e).split()))
            continue
        yield Request(id=rid, params=params, prompt=req.prompt, messages=req.messages, line=lineno)


def left_to_run(in_path: str | Path, out_path: str | Path, retry_errors: bool = False) -> tuple[int, int, int]:
    """``(lines, to run, earlier errors)`` of a batch before its engine loads: the input's
    requests, those not yet in the output (``run_batch`` skips the others), and those whose record
    there is an error that stays (not ``retry_errors``)."""
    in_path, out_path = Path(in_path), Path(out_path)
    lines = read_input_lines(in_path, out_path)
    skip = done_ids(out_path, retry_errors)
    ids = [_peek_id(t, i) for i, t in lines]
    earlier = 0 if retry_errors else len(set(ids) & earlier_error_ids(out_path))
    return len(ids), sum(1 for rid in ids if rid not in skip), earlier


def _runs_sfi(llm: Any) -> bool:
    """Whether ``llm``'s engine runs the SFI backend (registered as vLLM's CUSTOM backend)."""
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    backend = getattr(getattr(cfg, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) == "CUSTOM"


def run_batch(in_path: str | Path, out_path: str | Path, llm: Any, max_tokens: int = 256,
              max_open: int = 16, retry_errors: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run every request of ``in_path`` not yet in ``out_path`` through ``llm`` (module doc)."""
    import msgspec
    from vllm import SamplingParams

    from sfi_vllm.controller import current_controller
    from sfi_vllm.request_config import sfi_entries

    in_path, out_path = Path(in_path), Path(out_path)
    lines = read_input_lines(in_path, out_path)
    skip = done_ids(out_path, retry_errors)
    # the model's generation_config.json defaults (temperature, top_p, ...), as `vllm serve` uses them
    defaults = dict(llm.model_config.get_diff_sampling_param() or {})
    ctl = current_controller()
    # vLLM's SamplingParams is a msgspec Struct: its public fields are what a line may set
    fields = {f.name for f in msgspec.structs.fields(SamplingParams) if not f.name.startswith("_")}

    def make_params(req: BatchLine) -> Any:
        check_sampling_fields(req.sampling, fields, req._sampling_path)
        kw = {**defaults, "max_tokens": max_tokens, **req.sampling}  # --max-tokens over the model's default
        extra = dict(kw.pop("extra_args", None) or {})
        if isinstance(kw.get("logit_bias"), dict):
            kw["logit_bias"] = token_id_keys(kw["logit_bias"], "sampling.logit_bias")
        if req.sfi:
            extra["sfi"] = req.sfi
        return SamplingParams(**kw, extra_args=extra or None)

    sfi_engine = _runs_sfi(llm)
    unused = []  # ids of the submitted requests whose SFI settings an engine without SFI does not use

    def check_sfi(rid: str, extra_args: dict[str, Any]) -> None:
        # Where the controller is in this process, a bad request setting is this line's error. With
        # the controller in other processes (several workers), vLLM's front end checks the request
        # when it is submitted (sfi_vllm.patches.request_check) and the line records that error.
        # An engine without SFI runs the line without them, as such a `vllm serve` does (said on
        # stderr): the same file then gives the dense reference.
        if sfi_engine and ctl is not None:
            ctl.request_config(extra_args)

    def submitted(requests: Iterator[Request | dict[str, Any]]) -> Iterator[Request | dict[str, Any]]:
        for r in requests:
            if not sfi_engine and isinstance(r, Request) and sfi_entries(r.params.extra_args):
                unused.append(r.id)
            yield r

    out_path.parent.mkdir(parents=True, exist_ok=True)
    ids = [_peek_id(t, i) for i, t in lines]
    todo = sum(1 for rid in ids if rid not in skip)
    # the input's ids whose record in the output is an error: skipped, unless retry_errors
    earlier = 0 if retry_errors else len(set(ids) & earlier_error_ids(out_path))
    with open(out_path, "a") as f:
        def write(rec: dict[str, Any]) -> None:
            rec.pop("token_ids", None)
            f.write(json.dumps(rec) + "\n")
            f.flush()

        totals = run_requests(llm, submitted(_requests(lines, skip, make_params, check_sfi)), write, total=todo,
                              max_open=max_open, progress=progress)
    totals["skipped"] = len(lines) - todo
    totals["earlier_errors"] = earlier
    totals["sfi_settings_unused"] = len(unused)
    return totals


class UnknownSamplingField(ValueError):
    """A line's ``sampling`` object names a field that vLLM's ``SamplingParams`` does not have."""


def check_sampling_fields(sampling: dict[str, Any], fields: set[str], path: str = "sampling") -> None:
    """Refuse the first key of ``sampling`` that is not one of ``fields`` (vLLM's public
    ``SamplingParams`` fields), naming it by its path in the line (``path``: "sampling", or
    "body" for a run-batch line) and the nearest field."""
    import difflib

    for key in sampling:
        if key not in fields:
            near = difflib.get_close_matches(key, sorted(fields), n=1)
            raise UnknownSamplingField(f"{path}.{key}: not a field of vLLM's SamplingParams"
                                       + (f"; did you mean {near[0]!r}?" if near else ""))


def token_id_keys(bias: dict[Any, Any], name: str) -> dict[int, Any]:
    """``bias`` with its keys as token ids: a JSON object's keys are strings (``{"1234": 5}``), and
    vLLM's ``SamplingParams.logit_bias`` wants integers, as its OpenAI server converts them."""
    out: dict[int, Any] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except (TypeError, ValueError):
            raise ValueError(f"{name}: keys are token ids (integers); got {key!r}") from None
    return out


def _peek_id(text: str, lineno: int) -> str:
    try:
        return parse_line(text, lineno)[0]
    except LineError as e:
        return e.args[0]


def engine_env_for_this_process() -> None:
    """Environment an in-process engine needs, set before the engine is built (vLLM reads these
    variables when it builds one, not at import): the engine core in this
    process (so the controller's statistics can be read), and on a CPU machine the thread binding
    and KV-cache size of :func:`sfi_vllm.tools.engine_job.cpu_engine_env` unless already set."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    if not torch.cuda.is_available():
        from sfi_vllm.tools.engine_job import cpu_engine_env

        for k, v in cpu_engine_env().items():
            os.environ.setdefault(k, v)
