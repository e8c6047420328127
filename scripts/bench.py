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

from _common import integer, parse_key_values, split_list

OPTIONS = {
    "configs": "comma-separated VOCAB-SIZE[:scheme+scheme...], VOCAB byte|gpt2, SIZE a conf/model file "
               "(default: byte-tiny:all,byte-small:learned+alibi,gpt2-tiny:learned)",
    "schemes": "comma-separated schemes, or all, for configs without their own list (default all)",
    "precision": "comma-separated bf16-mixed and/or 32 (default bf16-mixed)",
    "compile": "comma-separated false and/or true (default false)",
    "rounds": "timed rounds (default 10)",
    "steps": "timed consecutive steps per path per round, after one untimed (default 4)",
    "warmup": "untimed steps per path first (default 2)",
    "batch_size": "sequences per step (default 16)",
    "block_size": "training length (default: the conf/model file's, 256)",
    "eval": "evaluation time and memory at eval_factor x the training length (default true)",
    "eval_factor": "comma-separated multiples of the training length (default 16); with several, every "
                   "evaluation runs one sequence and each row gets eval_curve and eval_mem_exponent",
    "memory": "peak training memory in a child process (default true)",
    "loop": "also time pelab's GPT (learned) in the reference's plain loop, path pelab-loop: splits "
            "pelab vs the reference into the model and the Lightning loop (default true)",
    "documents": "none (default), mask or both: each scheme also timed on packed documents, document_mask "
                 "(both: and document_positions); its row has step_ratio_vs_same_scheme",
    "doc_length": "mean document length of those packed windows in tokens (default: a quarter of block_size)",
    "documents_schemes": "comma-separated schemes that get the documents rows (default: every scheme of the config)",
    "variants": "comma-separated sets of model options, KEY=VALUE;KEY=VALUE each (YAML values; commas inside "
                "[] stay): each scheme is also timed with each set, against itself without "
                "(e.g. variants=sinks=learned,window_pattern=[128,null])",
    "variant_schemes": "comma-separated schemes that get the variants rows (default: every scheme of the config)",
    "warmup_parallel": "paths warmed up (compiled) at once, never timed; the timed rounds stay one path at a time "
                       "(default 1)",
    "device": "cpu or cuda (default: cuda when available)",
    "out": "also write the JSON lines to this file",
    "smoke": "true: byte-tiny, learned+alibi, float32, 2 steps, 1 round, eager, batch 4, eval at 2x (the test suite's "
             "run; float32: bf16 matmuls are emulated on CPUs without native bf16)",
}
SMOKE = {"configs": "byte-tiny", "schemes": "learned,alibi", "precision": "32", "compile": "false",
         "rounds": "1", "steps": "2", "warmup": "1", "batch_size": "4", "eval_factor": "2"}
DEFAULT_CONFIGS = "byte-tiny:all,byte-small:learned+alibi,gpt2-tiny:learned"


def truthy(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"expected true or false, got {value!r}")


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
    from dataclasses import fields

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
    known = {f.name for f in fields(GPTConfig)}
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


def configs_of(args: dict) -> list[tuple[str, list[str]]]:
    """(config, schemes) pairs; a config's own ``:a+b`` list wins unless ``schemes=`` is given."""
    default_schemes = args.get("schemes", "all")
    configs = []
    for item in split_list(args.get("configs", DEFAULT_CONFIGS)):
        cfg, _, own = item.partition(":")
        if own and "schemes" not in args:
            configs.append((cfg, schemes_of(own)))
        else:
            configs.append((cfg, schemes_of(",".join(split_list(default_schemes))) if default_schemes != "all"
                            else schemes_of("all")))
    return configs


