"""Text to token ids and back: BPE training as a tiktoken.Encoding, streaming detokenization, the offline corpus.
May import: labutils.core."""
from labutils.text.corpus import course_prose, load_corpus, load_docstrings, split_corpus, text_samples
from labutils.text.dataset import course_tokens, encode_documents
from labutils.text.detokenize import StreamDecoder, stream_decode
from labutils.text.tokenizer import (ENCODING_NAMES, GPT4_SPLIT_PATTERN, bpe_merges, encode, get_encoding,
                                     train_bpe)
