"""Tokenizers: byte-level (no training), SentencePiece (trained on the training split), symbols (synthetic
tasks), and a pretrained model's own Hugging Face tokenizer (`tokenizer.json`).

Each has pad, bos and eos ids (and mask where the objective needs it), and `first_real`: the first id
that is an ordinary token (MLM's random replacements are drawn from there up).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
from collections.abc import Iterable, Sequence

from jaxformer.config import Config
from jaxformer.data.sources import DataError

# A workdir made by `jaxformer import-hf` keeps the pretrained model's tokenizer and config.json here.
HF_DIR = "hf"


class ByteTokenizer:
    """UTF-8 bytes shifted past four special ids: V = 260, nothing to train or save."""

    pad_id, bos_id, eos_id, mask_id = 0, 1, 2, 3
    offset = first_real = 4
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes, each plus 4.

        Args:
            text: one text.

        Returns:
            Its ids.
        """
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        """The bytes of the ids past the specials, undecodable ones replaced.

        Args:
            ids: token ids.

        Returns:
            The text.
        """
        # A model larger than the tokenizer (V padded to a multiple of 128) may sample ids past it: not text.
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> dict[int, bytes]:
        """Each ordinary token's bytes (structured outputs: `jaxformer.engine.guided`).

        Returns:
            {id: its one byte}.
        """
        return {b + self.offset: bytes([b]) for b in range(256)}


class SymbolTokenizer:
    """Synthetic tasks (copy, reverse): pad 0, bos 1, symbols 2..V-1 written as numbers.

    Args:
        vocab_size: V.
    """

    pad_id, bos_id, first_real = 0, 1, 2
    eos_id = mask_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """Numbers separated by spaces, each its own id.

        Args:
            text: one text.

        Returns:
            Its ids.

        Raises:
            ValueError: a token that is not a number.
        """
        symbols = text.split()
        for s in symbols:
            if not s.isdecimal():
                raise ValueError(f"{s!r} is not a symbol: this task's tokens are numbers separated by spaces")
        return [int(s) for s in symbols]

    def decode(self, ids: Iterable[int]) -> str:
        """The symbols as numbers separated by spaces (pad and bos dropped).

        Args:
            ids: token ids.

        Returns:
            The text.
        """
        return " ".join(str(int(i)) for i in ids if i > self.bos_id)

    def token_bytes(self) -> dict[int, bytes]:
        """Symbols are no text to hold to a pattern.

        Returns:
            Nothing: it raises.

        Raises:
            ValueError: always.
        """
        raise ValueError("a symbols tokenizer's tokens are numbers, not text: no pattern can hold them")


class SentencePieceTokenizer:
    """A SentencePiece model (BPE or unigram) with pad 0, unk 1, bos 2, eos 3 and a [MASK] piece.

    Args:
        model_file: the trained `.model` file.

    Raises:
        FileNotFoundError: no such file.
        DataError: the file is not a SentencePiece model.
    """

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3
    first_real = 4

    def __init__(self, model_file: str | pathlib.Path):
        import sentencepiece as spm

        self.model_file = pathlib.Path(model_file)
        if not self.model_file.is_file():
            raise FileNotFoundError(f"SentencePiece model {self.model_file} does not exist")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.model_file))
        except RuntimeError as e:  # "INTERNAL: could not parse ModelProto from ..."
            raise DataError(f"{self.model_file} is not a SentencePiece model ({e}): damaged or not one") from None
        self.vocab_size = self.sp.get_piece_size()
        self.mask_id = self.sp.piece_to_id("[MASK]")

    @classmethod
    def train(
        cls, texts: Sequence[str], model_file: str | pathlib.Path, vocab_size: int, model_type: str = "bpe"
    ) -> SentencePieceTokenizer:
        """Train on `texts` (the training split only) and save `model_file` (+ .vocab).

        The files are written under a temporary name and renamed into place: a training that fails
        (DataError naming the data.spm_vocab_size that works) or is killed leaves no model behind.

        Args:
            texts: the training split's texts.
            model_file: where the model goes.
            vocab_size: V (`data.spm_vocab_size`).
            model_type: "bpe" or "unigram".

        Returns:
            The trained tokenizer.
        """
        import sentencepiece as spm

        model_file = pathlib.Path(model_file)
        model_file.parent.mkdir(parents=True, exist_ok=True)
        part = model_file.with_name(f"{model_file.stem}-part-{os.getpid()}")
        try:
            cls._train(spm, texts, part, vocab_size, model_type)
            os.replace(part.with_suffix(".vocab"), model_file.with_suffix(".vocab"))
            os.replace(part.with_suffix(".model"), model_file)  # last: the model is there only when complete
        finally:
            for suffix in (".model", ".vocab"):
                part.with_suffix(suffix).unlink(missing_ok=True)
        return cls(model_file)

    @staticmethod
    def _train(spm, texts: Sequence[str], prefix: pathlib.Path, vocab_size: int, model_type: str) -> None:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts),
                model_prefix=str(prefix),
                vocab_size=vocab_size,
                model_type=model_type,
                pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                user_defined_symbols=["[MASK]"],
                character_coverage=1.0,
                input_sentence_size=200_000,
                shuffle_input_sentence=True,
                num_threads=2,
                minloglevel=2,
            )  # fmt: skip
        except RuntimeError as e:  # SentencePiece's checks fail as "INTERNAL: file(line) [condition] message"
            raise DataError(_spm_failure(str(e), vocab_size)) from None

    def encode(self, text: str) -> list[int]:
        """The text's pieces.

        Args:
            text: one text.

        Returns:
            Its ids.
        """
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """The pieces' text, specials and ids past the vocabulary dropped.

        Args:
            ids: token ids.

        Returns:
            The text.
        """
        keep = [int(i) for i in ids if self.eos_id < int(i) < self.vocab_size or int(i) == self.unk_id]
        return self.sp.decode(keep)  # ids past the pieces (a larger model's) are no text, as specials are not

    def token_bytes(self) -> dict[int, bytes]:
        """Each ordinary piece's bytes: "▁" a space, a byte piece ("<0x0A>") its byte; the specials and
        [MASK] have none. `decode` drops the space of a text's first "▁".

        Returns:
            {id: bytes}.
        """
        out = {}
        for i in range(self.vocab_size):
            if not (self.sp.is_control(i) or self.sp.is_unknown(i) or i == self.mask_id):
                out[i] = _piece_bytes(self.sp.id_to_piece(i), byte=self.sp.is_byte(i))
        return out


