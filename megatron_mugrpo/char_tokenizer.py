"""The character-level tokenizer of the CPU demos, the tiny test models and the built-in tasks.

Nothing can be downloaded at run time, so the demos' models read text one character per token, with a
vocabulary built here (under 128 ids); ``build_char_tokenizer`` makes it a Hugging Face fast tokenizer
that ``AutoTokenizer.from_pretrained`` loads back. It sits on the bottom floor (it imports nothing of the
package) because the tasks, the environments' demo, the tiny models and the warm start all read it.

    tokenizer = build_char_tokenizer("runs/demo/tokenizer")   # AutoTokenizer-loadable
    tokenizer = load_tokenizer_dir("runs/demo/base_model")     # any model directory's, this one kept as built
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = string.digits + "+-*/=()[]{}\\^_.,:;!?'\"<>|$%&#` \n" + string.ascii_letters
"""Everything the tasks, the answer formats (``\\boxed{}``, a fenced program) and short English
instructions need. The backtick of code fences took the place of '~' (which nothing here needs), so
the vocabulary's size and every other token's id are those of the math demo's models before it."""


def char_vocab() -> dict[str, int]:
    """Token → id: the special tokens first (pad = 0, bos = 1, eos = 2, unk = 3), then characters."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}


def build_char_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer (vocabulary < 128) built locally with `tokenizers`.

    Encoding prepends <bos>; decoding concatenates characters. Unknown characters map to <unk>.
    When ``out_dir`` is given the tokenizer is saved there (``AutoTokenizer.from_pretrained`` loads it).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Oniguruma's (?m) lets '.' match newlines too: every character is its own pre-token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def load_tokenizer_dir(path: str | Path) -> Any:
    """A Hugging Face directory's tokenizer: ``AutoTokenizer``'s, except the character tokenizer above, which
    is read back as the fast tokenizer it was written as.

    transformers 5 chooses the tokenizer class from config.json's ``model_type``, and a built tiny model's
    directory says qwen2: ``Qwen2Tokenizer`` then replaces the pre-tokenizer and drops every space
    ('Ab Cd' → 'AbCd'). The arithmetic tasks have no spaces; text tasks (qa prompts, retrieved documents,
    search queries) do, and a model warm-started on the built tokenizer would be run on another one."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if _holds_char_tokenizer(Path(path)):
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _holds_char_tokenizer(path: Path) -> bool:
    try:
        vocab = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return vocab == char_vocab()
