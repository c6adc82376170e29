"""The Hugging Face `tokenizers` tokenizer a dataset is prepared with: its file, its
vocabulary size and its end-of-document id."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dataset.format import DatasetError

# End-of-text tokens of real tokenizers, most common first: GPT-2, Qwen and Falcon
# (<|endoftext|>), Llama 3 (<|end_of_text|>), Llama 2, Mistral and T5 (</s>), Gemma (<eos>).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


@dataclass(frozen=True)
class LoadedTokenizer:
    json: str  # tokenizer.json's text: what the worker processes build theirs from
    path: Path
    sha256: str
    vocab_size: int  # ids it can emit: the largest id + 1, added tokens included
    eos_id: int
    eos_from: str  # for people: where eos_id came from


def load(source: Path, eos_id: int | None) -> LoadedTokenizer:
    from tokenizers import Tokenizer

    path = source / "tokenizer.json" if source.is_dir() else source
    try:
        raw = path.read_bytes()
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except FileNotFoundError:
        hint = (
            " (a model directory with only a slow tokenizer's files: save it with "
            "transformers' AutoTokenizer(...).save_pretrained to get one)"
            if source.is_dir()
            else ""
        )
        raise DatasetError(f"--tokenizer: {path} does not exist{hint}") from None
    except Exception as e:  # OSError, UnicodeDecodeError, and tokenizers' plain Exception
        raise DatasetError(
            f"--tokenizer: {path} is not a Hugging Face tokenizer.json ({e})"
        ) from None
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if eos_id is not None:
        eos_from = "--eos-id"
    else:
        eos_id, eos_from = _find_eos(tok, source)
    if eos_id >= vocab_size:
        raise DatasetError(
            f"the end-of-document id {eos_id} ({eos_from}) is not an id of {path} (its "
            f"vocabulary has {vocab_size} ids); pass an --eos-id below {vocab_size}"
        )
    return LoadedTokenizer(
        raw.decode("utf-8"), path, hashlib.sha256(raw).hexdigest(), vocab_size, eos_id, eos_from
    )


def _find_eos(tok, source: Path) -> tuple[int, str]:
    # A model directory's tokenizer_config.json names the EOS the model was trained with
    # (Llama 3 Instruct's is <|eot_id|>, not <|end_of_text|>): it wins over the guess by name.
    config = source / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return tok.token_to_id(eos), f"{eos} in {config}"
    for name in EOS_NAMES:
        if (found := tok.token_to_id(name)) is not None:
            return found, f"the tokenizer's {name}"
    raise DatasetError(
        f"--tokenizer: {source} has no end-of-text token ({', '.join(EOS_NAMES)}); pass the id "
        "that ends each document with --eos-id"
    )