def _spm_failure(message: str, vocab_size: int) -> str:
    """SentencePiece's refusal of a vocabulary size, as the data.spm_vocab_size that works.

    Too small: every character kept by character_coverage (1.0: all of the training split's; the space
    counts as its "▁") needs a piece, as do the 5 meta pieces (pad, unk, bos, eos, [MASK]); its message
    gives that sum, the smallest size that trains ("20 vs 79"). Too large: the corpus has fewer
    distinct pieces than asked for ("Please set it to a value <= 65")."""
    setting = f"data.spm_vocab_size={vocab_size}"
    if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
        return (
            f"{setting} is too small for the training split: its characters and the 5 special pieces "
            f"need data.spm_vocab_size >= {m.group(1)}"
        )
    if m := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message):
        return f"{setting} is too large for the training split, which makes at most {m.group(1)} pieces"
    return f"SentencePiece cannot train with {setting}: {message.split('] ', 1)[-1]}"


def _piece_bytes(piece: str, byte: bool) -> bytes:
    """A SentencePiece-style piece's bytes: a byte piece ("<0x0A>", `byte`) its byte, else its text with
    "▁" as the space it stands for."""
    return bytes([int(piece[3:5], 16)]) if byte else piece.replace("▁", " ").encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a byte-level BPE's
    tokens (the printable Latin-1 bytes as themselves, the others as chr(256 + k) in order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback piece

# A Hugging Face tokenizer's usual spellings of its special tokens, tried in order where config.json names no id.
HF_SPECIAL_TOKENS = {
    "bos": ("<s>", "[CLS]", "<|begin_of_text|>", "<|endoftext|>"),
    "eos": ("</s>", "[SEP]", "<|end_of_text|>", "<|endoftext|>"),
    "pad": ("<pad>", "[PAD]"),
    "mask": ("<mask>", "[MASK]"),
    "unk": ("<unk>", "[UNK]"),
}


class HFTokenizer:
    """A Hugging Face fast tokenizer: `tokenizer.json` in a model directory, read by the `tokenizers`
    library, so a pretrained model is fed the ids it was trained on.

    Special ids come from the directory's `config.json` (`bos_token_id`, `eos_token_id`,
    `pad_token_id`; an encoder-decoder's `decoder_start_token_id` is its bos, the token the decoder
    starts from) and, for those it does not name, from the tokenizer's own special tokens. A model
    without a padding token (GPT-2, Llama) pads with eos: which positions are padding is always
    said by lengths, never read off an id. Texts are encoded without the tokenizer's template
    ([CLS] ... [SEP], </s>): the data pipeline adds bos/eos as for every tokenizer.

    Args:
        directory: the model directory (tokenizer.json, config.json).

    Raises:
        FileNotFoundError: the directory has no tokenizer.json.
        DataError: tokenizer.json cannot be read.
    """

    first_real = 0  # BERT's random replacements come from the whole vocabulary

    def __init__(self, directory: str | pathlib.Path):
        from tokenizers import Tokenizer

        directory = pathlib.Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: jaxformer reads a Hugging Face tokenizer as its tokenizer.json "
                "(save one with `AutoTokenizer.from_pretrained(...).save_pretrained(DIR)`)"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception (bad JSON, an unknown model type)
            raise DataError(f"{path} cannot be read as a Hugging Face tokenizer ({e})") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if config.get("is_encoder_decoder") and config.get("decoder_start_token_id") is not None:
            config = config | {"bos_token_id": config["decoder_start_token_id"]}

        def special(name: str) -> int | None:
            given = config.get(f"{name}_token_id")
            if isinstance(given, list):  # Llama 3 lists several eos ids: the first ends a text
                given = given[0] if given else None
            if given is not None:
                return int(given)
            found = (self.tokenizer.token_to_id(t) for t in HF_SPECIAL_TOKENS[name])
            return next((i for i in found if i is not None), None)

        self.bos_id, self.eos_id, self.mask_id, self.unk_id = (special(n) for n in ("bos", "eos", "mask", "unk"))
        pad = special("pad")
        self.pad_id = pad if pad is not None else self.eos_id if self.eos_id is not None else 0

    def encode(self, text: str) -> list[int]:
        """The text's ids, without the tokenizer's template.

        Args:
            text: one text.

        Returns:
            Its ids.
        """
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """The ids' text, special tokens skipped.

        Args:
            ids: token ids.

        Returns:
            The text.
        """
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self) -> dict[int, bytes]:
        """Each ordinary token's bytes, as its decoder writes them: byte-level (GPT-2, Llama 3, Qwen) through
        the byte alphabet; Metaspace or "▁" replaced by a space (T5, Llama 2, Gemma), byte-fallback pieces
        ("<0x0A>") their byte; an added token that is not special its text. Special tokens have none.

        Returns:
            {id: bytes}.

        Raises:
            ValueError: a decoder that does not write tokens as bytes one after another (WordPiece's
                "##", which joins words with spaces), or none.
        """
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        added = self.tokenizer.get_added_tokens_decoder()
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        if "ByteLevel" in kinds:
            alphabet = _byte_level_alphabet()
            convert = lambda token: bytes(alphabet[c] for c in token)
        elif "Metaspace" in kinds or "Replace" in kinds:
            fallback = "ByteFallback" in kinds
            convert = lambda token: _piece_bytes(token, byte=fallback and _BYTE_PIECE.fullmatch(token) is not None)
        else:
            raise ValueError(
                f"this tokenizer's decoder ({', '.join(sorted(map(str, kinds))) or 'none'}) does not write tokens "
                "as bytes one after another: no pattern can hold its outputs"
            )
        out = {}
        for token, i in vocab.items():
            if i not in added:
                with contextlib.suppress(KeyError):  # a byte-level token of a character outside the alphabet
                    out[i] = convert(token)
        out |= {i: t.content.encode("utf-8") for i, t in added.items() if not t.special}
        return out


