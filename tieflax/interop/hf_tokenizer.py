"""The tokenizer side of an HF export: what ``AutoTokenizer``, ``generate`` and lm-eval's ``hf`` backend read.

A tieflax run keeps only ``tokenizer.json`` (a ``tokenizers`` file), which transformers loads with no
special tokens at all: no EOS to stop generation, no BOS for lm-eval's empty-context prefix, no pad. An
export therefore also writes:

* ``tokenizer_config.json``: ``PreTrainedTokenizerFast`` (so the file's own post-processor, if any,
  decides what ``add_special_tokens`` adds, exactly as ``tokenizers`` does in tieflax), the EOS token,
  the token that opens documents as ``bos_token`` (the run's BOS, or EOS when the run has none, as
  GPT-2 does), pad = EOS, and no clean-up of spaces on decode (tieflax decodes without it);
* ``special_tokens_map.json``: the same tokens;
* ``generation_config.json`` and ``config.json`` keys: ``bos_token_id``, ``eos_token_id``, ``pad_token_id``.

    files, ids = tokenizer_files(tokenizer, eos_token="<|endoftext|>", bos_token="", max_length=2048)
"""

from __future__ import annotations

import json
from typing import Any

from tieflax import storage


def special_token_ids(tokenizer, *, eos_token: str, bos_token: str) -> dict[str, int]:
    """{'bos_token_id', 'eos_token_id', 'pad_token_id'} of the run's tokenizer (BOS = EOS without a BOS)."""
    from tieflax.data.tokenizer import bos_id_of, eos_id_of  # noqa: PLC0415

    eos = eos_id_of(tokenizer, eos_token)
    bos = bos_id_of(tokenizer, bos_token)
    return {"bos_token_id": eos if bos is None else bos, "eos_token_id": eos, "pad_token_id": eos}


def write_tokenizer_files(out: str, tokenizer, *, eos_token: str, bos_token: str,
                          max_length: int) -> tuple[list[str], dict[str, int]]:
    """Writes the files above into ``out`` (beside its tokenizer.json; a local folder or a gs:// / s3://
    prefix, through ``tieflax.storage``); -> (file names, token ids)."""
    ids = special_token_ids(tokenizer, eos_token=eos_token, bos_token=bos_token)
    opener = bos_token or eos_token
    special = {"bos_token": opener, "eos_token": eos_token, "pad_token": eos_token}
    files: dict[str, Any] = {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                                  "clean_up_tokenization_spaces": False, **special},
        "special_tokens_map.json": special,
        "generation_config.json": {**ids, "do_sample": False},
    }
    for name, content in files.items():
        storage.write_text(storage.join(out, name), json.dumps(content, indent=2, sort_keys=True))
    return sorted(files), ids


def export_tokenizer_side(out: str, config) -> list[str]:
    """For ``tieflax convert --to-hf``: ``out/tokenizer.json`` (the run's, already copied) gets its
    companion files, and ``out/config.json`` the token ids. ``config`` is the run's root config."""
    from tieflax.data.tokenizer import load_tokenizer  # noqa: PLC0415

    tok = load_tokenizer(storage.join(out, "tokenizer.json"))
    t = config.data.tokenizer
    names, ids = write_tokenizer_files(out, tok, eos_token=t.eos_token, bos_token=t.bos_token,
                                       max_length=int(config.train.seq_len))
    path = storage.join(out, "config.json")
    hf_config = json.loads(storage.read_text(path))
    storage.write_text(path, json.dumps({**hf_config, **ids}, indent=2, sort_keys=True))
    return names