def bench_group(cfg: str, schemes: list[str], precision: str, compiles: list[bool], opts: dict, children
                ) -> list[dict]:
    """Time every path of one config and precision, then measure memory and evaluation; rows
    per compile setting (eager first)."""
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
        group_rows = timing_rows(cfg, model, precision, compile_, group, eager, opts, load_avg, peak, peak_source)
        add_memory_and_eval(group_rows, cfg, model, precision, compile_, opts, children)
        rows += group_rows
    return rows


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    if truthy(args.get("smoke", "false")):
        args = SMOKE | args
    configs = configs_of(args)
    documents_schemes = schemes_of(args["documents_schemes"]) if "documents_schemes" in args else None
    variants = variants_of(args["variants"]) if "variants" in args else []
    variant_schemes = schemes_of(args["variant_schemes"]) if "variant_schemes" in args else None
    if variant_schemes and not variants:
        raise SystemExit("variant_schemes= needs variants=")
    if documents_schemes:  # checked before anything is built
        if args.get("documents", "none") == "none":
            raise SystemExit("documents_schemes= needs documents=mask or documents=both")
        for cfg, schemes in configs:
            if extra := sorted(set(documents_schemes) - set(schemes)):
                raise SystemExit(f"documents_schemes: {extra} not among the schemes of config {cfg} "
                                 f"({', '.join(schemes)})")
    import torch

    from benchkit.harness import Children, peak_flops, quiet
    from benchkit.report import print_table, print_targets

    quiet()
    precisions = [{"bf16": "bf16-mixed", "32-true": "32", "fp32": "32"}.get(p, p)
                  for p in split_list(args.get("precision", "bf16-mixed"))]
    for p in precisions:
        if p not in ("bf16-mixed", "32"):
            raise SystemExit(f"precision {p!r}: expected bf16-mixed or 32")
    compiles = sorted({truthy(c) for c in split_list(args.get("compile", "false"))})  # eager first
    opts = {"rounds": int(args.get("rounds", 10)), "steps": int(args.get("steps", 4)),
            "warmup": int(args.get("warmup", 2)), "batch_size": int(args.get("batch_size", 16)),
            "block_size": int(args["block_size"]) if "block_size" in args else None,
            "eval": truthy(args.get("eval", "true")),
            "eval_factors": [int(f) for f in split_list(str(args.get("eval_factor", 16)))],
            "memory": truthy(args.get("memory", "true")),
            "loop": truthy(args.get("loop", "true")),
            "documents": args.get("documents", "none"),
            "doc_length_arg": int(args["doc_length"]) if "doc_length" in args else None,
            "documents_schemes": documents_schemes,
            "variants": variants, "variant_schemes": variant_schemes,
            "warmup_parallel": integer("warmup_parallel", args.get("warmup_parallel", "1"), minimum=1),
            "device": args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"), "eval_cache": {}}
    if opts["documents"] not in ("none", "mask", "both"):
        raise SystemExit(f"documents={opts['documents']!r}: expected none, mask or both")
    if opts["rounds"] < 1 or opts["steps"] < 1 or opts["warmup"] < 1:
        raise SystemExit("rounds, steps and warmup must be >= 1")
    # the matmul peak is measured first, on a machine the bench has not loaded yet
    opts["peaks"] = {p: peak_flops(opts["device"], p) for p in precisions}
    children = Children()
    out = open(args["out"], "w") if "out" in args else None  # noqa: SIM115
    print(f"[bench] device={opts['device']} threads={torch.get_num_threads()} batch={opts['batch_size']} "
          f"rounds={opts['rounds']} steps={opts['steps']} warmup={opts['warmup']} load={os.getloadavg()}",
          flush=True)
    rows = []
    try:
        for cfg, schemes in configs:
            for precision in precisions:
                t0 = time.perf_counter()
                group = bench_group(cfg, schemes, precision, compiles, opts, children)
                print(f"[bench] {cfg} {precision} compile={','.join(str(c) for c in compiles)}: "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
                for row in group:
                    line = json.dumps(row)
                    print("BENCH_JSON " + line, flush=True)
                    if out:
                        out.write(line + "\n")
                        out.flush()
                rows += group
    finally:
        if out:
            out.close()
    print_table(rows)
    print_targets(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
