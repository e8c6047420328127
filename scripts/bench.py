"""Training-speed benchmark: pelab's real training path against an independent plain-PyTorch loop.

    python scripts/bench.py                                    # CPU default, 8-17 min on 2 cores
    python scripts/bench.py configs=byte-tiny,gpt2-tiny precision=bf16-mixed,32 compile=false,true \\
        schemes=learned,rope,alibi rounds=12 out=bench.jsonl
    python scripts/bench.py smoke=true                         # seconds: what tests/scripts/test_bench.py runs

Prints a table and one ``BENCH_JSON {...}`` line per row (also written to ``out=FILE``). The
protocol, the JSON fields and how to read the intervals: docs/benchmark.md. The code is in
scripts/benchkit/ (reference model, timed paths, harness, probes, report).
"""

from __future__ import annotations

import json
import os
import sys
import time

from _cli import command_line
from _common import choice, flag, integer, items, path_option, split_list

SMOKE = ["configs=byte-tiny", "schemes=learned,alibi", "precision=32", "compile=false", "rounds=1", "steps=2",
         "warmup=1", "batch_size=4", "eval_factor=2"]


def schemes_of(spec: str) -> list[str]:
    """``all``, ``a+b`` or ``a,b`` as registered scheme names, learned first."""
    from model.pe import SCHEMES

    names = sorted(SCHEMES) if spec == "all" else spec.split("+") if "+" in spec else split_list(spec)
    names = sorted(set(names), key=lambda s: (s != "learned", s))
    unknown = [s for s in names if s not in SCHEMES]
    if unknown:
        raise SystemExit(f"unknown schemes {unknown}; registered: {', '.join(sorted(SCHEMES))}")
    return names


def variants_of(spec: str) -> list[str]:
    """The option sets of ``variants=``: split at the commas outside brackets, each checked as
    model options (GPTConfig's keys and values) before anything is built."""
    import inspect

    from benchkit.paths import path_parts
    from model.config import GPTConfig

    found, depth, item = [], 0, ""
    for ch in spec + ",":
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if item.strip():
                found.append(item.strip())
            item = ""
        else:
            item += ch
    known = set(inspect.signature(GPTConfig).parameters)  # the fields and model.sinks, the old spelling
    for variant in found:
        options = path_parts(f"x@{variant}")[2]
        if not options or any(k not in known for k in options):
            raise SystemExit(f"variants: {variant!r} is not KEY=VALUE;KEY=VALUE with model options "
                             f"({', '.join(sorted(known))})")
        try:
            GPTConfig(vocab_size=256, block_size=1024, n_layer=12, n_head=12, n_embd=768, **options)
        except ValueError as e:
            raise SystemExit(f"variants: {variant!r}: {e}") from None
    return found


def configs_of(spec: str, schemes: str = "") -> list[tuple[str, list[str]]]:
    """(config, schemes) pairs; a config's own ``:a+b`` list wins unless ``schemes=`` is given."""
    default_schemes = schemes or "all"
    configs = []
    for item in split_list(spec):
        cfg, _, own = item.partition(":")
        if own and not schemes:
            configs.append((cfg, schemes_of(own)))
        else:
            configs.append((cfg, schemes_of(",".join(split_list(default_schemes))) if default_schemes != "all"
                            else schemes_of("all")))
    return configs


