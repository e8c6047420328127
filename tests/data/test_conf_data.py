"""conf/data: a file per corpus, the options they share written once in conf/data/common/."""

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException

CONF = Path(__file__).resolve().parents[2] / "conf"
CORPORA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
COMMON = {p.stem: yaml.safe_load(p.read_text()) for p in (CONF / "data" / "common").glob("*.yaml")}


def test_a_bad_data_choice_lists_the_corpora_and_not_the_shared_options():
    assert {"gutenberg", "synthetic", "text"} <= set(CORPORA)
    with initialize_config_dir(str(CONF), version_base="1.3"), pytest.raises(MissingConfigException) as err:
        compose("config", overrides=["data=nosuch"])
    listed = str(err.value).split("Available options in 'data':")[1].split("Config search path")[0].split()
    assert listed == CORPORA


@pytest.mark.parametrize("corpus", CORPORA)
def test_no_corpus_file_repeats_a_shared_option_with_its_shared_value(corpus):
    values = yaml.safe_load((CONF / "data" / f"{corpus}.yaml").read_text())
    copies = [f"{key}: {values[key]!r} (conf/data/common/{name}.yaml)" for name, common in sorted(COMMON.items())
              for key in common if key != "defaults" and key in values and values[key] == common[key]]
    assert not copies, f"conf/data/{corpus}.yaml repeats " + ", ".join(copies)


def test_each_corpus_takes_the_shared_options():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        for corpus in CORPORA:
            data = compose("config", overrides=[f"data={corpus}"]).data
            shared = COMMON["stream"] if corpus == "synthetic" else {**COMMON["stream"], **COMMON["text"]}
            assert set(shared) - {"defaults"} <= set(data), corpus