def load_tokenizer(
    cfg: Config, workdir: str | pathlib.Path
) -> ByteTokenizer | SymbolTokenizer | SentencePieceTokenizer | HFTokenizer:
    """The tokenizer a run in `workdir` was trained with (no corpus is read).

    Args:
        cfg: the run's config (data.tokenizer).
        workdir: the run's directory (tokenizer.model, hf/).

    Returns:
        The tokenizer.

    Raises:
        DataError: a SentencePiece run whose workdir has no tokenizer.model yet.
    """
    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.data.tokenizer == "symbols":
        return SymbolTokenizer(cfg.data.synthetic_vocab)
    if cfg.data.tokenizer == "hf":
        return HFTokenizer(pathlib.Path(workdir) / HF_DIR)
    model_file = pathlib.Path(workdir) / "tokenizer.model"
    if not model_file.is_file():
        raise DataError(f"{model_file} does not exist: train in this workdir first")
    return SentencePieceTokenizer(model_file)


def train_tokenizer(cfg: Config, train_texts: Iterable[str], workdir) -> None:
    """SentencePiece, trained on the training split's texts into WORKDIR/tokenizer.model (once: a
    resumed run keeps the tokenizer it was trained with); other tokenizers train nothing.

    Args:
        cfg: the run's config (data.tokenizer, spm_vocab_size, spm_model_type).
        train_texts: the training split's texts.
        workdir (str | pathlib.Path | None): the run's directory; None: the current one.
    """
    model_file = pathlib.Path(workdir or ".") / "tokenizer.model"
    if cfg.data.tokenizer == "sentencepiece" and not model_file.is_file():
        SentencePieceTokenizer.train(train_texts, model_file, cfg.data.spm_vocab_size, cfg.data.spm_model_type)
