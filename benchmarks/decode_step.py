"""One decode step of DP attention's serving path, engine-free: where the layer time goes.

``bench serve``'s steady rows time a whole engine (seconds per run, +-20% on this VM). This
isolates what DP attention adds per layer and step: serving's ``DPImplMixin`` (the K/V write and
``forward``: the exact public part through the fused kernel, the DP answer from a released
``dp_state`` context, the merge) over a stand-in parent, ``--batch`` requests each decoding one
token ``--public`` rows after a private context of ``--context`` rows, one thread, no engine.
It reports CPU ms per step (``--layers`` layers; median of ``--repeats`` runs of ``--steps``
steps) and a ``torch.profiler`` table of the step: per operator and per Python function.

The context's K/V are random and its bounds fixed (``HeadMapping`` below): the timing does not
depend on their values. Defaults: the demo Llama's attention (4 query heads, 2 KV heads, head
dim 32, 2 layers), P = 2048, 128 requests, 74 public rows, Taylor degree 2 (the ``bench serve``
row). Writes ``decode-step-<device>-<date>.md`` and ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import types
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import with_example
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment, loadavg
from vllm_dp_plugin.benchmarks.lib.progress import logger

log = logger(True)
from vllm_dp_plugin.benchmarks.lib.report import suffixed, table, write_json, write_text

BLOCK_SIZE = 32


def released_layer(args: argparse.Namespace, key_file: Path):
    """A ``PrivateContextLayer`` (``dp_state``, eps 8) over ``args.context`` random rows, released."""
    from vllm_dp_plugin.attention.mapping import HeadMapping
    from vllm_dp_plugin.attention.params import DPAttentionParams
    from vllm_dp_plugin.attention.private_context import HeadLayout, PrivateContextLayer
    from vllm_dp_plugin.privacy.keyed_noise import NoiseKey

    d, kv = args.head_dim, args.kv_heads
    params = DPAttentionParams(8.0, 1e-6, scope="layer", degree=args.degree, max_context=args.context)
    mapping = HeadMapping(d**-0.5, 1.0, 1.0, 1.0, key_norm=2.0, query_norm=2.0,
                          key_center=torch.zeros(kv, d, dtype=torch.float64))
    layer = PrivateContextLayer(params, mapping, 0, HeadLayout(kv, args.heads, 0, kv), d, args.context, budget_heads=kv)
    g = torch.Generator().manual_seed(0)
    layer.collect(torch.arange(args.context), *(torch.randn(args.context, kv, d, generator=g) for _ in range(2)))
    layer.release(NoiseKey(key_file), "decode-step")
    return layer


def decode_step(args: argparse.Namespace, dp) -> callable:
    """A function running one decode step (K/V write + forward of ``args.layers`` layers) through
    serving's DP impl, every request at position ``context + public``."""
    from vllm.v1.attention.backend import AttentionType

    from vllm_dp_plugin.attention.paged import BatchLayout
    from vllm_dp_plugin.serving import backend
    from vllm_dp_plugin.serving.batch_contexts import BatchContexts

    class Parent:  # vLLM's cache write: not DP's cost
        def do_kv_cache_update(self, *args):
            pass

    class Impl(backend.DPImplMixin, Parent):
        attn_type = AttentionType.DECODER

    b, h, d, kv, p = args.batch, args.heads, args.head_dim, args.kv_heads, args.context
    impl = Impl()
    impl._dp_on, impl._fused_exact = True, backend.fused_available()
    impl.num_heads, impl.head_size, impl.scale = h, d, d**-0.5
    impl._private_layer = lambda layer, c: dp
    blocks = (p + args.public) // BLOCK_SIZE + 1
    g = torch.Generator().manual_seed(1)
    caches = tuple(torch.randn(b * blocks, kv, BLOCK_SIZE, d, generator=g) for _ in range(2))
    impl._paged_kv = lambda kv_cache, layer: caches
    pos = torch.full((b,), p + args.public - 1)
    table_ = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks)
    contexts = BatchContexts(torch.zeros(b, dtype=torch.long), torch.full((b,), p),
                             torch.zeros(b, dtype=torch.long), torch.full((b,), p))
    q, k = torch.randn(b, h, d, generator=g), torch.randn(b, kv, d, generator=g)
    out, slots = torch.empty(b, h * d), torch.arange(b)
    layers = [types.SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn") for i in range(args.layers)]

    def step() -> None:
        md = types.SimpleNamespace(dp_layout=BatchLayout(torch.arange(b + 1, dtype=torch.int32), pos + 1, pos, table_),
                                   dp_contexts=contexts)
        with forward_context(md):
            for layer in layers:
                impl.do_kv_cache_update(layer, k, k, None, slots)
                impl.forward(layer, q, k, k, None, md, out)

    return step


@contextlib.contextmanager
def forward_context(md):
    """vLLM's forward context holding ``md`` (what the K/V write reads), for one step."""
    import vllm.forward_context as fc

    saved = fc.get_forward_context
    fc.get_forward_context = lambda: types.SimpleNamespace(attn_metadata=md)
    try:
        yield
    finally:
        fc.get_forward_context = saved


def profile_tables(step, steps: int, rows: int) -> dict[str, str]:
    """torch.profiler over ``steps`` steps: per operator (self CPU) and per function of the
    plugin (total CPU per step, calls per step), largest first."""
    from torch.profiler import profile

    with profile(with_stack=True) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    by_op = events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    plugin = sorted((e for e in events if "vllm_dp_plugin/" in e.key and e.count >= steps  # not the callers
                     and "/benchmarks/" not in e.key),
                    key=lambda e: -e.cpu_time_total)[:rows]
    by_function = table(["function", "CPU ms per step (total)", "calls per step"],
                        [[f"`{e.key.split('vllm_dp_plugin/')[-1]}`", f"{e.cpu_time_total / steps / 1e3:.3f}",
                          f"{e.count / steps:g}"] for e in plugin])
    return {"operators": by_op, "functions": by_function}


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        step = decode_step(args, released_layer(args, Path(tmp) / "noise.key"))
        for _ in range(3):  # warm-up: kernels loaded, per-dtype caches filled
            step()
        ms = []
        for r in range(args.repeats):
            start = time.process_time()
            for _ in range(args.steps):
                step()
            ms.append((time.process_time() - start) / args.steps * 1e3)
            log(f"repeat {r + 1}: {ms[-1]:.2f} CPU ms per step")
        tables = profile_tables(step, max(1, args.steps // 5), args.rows)
    return {"command": command_line("python -m benchmarks.decode_step", argv), "settings": vars(args) | {"out": str(args.out)},
            "environment": environment("cpu"), "loadavg": loadavg(), "ms_per_step": ms,
            "median_ms_per_step": statistics.median(ms), "profile": tables}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# python -m benchmarks.decode_step ({device_label('cpu', short=True)}, {s['date']})", "",
        (f"Command: `{result['command']}`. One decode step of DP attention's serving path (K/V write + forward of "
        f"{s['layers']} layers; {s['batch']} requests, {s['heads']} query / {s['kv_heads']} KV heads of dim "
        f"{s['head_dim']}, a released dp_state context of {s['context']} rows, degree {s['degree']}, {s['public']} "
        f"public rows each), one thread, no engine. Load average at the end: {result['loadavg']}."), "",
        table(["repeat", "CPU ms per step"], [[i + 1, f"{m:.2f}"] for i, m in enumerate(result["ms_per_step"])]), "",
        (f"Median: **{result['median_ms_per_step']:.2f} CPU ms per step** "
        f"({result['median_ms_per_step'] / s['layers']:.2f} per layer)."), "",
        "## Where the step goes: per operator (self CPU)", "", "```", result["profile"]["operators"], "```", "",
        "## Per function of the plugin (total CPU, callees included)", "", result["profile"]["functions"], "",
    ]
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--batch", type=int, default=128, help="requests decoding one token each (default 128)")
    p.add_argument("--context", type=int, default=2048, help="private context rows P (default 2048)")
    p.add_argument("--public", type=int, default=74, help="public rows per request after P, the new one included")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4, the demo Llama)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--head-dim", type=int, default=32, help="head dimension (default 32)")
    p.add_argument("--layers", type=int, default=2, help="layers per step (default 2)")
    p.add_argument("--degree", type=int, default=2, help="Taylor degree of dp_state (default 2)")
    p.add_argument("--steps", type=int, default=100, help="steps per repeat (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported (default 3)")
    p.add_argument("--rows", type=int, default=25, help="rows of each profile table (default 25)")
    add_quick_arg(p, "4 requests, 64 private rows, 2 steps, 1 repeat (a smoke run)")
    add_date_arg(p)
    return add_out_arg(p)


@with_example
def build_parser(prog: str = "python -m benchmarks.decode_step") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    args, argv = parse(args, build_parser)
    if args.quick:
        args.batch, args.context, args.public, args.steps, args.repeats = 4, 64, 8, 2, 1
    args.date = today(args.date)
    result = run(args, argv)
    stem = Path(args.out) / f"decode-step-{device_label('cpu', short=True)}-{args.date}"
    write_json(suffixed(stem, ".json"), result)
    path = write_text(suffixed(stem, ".md"), markdown(result))
    log(f"{result['median_ms_per_step']:.2f} CPU ms per step; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
