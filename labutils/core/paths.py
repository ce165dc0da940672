"""The one lookup for the course's data/ folder (tokenizer, checkpoints, quizzes, texts)."""
from __future__ import annotations

from pathlib import Path

# data/ sits next to labutils/ in the clone. Only an editable install (`pip install -e .`) keeps the package
# there; a plain `pip install .` copies labutils/ into site-packages and leaves data/ behind.
SOURCE_ROOT = Path(__file__).resolve().parents[2]      # labutils/core/paths.py -> the clone
SUBFOLDERS = ("tiny", "draft", "tokenizer", "quizzes", "texts")


def data_dir(sub: str | None = None) -> Path:
    """The data/ folder (or one of its SUBFOLDERS); a clear error when the package is not the clone's."""
    if sub is not None and sub not in SUBFOLDERS:
        raise ValueError(f"sub must be one of {', '.join(map(repr, SUBFOLDERS))} or None, got {sub!r}; "
                         "add a new folder to labutils.core.paths.SUBFOLDERS first")
    folder = SOURCE_ROOT / "data"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"labutils cannot find its data folder: {folder} does not exist. The course's tokenizer, "
            "checkpoints and quizzes live in the clone's data/, which only an editable install keeps next "
            "to the code. Install from the clone with `pip install -e .` (or `make setup`), not `pip install .`.")
    return folder if sub is None else folder / sub