def bench_group(cfg: str, schemes: list[str], precision: str, compiles: list[bool], opts: dict, children,
                emit=lambda row: None) -> list[dict]:
    """Time every path of one config and precision (together: their rounds interleave), then
    measure each row's memory and evaluation; rows per compile setting (eager first), each given
    to ``emit`` as soon as it is complete, so a bench stopped midway has written what it measured."""
    from benchkit.conf import model_config
    from benchkit.harness import time_paths
    from benchkit.probes import add_memory_and_eval
    from benchkit.report import timing_rows

    model = model_config(cfg, opts["block_size"])
    base = list(schemes)
    if opts["documents"] != "none":
        opts["doc_length"] = opts["doc_length_arg"] or max(2, model["block_size"] // 4)
        wanted = opts["documents_schemes"] or schemes
        schemes = schemes + [f"{s}+{opts['documents']}" for s in schemes if s in wanted]
    if opts["variants"]:
        wanted = opts["variant_schemes"] or base
        schemes = schemes + [f"{s}@{v}" for s in base if s in wanted for v in opts["variants"]]
    paths, load_avg = time_paths(model, schemes, precision, compiles, opts, children)
    peak, peak_source = opts["peaks"][precision]
    rows = []
    for compile_ in compiles:
        group = {name: p for (name, c), p in paths.items() if c == compile_}
        eager = {name: p for (name, c), p in paths.items() if not c} if compile_ and False in compiles else {}
        for row in timing_rows(cfg, model, precision, compile_, group, eager, opts, load_avg, peak, peak_source):
            add_memory_and_eval([row], cfg, model, precision, compile_, opts, children)
            emit(row)
            rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    args = command_line("bench", argv, __doc__)
    if args is None:
        return 0
    if flag("smoke", args.smoke):  # its settings, under the keys given
        args = command_line("bench", [*SMOKE, *argv], __doc__)
    configs = configs_of(args.configs, args.schemes)
    documents_schemes = schemes_of(args.documents_schemes) if args.documents_schemes else None
    variants = variants_of(args.variants) if args.variants else []
    variant_schemes = schemes_of(args.variant_schemes) if args.variant_schemes else None
    if variant_schemes and not variants:
        raise SystemExit("variant_schemes= needs variants=")
    if documents_schemes:  # checked before anything is built
        if args.documents == "none":
            raise SystemExit("documents_schemes= needs documents=mask or documents=both")
        for cfg, schemes in configs:
            if extra := sorted(set(documents_schemes) - set(schemes)):
                raise SystemExit(f"documents_schemes: {extra} not among the schemes of config {cfg} "
                                 f"({', '.join(schemes)})")
    import torch

    from benchkit.harness import Children, peak_flops, quiet
    from benchkit.report import print_table, print_targets

    quiet()
    precisions = [{"bf16": "bf16-mixed", "32-true": "32", "fp32": "32"}.get(p, p) for p in split_list(args.precision)]
    for p in precisions:
        choice("precision", p, ("bf16-mixed", "32"))
    compiles = sorted({flag("compile", c) for c in split_list(args.compile)})  # eager first
    opts = {"rounds": integer("rounds", args.rounds, minimum=1), "steps": integer("steps", args.steps, minimum=1),
            "warmup": integer("warmup", args.warmup, minimum=1),
            "batch_size": integer("batch_size", args.batch_size, minimum=1),
            "block_size": None if args.block_size is None else integer("block_size", args.block_size, minimum=1),
            "eval": flag("eval", args.eval),
            "eval_factors": [integer("eval_factor", f, minimum=1) for f in items(args.eval_factor)],
            "memory": flag("memory", args.memory),
            "loop": flag("loop", args.loop),
            "documents": choice("documents", args.documents, ("none", "mask", "both")),
            "doc_length_arg": None if args.doc_length is None else integer("doc_length", args.doc_length, minimum=1),
            "documents_schemes": documents_schemes,
            "variants": variants, "variant_schemes": variant_schemes,
            "warmup_parallel": integer("warmup_parallel", args.warmup_parallel, minimum=1),
            "device": str(args.device or ("cuda" if torch.cuda.is_available() else "cpu")), "eval_cache": {}}
    if args.out is not None:  # a file this user can write (data/paths.py), before anything is timed
        path_option("output_file", "out", args.out)
    # the matmul peak is measured first, on a machine the bench has not loaded yet
    opts["peaks"] = {p: peak_flops(opts["device"], p) for p in precisions}
    children = Children()
    out = open(str(args.out), "w") if args.out is not None else None  # noqa: SIM115
    print(f"[bench] device={opts['device']} threads={torch.get_num_threads()} batch={opts['batch_size']} "
          f"rounds={opts['rounds']} steps={opts['steps']} warmup={opts['warmup']} load={os.getloadavg()}",
          flush=True)
    rows = []

    def emit(row: dict) -> None:  # each row printed and appended the moment it is complete
        line = json.dumps(row)
        print("BENCH_JSON " + line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    try:
        for cfg, schemes in configs:
            for precision in precisions:
                t0 = time.perf_counter()
                rows += bench_group(cfg, schemes, precision, compiles, opts, children, emit)
                print(f"[bench] {cfg} {precision} compile={','.join(str(c) for c in compiles)}: "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if out:
            out.close()
    print_table(rows)
    print_targets(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
