"""Build a data config's token cache ahead of training (on a CPU node, before the GPU job).

    python scripts/prepare_data.py                                   # the default data (embedded corpus)
    python scripts/prepare_data.py data=fineweb_edu data.tokenize_num_proc=16
    python scripts/prepare_data.py data=text data.paths=[corpus/] data.tokenizer=/models/llama3/tokenizer.json
    PELAB_CACHE=/scratch/pelab python scripts/prepare_data.py data=openwebtext

The arguments are train.py's overrides, composed from conf/ the same way (Hydra's compose
API: nothing is written but the cache), so the cache lands where the training run looks for
it (``data.data_dir``, else ``$PELAB_CACHE/data``) and that run tokenizes nothing. Give the
data overrides of the sweep (not its ``-m`` lists): every job of the sweep then finds the
cache built. An existing cache is verified in full (the corpus's full fingerprint, opening a
hub corpus; each token file's sha256) and rebuilt if anything differs. Several copies may run
at once, on any nodes sharing the directory: one builds, the others wait (at most
``data.lock_timeout`` seconds) and reuse it (data/cache.py, data/lock.py). With
``data.tokenizer=gpt2`` the ranks are kept in ``$PELAB_CACHE/gpt2.tiktoken`` too: compute nodes
sharing PELAB_CACHE then need no network (data/tokenizers.py).

**Corpora of files (data=text) on a cluster** are built in shards, one per group of files
(data/shards.py), so the work splits across processes or nodes sharing the cache folder:

    python scripts/prepare_data.py data=text data.paths=[/lustre/corpus] shard=0/4   # ... shard=3/4, at once
    python scripts/prepare_data.py data=text data.paths=[/lustre/corpus] merge=true  # checks, writes the manifest

``shard=i/n`` builds (or verifies) groups i, i+n, ... only, each under its own lock; ``merge=true``
tokenizes nothing: it checks every shard is present and complete, names any missing one, and
writes the manifest; the cache's token files are then byte for byte what one process builds.
A corpus that gains files keeps its cache folder: only its new or changed files are encoded.
``clean=true`` lists and removes, under the cache root (``data.data_dir``, else
``$PELAB_CACHE/data``), caches of an older format, shards no manifest references and a build's
leftovers; shards not merged yet are kept; it refuses (one line, nothing removed) while any
process holds a build lock there.

Prints a progress bar while building, then the build's tokens per CPU-second (the whole
process: reading, tokenizing, writing), compared with the tokenizer's raw batch call (tiktoken's
``encode_ordinary_batch``) on the same text: batches spread over the build, encoded again by
both at one thread once the build is done, timed in CPU seconds (data/cache.py ``Throughput``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from _cli import HELP, usage
from _common import ROOT

REFERENCE_TOKENS = 2_000_000  # text of about this many tokens, spread over the build, timed against the raw call
OWN_KEYS = ("shard", "merge", "clean")  # this script's own options, beside train.py's overrides


def own_options(argv: list[str]) -> tuple[dict, list[str]]:
    """(shard=i/n as (i, n), merge=, clean= as booleans), and the other arguments; ValueError
    (one line naming the key, the value and what is allowed) on bad input, before any work."""
    from data.shards import parse_part

    options, rest = {"shard": None, "merge": False, "clean": False}, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in OWN_KEYS:
            rest.append(arg)
            continue
        if key == "shard":
            options["shard"] = parse_part(value)
        elif value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
        else:
            raise ValueError(f"{key}={value} is not valid: expected true or false")
    chosen = [k for k in OWN_KEYS if options[k] not in (None, False)]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} are separate steps: give one of shard=i/n (build part i of n), "
                         f"merge=true (write the manifest once every part is built) or clean=true")
    return options, rest


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import pelab.run  # noqa: F401 - registers the resolvers conf/ uses, as train.py does

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3", job_name="prepare_data"):
        return hydra_compose("config", overrides=overrides)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def main(argv: list[str]) -> int:
    if any(a in HELP for a in argv):
        print(usage(__doc__))
        return 0
    try:
        own, argv = own_options(argv)
    except ValueError as err:
        print(f"prepare_data.py: {err}", file=sys.stderr)
        return 2
    if any(a in ("-m", "--multirun") or a.startswith("hydra/") for a in argv):
        print("prepare_data.py takes train.py's overrides for one data config, not a sweep (-m): give the "
              "data=... overrides the sweep's jobs share", file=sys.stderr)
        return 2
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from data.cache import Throughput, check_cache_folder, prepare_token_files
    from pelab.datamodule import build_datamodule
    from pelab.config import ConfigError, build

    try:
        cfg = compose(argv)
        datamodule = build("data", build_datamodule, cfg.data)
        if hasattr(datamodule, "token_dir"):  # where the cache is built: writable (checked as train.py does)
            build("data.data_dir", check_cache_folder, datamodule.token_dir, "data.data_dir", cfg.data.get("data_dir"),
                  built=False)
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        print(f"prepare_data.py: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    if not hasattr(datamodule, "token_dir"):
        print(f"prepare_data.py: this data config ({cfg.data.get('_target_')}) makes its samples on the fly: there is "
              f"no token cache to prepare", file=sys.stderr)
        return 2
    if own["clean"]:
        return clean(datamodule.token_dir.parents[1])
    sharded = getattr(datamodule.corpus, "prepare_token_files", None)
    if (own["shard"] or own["merge"]) and sharded is None:
        given = f"shard={own['shard'][0]}/{own['shard'][1]}" if own["shard"] else "merge=true"
        print(f"prepare_data.py: {given}: the corpus {datamodule.corpus.cache_name} is one shard (only a corpus of "
              f"files, data=text, is built in shards); build it without shard=/merge=", file=sys.stderr)
        return 2
    try:
        tokenizer = datamodule.tokenizer  # a tokenizer file is read here: its errors name data.tokenizer
        stats = Throughput(reference_tokens=REFERENCE_TOKENS)
        if own["shard"] or own["merge"]:
            meta = sharded(tokenizer, datamodule.token_dir, datamodule.tokenize_num_proc, verify=not own["merge"],
                           stats=stats, lock_timeout=datamodule.lock_timeout, part=own["shard"], merge=own["merge"])
        else:
            meta = prepare_token_files(datamodule.corpus, tokenizer, datamodule.token_dir,
                                       datamodule.tokenize_num_proc, verify=True, stats=stats,
                                       lock_timeout=datamodule.lock_timeout)
    except (ValueError, RuntimeError) as err:
        print(f"prepare_data.py: {err}", file=sys.stderr)
        return 1
    if meta is None:  # one part of a sharded build: the manifest comes with merge=true
        if stats.built:
            print(f"[pelab] throughput: {stats.line()}")
        return 0
    out: Path = datamodule.token_dir
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    tokens = sum(meta["splits"][s]["num_tokens"] for s in meta["splits"])
    counts = ", ".join(f"{s} {meta['splits'][s]['num_tokens']:,} tokens / {meta['splits'][s]['num_documents']:,} "
                       f"documents" for s in meta["splits"])
    done = "merged (every shard present and complete)" if own["merge"] else (
        "built" if stats.built else "verified, already complete")
    print(f"[pelab] token cache {out}: {done}; {counts}; "
          f"{meta['dtype']}, vocabulary {meta['vocab_size']:,}; {human_bytes(size)} on disk "
          f"({size / max(tokens, 1):.2f} bytes per token)")
    if stats.built:
        print(f"[pelab] throughput: {stats.line()}")
    print("[pelab] train.py with the same data overrides uses this cache as it is (no tokenization)")
    return 0


def clean(root: Path) -> int:
    """``clean=true``: what no current manifest references under ``root``, listed and removed."""
    from data.shards import CleanRefused
    from data.shards import clean as remove_stale

    try:
        removed, kept = remove_stale(root)
    except CleanRefused as err:
        print(f"prepare_data.py: {err}", file=sys.stderr)
        return 1
    for path, why, size in removed:
        print(f"[pelab] removed {path} ({human_bytes(size)}): {why}")
    for path, why in kept:
        print(f"[pelab] kept {path}: {why}")
    total = sum(size for _, _, size in removed)
    print(f"[pelab] clean=true under {root}: {len(removed)} removed ({human_bytes(total)}), {len(kept)} kept; every "
          f"cache and shard a current manifest lists was left as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
