"""The stdlib-docstring corpus: present offline, deterministic, split cleanly."""
import pytest

from labutils.text import corpus


def test_corpus_is_english_prose_of_the_expected_size():
    text = corpus.load_corpus()
    assert 500_000 < len(text) < 5_000_000
    assert text.count(corpus.SEPARATOR) > 1000
    assert " the " in text and " return" in text.lower()
    assert "\n\n\n" not in text  # blank-line runs collapsed
    assert not any(line != line.rstrip() for line in text[:100_000].splitlines())


def test_corpus_is_cached_and_deterministic():
    first = corpus.load_corpus()
    assert corpus.load_corpus() is first
    corpus.load_corpus.cache_clear()
    again = corpus.load_corpus()
    assert again is not first and again == first


def test_corpus_files_are_sorted_and_skip_tests():
    files = corpus.corpus_files()
    assert files == sorted(files)
    root = corpus.stdlib_dir()
    assert not any("test" in p.relative_to(root).parts[:-1] for p in files)
    assert not any("idlelib" in p.parts for p in files)


def test_docstrings_of_one_file(tmp_path):
    src = tmp_path / "m.py"
    long = "Word " * 30
    src.write_text(f'"""{long}"""\n\ndef f():\n    """short"""\n\nclass C:\n    """{long}\n\n\n\n    more.   """\n')
    docs = corpus._docstrings(src)
    assert docs == [long.strip(), long.strip() + "\n\nmore."]
    (tmp_path / "bad.py").write_text("def (:\n")
    assert corpus._docstrings(tmp_path / "bad.py") == []


def test_split_corpus():
    text = corpus.SEPARATOR.join(f"doc {i} " * 5 for i in range(100))
    train, held = corpus.split_corpus(text)
    assert train + corpus.SEPARATOR + held == text
    assert 0.85 < len(train) / len(text) < 0.95
    assert corpus.split_corpus(text) == (train, held)
    assert not held.startswith("\n") and not train.endswith("\n")
    train, held = corpus.split_corpus("x" * 100, 0.5)
    assert (train, held) == ("x" * 50, "x" * 50)
    with pytest.raises(ValueError, match="frac"):
        corpus.split_corpus(text, 1.0)
    with pytest.raises(TypeError, match="str"):
        corpus.split_corpus(b"bytes")


def test_course_texts():
    prose = corpus.course_prose()
    assert len(prose) >= 5000  # lesson 01 measures its first 5,000 characters
    samples = corpus.text_samples()
    assert set(samples) == {"english", "japanese", "code", "numbers"}
    assert all(isinstance(v, str) and v for v in samples.values())
