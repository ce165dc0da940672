"""Text to token ids and back: BPE training as a tiktoken.Encoding, streaming detokenization, the offline corpus.
May import: labutils.core."""
from labutils.core.surface import lazy_surface

SURFACE = {
    "labutils.text.corpus": ["course_prose", "load_corpus", "load_docstrings", "split_corpus", "text_samples"],
    "labutils.text.dataset": ["course_tokens", "encode_documents"],
    "labutils.text.detokenize": ["StreamDecoder", "stream_decode"],
    "labutils.text.tokenizer": ["ENCODING_NAMES", "GPT4_SPLIT_PATTERN", "bpe_merges", "encode", "get_encoding",
                                "train_bpe"],
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, SURFACE)
