"""pelab/datamodule.py's ``build_datamodule`` on the data configs runs saved beside their
checkpoints: a ``_target_`` in the spelling of an older run (data.datamodule.*,
data.synthetic.*) builds the data module it named, with the options it saved."""

from pathlib import Path

from omegaconf import OmegaConf

from data.corpus import GutenbergCorpus, TextFilesCorpus
from pelab.datamodule import SyntheticDataModule, TextDataModule, TextFilesDataModule, build_datamodule

ROOT = Path(__file__).resolve().parents[2]


def test_a_saved_text_config_of_an_older_run_builds_the_text_module():
    saved = OmegaConf.load(ROOT / "tests" / "fixtures" / "main-b42b955-rope.yaml").data
    assert saved._target_ == "data.datamodule.TextDataModule"
    dm = build_datamodule(saved)
    assert type(dm) is TextDataModule and isinstance(dm.corpus, GutenbergCorpus)
    assert (dm.tokenizer_name, dm.block_size, dm.batch_size, dm.val_batch_size, dm.val_windows, dm.seed) == \
        ("bytes", 256, 16, 16, 256, 1337)


def test_older_synthetic_and_text_files_targets_build_their_modules(tmp_path):
    dm = build_datamodule({"_target_": "data.synthetic.SyntheticDataModule", "task": "copy", "block_size": 32,
                           "batch_size": 4, "tokens_per_step": None})
    assert type(dm) is SyntheticDataModule and (dm.task.name, dm.block_size, dm.batch_size) == ("copy", 32, 4)
    (tmp_path / "a.txt").write_text("one document")
    (tmp_path / "b.txt").write_text("another")
    corpus = {"_target_": "data.corpus.TextFilesCorpus", "paths": [str(tmp_path)]}
    dm = build_datamodule(OmegaConf.create({"_target_": "data.datamodule.TextFilesDataModule", "corpus": corpus,
                                            "paths": [str(tmp_path)], "block_size": 16}))
    assert type(dm) is TextFilesDataModule and isinstance(dm.corpus, TextFilesCorpus) and dm.block_size == 16


def test_todays_targets_are_left_as_they_are():
    dm = build_datamodule({"_target_": "pelab.datamodule.SyntheticDataModule", "task": "passkey", "block_size": 64})
    assert type(dm) is SyntheticDataModule and dm.task.name == "passkey"
