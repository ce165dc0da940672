"""labutils.core.paths: the one data/ lookup, and the build backend that refuses a plain `pip install .`."""
import importlib.util
import re
from pathlib import Path

import pytest

from labutils.core import paths
from labutils.model.checkpoints import DATA_DIR
from labutils.text.tokenizer import DATA_DIR as TOKENIZER_DIR
from labutils.widgets.quiz import QUIZ_DIR

ROOT = Path(__file__).resolve().parents[1]
# `root / "data"`, `"data" / x`, `Path("data...")`: a path to data/ built by hand (messages may name data/).
PATH_BUILT = r"""/\s*["']data["']|["']data["']\s*/|Path\(\s*["']data"""


def test_every_module_reads_the_clones_data_folder():
    assert paths.data_dir() == ROOT / "data" == DATA_DIR
    assert (TOKENIZER_DIR, QUIZ_DIR) == (ROOT / "data" / "tokenizer", ROOT / "data" / "quizzes")
    assert all(paths.data_dir(sub).is_dir() for sub in paths.SUBFOLDERS)


def test_no_module_builds_its_own_data_path():
    """Every read of data/ goes through paths.data_dir, so the missing-folder message is the same everywhere."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "labutils").rglob("*.py")
                 if p.name != "paths.py" and re.search(PATH_BUILT, p.read_text())]
    assert offenders == [], f"these modules spell out data/ themselves; use labutils.core.paths.data_dir: {offenders}"


def test_a_missing_data_folder_says_to_install_from_the_clone(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "SOURCE_ROOT", tmp_path / "site-packages")
    with pytest.raises(FileNotFoundError) as err:
        paths.data_dir("quizzes")
    message = str(err.value)
    assert str(tmp_path / "site-packages" / "data") in message
    assert "pip install -e ." in message and "not `pip install .`" in message


def test_an_unknown_subfolder_is_named():
    with pytest.raises(ValueError, match=r"sub must be one of 'tiny'.*got 'quizes'"):
        paths.data_dir("quizes")


def test_the_build_backend_refuses_a_wheel_and_keeps_editable_installs():
    spec = importlib.util.spec_from_file_location("build_backend", ROOT / "tools" / "build_backend.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    for hook in (backend.get_requires_for_build_wheel, lambda: backend.build_wheel(str(ROOT / "build"))):
        with pytest.raises(SystemExit, match=r"pip install -e \."):
            hook()
    assert callable(backend.build_editable) and callable(backend.get_requires_for_build_editable)
