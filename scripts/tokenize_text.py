"""Text to a `tokens:` data file: the ids of a real tokenizer as one flat uint16/uint32 array.

    pip install tokenizers                       # Hugging Face's tokenizers (in the dev extra)
    python scripts/tokenize_text.py corpus.txt corpus.tokens --vocab 8192
    python scripts/tokenize_text.py corpus.txt corpus.tokens --tokenizer tokenizer.json

Without `--tokenizer` it trains a byte-level BPE tokenizer of `--vocab` ids on the text
itself (nothing is downloaded) and saves it as `<out>.tokenizer.json`; with one it encodes
with that file (a model's `tokenizer.json`, fetched beforehand: this script never reaches
the network). It prints the spec fields that read the file: `data.source`,
`data.token_dtype` and the `model.vocab` the ids need.
"""

from __future__ import annotations

import argparse
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

LINES_PER_BATCH = 10_000  # encode in batches: the corpus never has to fit in memory


def train_bpe(text: Path, vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(text)], trainer)
    return tok


def tokenize(text: Path, out: Path, tok: Tokenizer) -> tuple[int, str]:
    """Write every line's ids to `out`; returns (ids written, numpy dtype name)."""
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    count = 0
    with text.open(encoding="utf-8") as src, out.open("wb") as dst:
        while batch := list(islice(src, LINES_PER_BATCH)):
            for enc in tok.encode_batch(batch):
                np.asarray(enc.ids, dtype=dtype).tofile(dst)
                count += len(enc.ids)
    return count, np.dtype(dtype).name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text", type=Path, help="a UTF-8 text file")
    ap.add_argument("out", type=Path, help="the token file to write")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer.json to encode with")
    ap.add_argument("--vocab", type=int, default=8192, help="ids of the BPE trained without one")
    args = ap.parse_args(argv)
    if args.tokenizer:
        tok = Tokenizer.from_file(str(args.tokenizer))
    else:
        tok = train_bpe(args.text, args.vocab)
        tok.save(str(args.out.with_name(args.out.name + ".tokenizer.json")))
    count, dtype = tokenize(args.text, args.out, tok)
    print(f"{count} tokens -> {args.out}")
    print(
        f"data: {{source: 'tokens:{args.out.resolve()}', token_dtype: {dtype}}}\n"
        f"model: {{vocab: {tok.get_vocab_size()}}}  # at least this many ids\n"
        "# a job reads the file only under a data root (--data-root; meshkeeper up: RUN_DIR/data)"
    )


if __name__ == "__main__":
    main()
